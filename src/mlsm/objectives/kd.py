"""Knowledge distillation from an MLM teacher (Hinton, Vinyals & Dean 2015; for masked LMs as in
DistilBERT, Sanh et al. 2019): at every selected position the student's vocabulary distribution is
pulled towards the teacher's,

    L_i = T² · KL( softmax(t_i / T) ‖ softmax(s_i / T) ),

t_i, s_i ∈ R^|V| the teacher's and student's logits, T the temperature; the T² factor keeps the
gradient scale independent of T (Hinton et al. 2015, §2). Both heads run at the selected positions
only (N rows, not B·T). Unlike MLSM no early exit is possible: the teacher's vocabulary head sits
on its last layer, so every teacher layer runs.

The teacher reads the same corrupted input as the student by default (DistilBERT's setting: on
the original text an MLM teacher mostly predicts the visible token, which is plain MLM with label
smoothing); `teacher_input: original` gives it the unmasked text instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from transformers import AutoModelForMaskedLM

from mlsm.config import POSITIVE, ranged
from mlsm.data.batches import Batch
from mlsm.data.corpus import require_same_tokenizer, tokenizer_hash
from mlsm.errors import UserError
from mlsm.hf import first_line, load_config, load_model, load_tokenizer
from mlsm.models.backbone import Student
from mlsm.models.heads import mlm_head_fn
from mlsm.objectives.base import Context, Objective, ObjectiveOutput


@dataclass
class KDConfig:
    name: Literal["kd"] = "kd"
    """Objective name (the tag of the objective group)."""
    teacher: str = ""
    """Teacher folder or hub id with a masked-LM head (AutoModelForMaskedLM); required."""
    temperature: float = ranged(1.0, POSITIVE)
    """Softmax temperature T of both distributions; the loss is scaled by T²."""
    teacher_input: Literal["corrupted", "original"] = "corrupted"
    """What the teacher reads: `corrupted` (the student's input, DistilBERT) or `original`."""


def has_mlm_head(path: str) -> bool:
    """Whether the checkpoint's saved architecture carries a masked-LM head (config.architectures);
    AutoModelForMaskedLM would otherwise load a bare encoder with a *random* head, silently."""
    archs = getattr(load_config(path), "architectures", None) or []
    return any(a.endswith(("ForMaskedLM", "ForPreTraining")) for a in archs)


class MLMTeacher:
    """A frozen HF masked LM that returns vocabulary logits at selected positions only."""

    def __init__(self, path: str, ctx: Context):
        if not path:
            raise UserError("objective.teacher is not set; KD needs a teacher with an MLM head: "
                            "pass objective.teacher=PATH (an AutoModelForMaskedLM folder)")
        try:
            tokenizer = load_tokenizer(path)
            mlm = has_mlm_head(path)
            model = load_model(AutoModelForMaskedLM, path) if mlm else None
        except Exception as exc:  # HF raises OSError, ValueError, HTTP errors, ...
            raise UserError(f"cannot load {path!r} as a masked LM ({first_line(exc)}); "
                            "KD needs an AutoModelForMaskedLM folder") from None
        if model is None:
            raise UserError(f"teacher {path!r} has no MLM head (e.g. the packaged MiniLM is a bare "
                            "encoder); KD needs an AutoModelForMaskedLM checkpoint such as "
                            "bert-base-cased")
        require_same_tokenizer(tokenizer, tokenizer_hash(ctx.tokenizer), ctx.store_path)
        try:
            self.head = mlm_head_fn(model)
        except ValueError as exc:
            raise UserError(f"KD teacher: {exc}") from None
        self.model = model.to(ctx.device).eval().requires_grad_(False)

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               select: torch.Tensor) -> torch.Tensor:
        """(B, T) ids, mask, bool selection -> (N, V_teacher) fp32 logits, row-major order of
        select."""
        hidden = self.model.base_model(input_ids=input_ids,
                                       attention_mask=attention_mask).last_hidden_state
        return self.head(hidden[select]).float()  # (N, d) -> (N, V)


def distill_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
               temperature: float) -> torch.Tensor:
    """Per-target T²·KL(softmax(t/T) ‖ softmax(s/T)), shape (N,). Inputs (N, V)."""
    log_p = F.log_softmax(teacher_logits / temperature, dim=-1)  # (N, V)
    log_q = F.log_softmax(student_logits.float() / temperature, dim=-1)
    return temperature**2 * (log_p.exp() * (log_p - log_q)).sum(-1)


class KD(Objective):
    Config = KDConfig
    exports_vocab_head = True  # KD trains the student's vocabulary head
    uses_teacher = True
    flops_row = "KD"

    def __init__(self, cfg: KDConfig, ctx: Context):
        super().__init__()
        if not cfg.temperature > 0:
            raise UserError(f"objective.temperature must be > 0 (got {cfg.temperature}); "
                            "use e.g. 1 or 2")
        if cfg.teacher_input not in ("corrupted", "original"):
            raise UserError(f"objective.teacher_input={cfg.teacher_input!r}; "
                            "use corrupted or original")
        self.cfg = cfg
        self.teacher = MLMTeacher(cfg.teacher, ctx)
        self.vocab = len(ctx.tokenizer)

    def attach(self, student: Student) -> None:
        self.vocab_logits = student.vocab_logits  # a bound method: the head stays the student's

    def targets(self, batch: Batch) -> Any:
        """The teacher's logits (N, V_t) at the selected positions, and the labels (N,)."""
        ids = batch.corrupted_ids if self.cfg.teacher_input == "corrupted" else batch.input_ids
        with torch.autocast(ids.device.type, enabled=False):
            t_logits = self.teacher.logits(ids, batch.attention_mask, batch.selected)  # (N, V_t)
        return t_logits, batch.input_ids[batch.selected]

    def loss(self, hidden: torch.Tensor, targets: Any, batch: Batch) -> ObjectiveOutput:
        t_logits, labels = targets
        s_logits = self.vocab_logits(hidden[batch.selected])  # (N, V_s)
        # Some checkpoints pad the vocabulary matrix (e.g. to a multiple of 8); the extra rows
        # are never real tokens, so both sides are cut to the tokenizer's size.
        kl = distill_kl(s_logits[:, : self.vocab], t_logits[:, : self.vocab],
                        self.cfg.temperature)  # (N,)
        with torch.no_grad():
            metrics = {
                "kd_loss": kl.sum().detach(),
                "accuracy": (s_logits.argmax(-1) == labels).sum().float(),
                "teacher_accuracy": (t_logits.argmax(-1) == labels).sum().float(),
                "agreement": (s_logits.argmax(-1) == t_logits.argmax(-1)).sum().float(),
            }
        return ObjectiveOutput(kl.sum(), labels.new_tensor(labels.numel()), metrics)
