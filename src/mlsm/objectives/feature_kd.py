"""Dense feature distillation: the student predicts the teacher's ℓ2-normalised layer-l state.

The control for MLSM's *sparse latent semantics* (Berend 2023): same frozen teacher, same early
exit (only teacher layers 1..l run), same unmasked teacher input and the same batches and
selected positions as `mlsm`, but the target is the dense state itself rather than its sparse
code against a dictionary. For every selected position i the teacher reads the *unmasked*
sequence and h̄_i = h_i / ‖h_i‖₂ (layer l, fp32); the student predicts ŷ_i = head(student(masked
input)_i) ∈ R^{d_t} through MLSM's head shape (`LatentHead(d, d_t)`: d × d transform + d × d_t
projection), and the loss summed over targets is

    cosine:  Σ_i 1 − cos(ŷ_i, h̄_i)         (the default)
    mse:     Σ_i ‖ŷ_i − h̄_i‖²₂

The head is exported as `latent` with k = d_t, so a study fits the same k -> |V| probe on it and
reads the checkpoint out exactly as it reads an MLSM one (`predicts_latent`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from mlsm.config import ranged
from mlsm.data.batches import Batch
from mlsm.data.corpus import require_same_tokenizer, tokenizer_hash
from mlsm.defaults import TEACHER_LAYER
from mlsm.errors import UserError
from mlsm.models.backbone import Student
from mlsm.objectives.base import Context, Objective, ObjectiveOutput
from mlsm.objectives.mlsm import latent_head
from mlsm.teacher.teacher import Teacher, load_teacher

FEATURE_LOSSES = ("cosine", "mse")


@dataclass
class FeatureKDConfig:
    name: Literal["feature_kd"] = "feature_kd"
    """Objective name (the tag of the objective group)."""
    teacher: str = ""
    """Teacher model folder or hub id; empty = the packaged all-MiniLM-L6-v2."""
    layer: int = ranged(TEACHER_LAYER, (lambda v: v >= 1, "a teacher layer of 1 or more"))
    """Teacher layer l whose ℓ2-normalised state is predicted (HF numbering, 1 = the first block's
    output); only layers 1..l run (early exit). Default 5: the packaged MiniLM's second-to-last
    layer, the layer of v2's MLSM arm (mlsm l = 5) and of a study's dictionaries by default."""
    loss: Literal["cosine", "mse"] = "cosine"
    """Per-target loss against the normalised state h̄: `cosine` = 1 − cos(ŷ, h̄) (ignores the
    prediction's norm) or `mse` = ‖ŷ − h̄‖² (the squared error to the unit vector)."""


def check_feature_kd_options(cfg: FeatureKDConfig) -> None:
    """One-line errors for a Config built in Python (a YAML config is checked at load)."""
    if cfg.loss not in FEATURE_LOSSES:
        raise UserError(f"objective.loss={cfg.loss!r}; use {' or '.join(FEATURE_LOSSES)}")


def teacher_features(teacher: Teacher, batch: Batch) -> torch.Tensor:
    """ℓ2-normalised layer-l states (N, d_t), fp32, of the teacher on the *unmasked* sequence at
    the selected positions (row-major order of batch.selected)."""
    # The teacher runs in the run's precision, as MLSM's; the normalisation runs in fp32.
    h = teacher.hidden_states(batch.input_ids, batch.attention_mask)  # (B, T, d_t)
    with torch.autocast(batch.input_ids.device.type, enabled=False):
        return F.normalize(h[batch.selected].float(), dim=-1)  # (N, d_t)


def feature_loss(head: nn.Module, hidden: torch.Tensor, target: torch.Tensor,
                 kind: str) -> ObjectiveOutput:
    """The summed per-target loss of `kind` (cosine or mse) and per-target metric sums.

    head: (N, d) -> (N, d_t); hidden: (N, d) student states at the selected positions; target:
    (N, d_t) unit-norm teacher states.
    """
    y = head(hidden)  # (N, d_t), in the run's precision
    with torch.autocast(hidden.device.type, enabled=False):
        y = y.float()
        cos = F.cosine_similarity(y, target, dim=-1)  # (N,)
        sq = (y - target).pow(2).sum(-1)  # (N,)
        per_target = 1 - cos if kind == "cosine" else sq
    with torch.no_grad():
        metrics = {"cosine": cos.sum().detach(), "sq_error": sq.sum().detach(),
                   "pred_norm": y.norm(dim=-1).sum().detach()}
    return ObjectiveOutput(per_target.sum(), torch.tensor(len(target), device=target.device),
                           metrics)


class FeatureKD(Objective):
    Config = FeatureKDConfig
    uses_teacher = predicts_latent = True  # its head's d_t outputs are probed as MLSM's k latents
    flops_row = "FeatureKD_l"

    def __init__(self, cfg: FeatureKDConfig, ctx: Context):
        super().__init__()
        check_feature_kd_options(cfg)
        self.kind = cfg.loss
        self.teacher = load_teacher(cfg.teacher or None, cfg.layer, device=ctx.device)
        self.teacher.check_length(ctx.max_len, "data.max_len")
        require_same_tokenizer(self.teacher.tokenizer, tokenizer_hash(ctx.tokenizer),
                               ctx.store_path)

    def attach(self, student: Student) -> None:
        self.add_head("latent", *latent_head(student.hidden_size, self.teacher.hidden_size))

    def targets(self, batch: Batch) -> torch.Tensor:
        return teacher_features(self.teacher, batch)  # (N, d_t), teacher on the unmasked ids

    def loss(self, hidden: torch.Tensor, targets: Any, batch: Batch) -> ObjectiveOutput:
        return feature_loss(self.heads["latent"], hidden[batch.selected], targets, self.kind)
