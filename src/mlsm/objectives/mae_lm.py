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
trained, so it is not exported (student.exports_vocab_head = False).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mlsm.data.batches import Batch
from mlsm.errors import UserError
from mlsm.models.backbone import Student
from mlsm.models.mae import (
    DECODER,
    LM_HEAD,
    TiedLMHead,
    attach_decoder,
    delta_keep,
    mae_forward,
    seeded,
)
from mlsm.objectives.base import Context, ObjectiveOutput


@dataclass
class MAELMConfig:
    delta: float = 0.0
    """δ: fraction of the selected positions kept in the encoder input as [MASK] (0 = all removed)."""
    decoder_layers: int = 0
    """Decoder depth; 0 = 4 for base-size students (hidden size >= 768, Meng et al. 2024), else 2."""
    decoder_width: int = 0
    """Decoder width; 0 = the encoder's hidden size."""
    decoder_heads: int = 0
    """Decoder attention heads; 0 = the encoder's number of heads."""
    decoder_dropout: float = 0.0
    """Dropout inside the decoder layers (Meng et al. 2024: 0)."""
    seed: int = 0
    """Seed of the decoder's initialisation and of the δ draws (the loop does not seed heads)."""


def check_mae_options(cfg: MAELMConfig) -> None:
    if not 0.0 <= cfg.delta <= 1.0:
        raise UserError(f"objective.delta={cfg.delta} must be in [0, 1]; 0 removes every selected position")
    if cfg.decoder_layers < 0 or cfg.decoder_width < 0 or cfg.decoder_heads < 0:
        raise UserError("objective.decoder_layers, decoder_width and decoder_heads must be >= 0 (0 = the default / the encoder's)")
    if not 0.0 <= cfg.decoder_dropout < 1.0:
        raise UserError(f"objective.decoder_dropout={cfg.decoder_dropout} must be in [0, 1); the paper uses 0")


class MAEDecoderPass:
    """What MAE-LM and MAE-MLSM share: options, special ids, attaching and running the split."""

    def __init__(self, cfg: MAELMConfig, ctx: Context):
        check_mae_options(cfg)
        self.cfg, self.max_len = cfg, ctx.max_len
        tok = ctx.tokenizer
        self.mask_id = int(tok.mask_token_id)
        self.pad_id = int(tok.pad_token_id if tok.pad_token_id is not None else tok.sep_token_id)

    def attach(self, student: Student) -> None:
        cfg = self.cfg
        attach_decoder(student, cfg.decoder_layers, cfg.decoder_width, cfg.decoder_heads, self.max_len, cfg.seed,
                       cfg.decoder_dropout)

    def __call__(self, student: Student, batch: Batch) -> torch.Tensor:
        """Decoder states (B, T, d)."""
        keep = delta_keep(batch.selected, batch.samples, self.cfg.delta, self.cfg.seed)
        return mae_forward(student, batch.input_ids, batch.attention_mask, batch.selected, keep,
                           self.mask_id, self.pad_id)


class MAELM:
    Config = MAELMConfig

    def __init__(self, cfg: MAELMConfig, ctx: Context):
        self.split = MAEDecoderPass(cfg, ctx)
        self.vocab = len(ctx.tokenizer)

    def attach(self, student: Student) -> None:
        self.split.attach(student)
        with seeded(self.split.cfg.seed + 1):
            student.heads[LM_HEAD] = TiedLMHead(student.hidden_size, self.vocab)
        student.head_meta[LM_HEAD] = {"class": "TiedLMHead", "d": student.hidden_size, "vocab": self.vocab,
                                      "tied_to": "encoder input embeddings", "after": DECODER}

    def __call__(self, student: Student, batch: Batch) -> ObjectiveOutput:
        states = self.split(student, batch)  # (B, T, d)
        emb = student.backbone.get_input_embeddings().weight  # (V, d), tied output matrix
        logits = student.heads[LM_HEAD](states[batch.selected], emb)  # (N, V)
        labels = batch.input_ids[batch.selected]  # (N,)
        loss = F.cross_entropy(logits.float(), labels, reduction="sum")
        with torch.no_grad():
            correct = (logits.argmax(-1) == labels).sum().float()
        metrics = {"mae_loss": loss.detach(), "accuracy": correct}
        return ObjectiveOutput(loss, labels.new_tensor(labels.numel()), metrics)
