"""Causal language modelling on the encoder: predict token t+1 from positions <= t.

Gisserot-Boukhlef et al. 2025, "Should We Still Pretrain Encoders with Masked Language Modeling?"
(CLM and CLM->MLM on one encoder). The student is the same bidirectional HF encoder; only
the attention mask passed at call time is causal, so the saved config (is_decoder=False) and the
exported model stay a bidirectional encoder.

Targets: position t predicts input_ids[t+1] for every t whose successor t+1 is a real, non-special
token (never [CLS]/[SEP]/padding, exactly the tokens MLM may select). With packed sequences
`[CLS] x1 .. xn [SEP]` that is n targets per row: [CLS] predicts x1, ..., x_{n-1} predicts x_n; an
inner document separator predicts the next document's first token. The input is the *uncorrupted*
`batch.input_ids`; the vocabulary head runs at the target positions only.

The causal mask is handed to the HF model as an already prepared 4-D mask (B, 1, T, T), which
transformers 5.x passes through untouched (`masking_utils._preprocess_mask_arguments`): boolean
(True = attend) for SDPA, additive (0 / dtype-min) for eager attention. ModernBERT takes a dict
with one mask per layer type, so its sliding-window layers keep their window.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from mlsm.data.batches import Batch
from mlsm.errors import UserError
from mlsm.models.backbone import Student
from mlsm.objectives.base import Context, Objective, ObjectiveOutput
from mlsm.objectives.mlm import vocab_loss


def causal_allowed(attention_mask: torch.Tensor) -> torch.Tensor:
    """Bool (B, 1, T, T): query q may attend key k iff k <= q and k is a real token."""
    t = attention_mask.shape[1]
    lower = torch.ones(t, t, dtype=torch.bool, device=attention_mask.device).tril()  # (T, T)
    return lower[None, None] & attention_mask.bool()[:, None, None, :]


def _as_hf_mask(allowed: torch.Tensor, config: Any, dtype: torch.dtype) -> torch.Tensor:
    """The 4-D mask in the form the configured attention implementation expects."""
    impl = getattr(config, "_attn_implementation", "eager") or "eager"
    if impl == "sdpa":
        return allowed
    if impl == "eager":
        zero = torch.zeros((), dtype=dtype, device=allowed.device)
        return torch.where(allowed, zero, torch.finfo(dtype).min)
    raise UserError(f"causal attention needs attn_implementation sdpa or eager, the model uses "
                    f"{impl!r}; set model.overrides={{attn_implementation: sdpa}}")


def _plain_mask(student: Student, allowed: torch.Tensor) -> Any:
    return _as_hf_mask(allowed, student.config,
                       student.backbone.get_input_embeddings().weight.dtype)


def _modernbert_mask(student: Student, allowed: torch.Tensor) -> Any:
    cfg = student.config
    t = allowed.shape[-1]
    idx = torch.arange(t, device=allowed.device)
    # (T, T), as ModernBERT's local layers
    window = (idx[:, None] - idx[None, :]).abs() <= cfg.sliding_window // 2
    dtype = student.backbone.get_input_embeddings().weight.dtype
    return {"full_attention": _as_hf_mask(allowed, cfg, dtype),
            "sliding_attention": _as_hf_mask(allowed & window, cfg, dtype)}


# model_type -> how that family takes a prepared causal mask. DeBERTa-v2 is absent: it builds its
# own (B, 1, T, T) mask from a 2-D/3-D one and multiplies its embeddings by the input mask, so a
# causal mask cannot be passed through its public forward.
_CAUSAL_MASKS: dict[str, Callable[[Student, torch.Tensor], Any]] = {
    "bert": _plain_mask,
    "roberta": _plain_mask,
    "xlm-roberta": _plain_mask,
    "electra": _plain_mask,
    "modernbert": _modernbert_mask,
}


def check_causal_support(student: Student) -> None:
    kind = student.config.model_type
    if kind not in _CAUSAL_MASKS:
        raise UserError(f"causal attention is not supported for model.arch={kind!r}; "
                        f"use one of {', '.join(sorted(_CAUSAL_MASKS))}")


def causal_mask(student: Student, attention_mask: torch.Tensor) -> Any:
    """The (B, T) padding mask as the causal mask the student's HF family takes."""
    check_causal_support(student)
    return _CAUSAL_MASKS[student.config.model_type](student, causal_allowed(attention_mask))


def causal_encode(student: Student, input_ids: torch.Tensor,
                  attention_mask: torch.Tensor) -> torch.Tensor:
    """Last hidden states (B, T, d) of the student run with causal self-attention."""
    return student(input_ids, causal_mask(student, attention_mask))


def next_token_targets(batch: Batch) -> torch.Tensor:
    """Bool (B, T): positions t that predict input_ids[t+1] (successor real and non-special)."""
    succ_ok = batch.attention_mask[:, 1:].bool() & ~batch.special_mask[:, 1:]  # (B, T-1)
    return F.pad(succ_ok, (0, 1), value=False)


@dataclass
class CLMConfig:
    name: Literal["clm"] = "clm"
    """Objective name (the tag of the objective group)."""


class CLM(Objective):
    Config = CLMConfig
    exports_vocab_head = True  # the vocabulary head is trained (as a next-token head)
    scored_by_pll = False  # Gisserot-Boukhlef et al. 2025 evaluate CLM encoders by fine-tuning
    pll_refusal = ("it learnt under a causal mask to predict token t+1 at position t, and PLL "
                   "asks position t for its own masked token with the whole sentence visible, so "
                   "it would score noise")

    def __init__(self, cfg: CLMConfig, ctx: Context):
        super().__init__()
        self.cfg = cfg

    def attach(self, student: Student) -> None:
        check_causal_support(student)
        self.vocab_logits = student.vocab_logits  # a bound method: the head stays the student's

    def targets(self, batch: Batch) -> Any:
        where = next_token_targets(batch)  # (B, T)
        return where, batch.input_ids[:, 1:][where[:, :-1]]  # (N,), row-major like hidden[where]

    def student_inputs(self, student: Student, batch: Batch, targets: Any) -> dict[str, Any]:
        """The uncorrupted sequence under causal self-attention."""
        mask = causal_mask(student, batch.attention_mask)
        return {"input_ids": batch.input_ids, "attention_mask": mask}

    def loss(self, hidden: torch.Tensor, targets: Any, batch: Batch) -> ObjectiveOutput:
        where, labels = targets
        logits = self.vocab_logits(hidden[where])  # (N, V)
        return vocab_loss(logits, labels, "clm_loss", "clm_accuracy")
