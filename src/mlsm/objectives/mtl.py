"""Multi-task MLSM + MLM: L = L_MLSM + κ · L_MLM.

The MTL arm of the *Hitchhikers' Guide to Masked Latent Semantic Modeling* (anonymous, under review;
κ ∈ {0.25, 0.5, 1}, Fig. 6 "MLSM+MLM"); training MLSM and MLM jointly is Berend's BabyLM paper
("Better Together", 2023; the official code's `--mlm_weight`).

A composition, not a copy: an `MLSM` and an `MLM` objective are members; MTL's targets are both
members' targets, and both members' losses read the one student forward (both take the corrupted
sequence as input, checked at construction), so the student runs once per batch and both heads —
the latent head and the vocabulary head — are trained and exported (the checkpoint is an
AutoModelForMaskedLM folder plus heads.safetensors).

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
from typing import Any, Literal

import torch
from torch import nn

from mlsm.config import UNIT, ranged
from mlsm.data.batches import Batch
from mlsm.errors import UserError
from mlsm.models.backbone import Student
from mlsm.objectives.base import Context, Objective, ObjectiveOutput
from mlsm.objectives.mlm import MLM, MLMConfig
from mlsm.objectives.mlsm import MLSM, MLSMConfig


@dataclass
class MTLConfig(MLSMConfig):
    name: Literal["mtl"] = "mtl"  # type: ignore[assignment]
    """Objective name (the tag of the objective group)."""
    kappa: float = ranged(0.5, UNIT)
    """Weight κ of the MLM loss (the Hitchhikers' Guide tries 0.25, 0.5 and 1)."""
    head: Literal["separate", "shared"] = "separate"
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
        # a tuple: not a submodule, no second copy in heads.safetensors
        self._transform = (transform,)
        self.proj = nn.Linear(d, k)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(self._transform[0](h))


def shared_head(student: Student, k: int) -> tuple[nn.Module, dict[str, Any]]:
    """The official MTL head's latent block (one error if the student's head has no transform)."""
    predictions = getattr(getattr(student.hf, "cls", None), "predictions", None)
    if predictions is None or not hasattr(predictions, "transform"):
        raise UserError("objective.head=shared needs a BERT-style vocabulary head "
                        f"(cls.predictions.transform); {student.config.model_type} has none: "
                        "use objective.head=separate")
    meta = {"class": "SharedTransformLatent", "d": student.hidden_size, "k": k,
            "transform": "cls.predictions.transform of the exported masked LM"}
    return SharedTransformLatent(predictions.transform, student.hidden_size, k), meta


class MTL(Objective):
    Config = MTLConfig
    exports_vocab_head = True  # MLM's vocabulary head is trained and exported
    uses_teacher = predicts_latent = True  # its MLSM member's
    flops_row = "MTL"

    def __init__(self, cfg: MTLConfig, ctx: Context):
        super().__init__()
        if cfg.head not in ("separate", "shared"):
            raise UserError(f"objective.head={cfg.head!r}; "
                            "use separate (ours) or shared (the official code)")
        self.kappa, self.shared = cfg.kappa, cfg.head == "shared"
        mlsm_opts = {f.name: getattr(cfg, f.name) for f in fields(MLSMConfig) if f.name != "name"}
        self.mlsm = MLSM(MLSMConfig(**mlsm_opts), ctx)
        self.mlm = MLM(MLMConfig(), ctx)
        # One student forward feeds both losses: only sound if both read the same inputs.
        assert type(self.mlsm).student_inputs is type(self.mlm).student_inputs

    def attach(self, student: Student) -> None:
        self.mlsm.attach(student)  # latent head
        self.mlm.attach(student)  # the student's vocabulary head
        if self.shared:
            self.mlsm.add_head("latent", *shared_head(student, self.mlsm.coder.k))

    def exported_heads(self) -> dict[str, nn.Module]:
        return {**self.mlsm.exported_heads(), **self.mlm.exported_heads()}

    def head_meta(self) -> dict[str, dict[str, Any]]:
        return {**self.mlsm.head_meta(), **self.mlm.head_meta()}

    def targets(self, batch: Batch) -> Any:
        return self.mlsm.targets(batch), self.mlm.targets(batch)

    def student_inputs(self, student: Student, batch: Batch, targets: Any) -> dict[str, Any]:
        return self.mlm.student_inputs(student, batch, targets[1])

    def loss(self, hidden: torch.Tensor, targets: Any, batch: Batch) -> ObjectiveOutput:
        a = self.mlsm.loss(hidden, targets[0], batch)  # hidden: (B, T, d), computed once
        b = self.mlm.loss(hidden, targets[1], batch)
        n_mlsm, n_mlm = a.n_targets.float(), b.n_targets
        scale = n_mlm.float() / n_mlsm.clamp(min=1)  # mean_MLSM expressed per MLM target
        loss = a.loss_sum * scale + self.kappa * b.loss_sum
        metrics = {**a.metrics, **b.metrics, "mlsm_loss": a.loss_sum.detach() * scale}
        return ObjectiveOutput(loss, n_mlm, metrics)
