"""MAE-LM (Meng et al. 2024, "Representation deficiency in masked language modeling", §4).

The selected positions (data.mask_rate) are removed from the encoder input, so the encoder never
sees a [MASK] token (δ = 0); the kept tokens keep their original position ids. A shallow
bidirectional decoder (models/mae.py) gets the encoder outputs at their positions and a learned
[MASK] embedding at the removed ones and predicts the original tokens at the selected positions
with a decoder-owned vocabulary head whose output matrix is tied to the encoder's input
embeddings. δ ∈ [0, 1] keeps that fraction of the selected positions in the encoder input as
[MASK] tokens (δ = 1 approaches MLM with a decoder on top). data.mask_split does not apply: every
selected position is either removed or (δ) a [MASK].

Export: only the encoder (AutoModel folder). The decoder and its head are in heads.safetensors for
resume, and are dropped after pre-training as in the paper; the student's HF MLM head is never
trained, so it is not exported (`exports_vocab_head = False`, declared by the class). Nor can the
checkpoint be scored by PLL (`scored_by_pll = False`): the paper evaluates it by fine-tuning, and
`mlsm blimp` / `mlsm probe` refuse it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from mlsm.config import NON_NEGATIVE, ranged
from mlsm.data.batches import Batch
from mlsm.models.backbone import Student
from mlsm.models.mae import (
    DECODER,
    LM_HEAD,
    TiedLMHead,
    build_decoder,
    decode,
    delta_keep,
    encoder_inputs,
    mae_split,
    seeded,
)
from mlsm.objectives.base import Context, Objective, ObjectiveOutput
from mlsm.objectives.mlm import vocab_loss


@dataclass
class MAELMConfig:
    name: Literal["mae_lm"] = "mae_lm"
    """Objective name (the tag of the objective group)."""
    delta: float = ranged(0.0, (lambda v: 0 <= v <= 1, "in [0, 1] (0 removes every selected "
                                                     "position)"))
    """δ: fraction of the selected positions kept in the encoder input as [MASK] (0 = all
    removed)."""
    decoder_layers: int = ranged(0, NON_NEGATIVE)
    """Decoder depth; 0 = 4 for base-size students (hidden size >= 768, Meng et al. 2024), else
    2."""
    decoder_width: int = ranged(0, NON_NEGATIVE)
    """Decoder width; 0 = the encoder's hidden size."""
    decoder_heads: int = ranged(0, NON_NEGATIVE)
    """Decoder attention heads; 0 = the encoder's number of heads."""
    decoder_dropout: float = ranged(0.0, (lambda v: 0 <= v < 1, "in [0, 1) (the paper uses 0)"))
    """Dropout inside the decoder layers (Meng et al. 2024: 0)."""
    seed: int = 0
    """Seed of the decoder's initialisation and of the δ draws (the loop does not seed heads)."""

class MAEDecoderPass(Objective):
    """What MAE-LM and MAE-MLSM share: the encoder/decoder split and the decoder (its head).

    targets(batch): the split (which tokens the encoder keeps), student_inputs: the kept tokens
    with their position ids, decode: encoder states -> decoder states (B, T, d). No loss of its own.
    """

    def __init__(self, cfg: MAELMConfig, ctx: Context):
        super().__init__()
        self.cfg, self.max_len = cfg, ctx.max_len
        tok = ctx.tokenizer
        self.mask_id = int(tok.mask_token_id)
        self.pad_id = int(tok.pad_token_id if tok.pad_token_id is not None else tok.sep_token_id)

    def attach(self, student: Student) -> None:
        cfg = self.cfg
        decoder, meta = build_decoder(student, cfg.decoder_layers, cfg.decoder_width,
                                      cfg.decoder_heads, self.max_len, cfg.seed,
                                      cfg.decoder_dropout)
        self.add_head(DECODER, decoder, meta)

    def targets(self, batch: Batch) -> Any:
        keep = delta_keep(batch.selected, batch.samples, self.cfg.delta, self.cfg.seed)
        return mae_split(batch.input_ids, batch.attention_mask, batch.selected, keep,
                         self.mask_id, self.pad_id)

    def student_inputs(self, student: Student, batch: Batch, targets: Any) -> dict[str, Any]:
        return encoder_inputs(student, targets)

    def decode(self, hidden: torch.Tensor, split: Any, batch: Batch) -> torch.Tensor:
        """Encoder states (B, K, d) of the kept tokens -> decoder states (B, T, d)."""
        return decode(self.heads[DECODER], hidden, split, batch.attention_mask)


class MAELM(Objective):
    Config = MAELMConfig
    scored_by_pll = False  # its vocabulary head reads the decoder; the student's is untrained
    pll_refusal = ("its vocabulary head reads the MAE decoder, which the evaluated encoder drops "
                   "(Meng et al. 2024), and the encoder's own is untrained, so PLL would score "
                   "noise")

    def __init__(self, cfg: MAELMConfig, ctx: Context):
        super().__init__()
        self.split = MAEDecoderPass(cfg, ctx)  # registered first: the decoder's parameters lead
        self.vocab = len(ctx.tokenizer)

    def attach(self, student: Student) -> None:
        self.split.attach(student)
        with seeded(self.split.cfg.seed + 1):
            head = TiedLMHead(student.hidden_size, self.vocab)
        meta = {"class": "TiedLMHead", "d": student.hidden_size, "vocab": self.vocab,
                "tied_to": "encoder input embeddings", "after": DECODER}
        self.add_head(LM_HEAD, head, meta)
        self.embeddings = student.backbone.get_input_embeddings  # bound method: tied output matrix

    def exported_heads(self) -> dict[str, Any]:
        return {**self.split.exported_heads(), **self.heads}

    def head_meta(self) -> dict[str, dict[str, Any]]:
        return {**self.split.head_meta(), **self._head_meta}

    def targets(self, batch: Batch) -> Any:
        return self.split.targets(batch), batch.input_ids[batch.selected]  # split, labels (N,)

    def student_inputs(self, student: Student, batch: Batch, targets: Any) -> dict[str, Any]:
        return self.split.student_inputs(student, batch, targets[0])

    def loss(self, hidden: torch.Tensor, targets: Any, batch: Batch) -> ObjectiveOutput:
        split, labels = targets
        states = self.split.decode(hidden, split, batch)  # (B, T, d)
        emb = self.embeddings().weight  # (V, d), tied output matrix
        logits = self.heads[LM_HEAD](states[batch.selected], emb)  # (N, V)
        return vocab_loss(logits, labels, "mae_loss")
