"""Multi-task MLSM + MLM (Berend 2023, §5 "MTL"): L = L_MLSM + κ · L_MLM.

A composition, not a copy: an `MLSM` and an `MLM` objective are instantiated and both read one
shared student forward (a thin proxy hands them the cached hidden states), so the student runs
once per batch and both heads — the latent head and the vocabulary head — are trained and
exported (the checkpoint is an AutoModelForMaskedLM folder plus heads.safetensors).

Normalisation. The loop divides the summed loss by the number of targets. MLM counts every
selected position (n_mlm); MLSM drops positions whose code is all zero (n_mlsm ≤ n_mlm). We return
n_targets = n_mlm and rescale the MLSM sum by n_mlm / n_mlsm, so for one micro-batch

    loss_sum / n_targets = mean_MLSM + κ · mean_MLM        (exactly).

With gradient accumulation / DDP the rescaling is per micro-batch, so mean_MLSM becomes a mean of
per-micro-batch means weighted by their MLM counts — equal to the global mean whenever the dropped
fraction is the same in every micro-batch, and within a fraction of a percent in practice.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from mlsm.data.batches import Batch
from mlsm.errors import UserError
from mlsm.models.backbone import Student
from mlsm.objectives.base import Context, ObjectiveOutput
from mlsm.objectives.mlm import MLM, MLMConfig
from mlsm.objectives.mlsm import MLSM, MLSMConfig


@dataclass
class MTLConfig(MLSMConfig):
    kappa: float = 0.5
    """Weight κ of the MLM loss (the paper tries 0.25, 0.5 and 1)."""
    head: str = "separate"
    """`separate` (ours): the latent head has its own transform beside the vocabulary head.
    `shared` (the official code): one transform (the vocabulary head's) feeds a d × (|V| + k)
    decoder — the vocabulary decoder plus a d × k block — with separate softmaxes."""


class SharedTransformLatent(nn.Module):
    """Latent logits from the vocabulary head's transform: proj(transform(h)), (N, d) -> (N, k).

    The transform is the masked LM's own (BERT / DeBERTa `cls.predictions.transform`), held by
    reference and not registered here, so its weights live (and are exported) once, in the HF model.
    """

    def __init__(self, transform: nn.Module, d: int, k: int):
        super().__init__()
        self._transform = (transform,)  # a tuple: not a submodule, no second copy in heads.safetensors
        self.proj = nn.Linear(d, k)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(self._transform[0](h))


def attach_shared_head(student: Student, k: int) -> None:
    """Replace the latent head by the official MTL head's latent block (one error if unsupported)."""
    predictions = getattr(getattr(student.hf, "cls", None), "predictions", None)
    if predictions is None or not hasattr(predictions, "transform"):
        raise UserError(f"objective.head=shared needs a BERT-style vocabulary head (cls.predictions.transform); "
                        f"{student.config.model_type} has none: use objective.head=separate")
    student.heads["latent"] = SharedTransformLatent(predictions.transform, student.hidden_size, k)
    student.head_meta["latent"] = {"class": "SharedTransformLatent", "d": student.hidden_size, "k": k,
                                   "transform": "cls.predictions.transform of the exported masked LM"}


class _SharedForward:
    """Looks like the student, but `encode` returns hidden states computed once (B, T, d)."""

    def __init__(self, student: Student, hidden: torch.Tensor):
        self._student, self._hidden = student, hidden

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kw: Any) -> torch.Tensor:
        return self._hidden

    def __getattr__(self, name: str) -> Any:
        return getattr(self._student, name)


class MTL:
    Config = MTLConfig

    def __init__(self, cfg: MTLConfig, ctx: Context):
        if cfg.kappa < 0:
            raise UserError(f"objective.kappa must be >= 0 (got {cfg.kappa}); the paper uses 0.25, 0.5 or 1")
        if cfg.head not in ("separate", "shared"):
            raise UserError(f"objective.head={cfg.head!r}; use separate (ours) or shared (the official code)")
        self.kappa, self.shared = cfg.kappa, cfg.head == "shared"
        mlsm_opts = {f.name: getattr(cfg, f.name) for f in fields(MLSMConfig)}
        self.mlsm = MLSM(MLSMConfig(**mlsm_opts), ctx)
        self.mlm = MLM(MLMConfig(), ctx)

    def attach(self, student: Student) -> None:
        self.mlsm.attach(student)  # latent head
        self.mlm.attach(student)  # vocabulary head, exported with the checkpoint
        if self.shared:
            attach_shared_head(student, self.mlsm.coder.k)

    def __call__(self, student: Student, batch: Batch) -> ObjectiveOutput:
        hidden = student.encode(batch.corrupted_ids, batch.attention_mask)  # (B, T, d), once
        shared = _SharedForward(student, hidden)
        a = self.mlsm(shared, batch)  # type: ignore[arg-type]
        b = self.mlm(shared, batch)  # type: ignore[arg-type]
        n_mlsm, n_mlm = a.n_targets.float(), b.n_targets
        scale = n_mlm.float() / n_mlsm.clamp(min=1)  # mean_MLSM expressed per MLM target
        loss = a.loss_sum * scale + self.kappa * b.loss_sum
        metrics = {**a.metrics, **b.metrics, "mlsm_loss": a.loss_sum.detach() * scale}
        return ObjectiveOutput(loss, n_mlm, metrics)
