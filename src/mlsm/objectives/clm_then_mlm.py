"""CLM -> MLM in one run (Gisserot-Boukhlef et al. 2025): causal LM for the first `clm_fraction` of
the optimizer steps, then masked LM, under one learning-rate schedule (the recipes use WSD so the
switch happens on the stable plateau, not during a decay).

A composition of the two objectives, not a copy: each batch goes to `CLM` or `MLM` by its
optimizer step (`batch.step`), so the phase is a pure function of the step and resuming on either
side of the switch is exact. Metrics keep each phase's own names (clm_loss / mlm_loss), so
metrics.jsonl shows where the switch happened.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlsm.data.batches import Batch
from mlsm.errors import UserError
from mlsm.models.backbone import Student
from mlsm.objectives.base import Context, ObjectiveOutput
from mlsm.objectives.clm import CLM, CLMConfig
from mlsm.objectives.mlm import MLM, MLMConfig


@dataclass
class CLMThenMLMConfig:
    clm_fraction: float = 0.25
    """Fraction of train.steps trained with CLM (causal mask) before switching to MLM."""


class CLMThenMLM:
    Config = CLMThenMLMConfig

    def __init__(self, cfg: CLMThenMLMConfig, ctx: Context):
        if not 0.0 <= cfg.clm_fraction <= 1.0:
            raise UserError(f"objective.clm_fraction={cfg.clm_fraction} must be in [0, 1], e.g. 0.25")
        self.switch_step = round(cfg.clm_fraction * ctx.total_steps)
        """First optimizer step (0-based) trained with MLM."""
        self.clm = CLM(CLMConfig(), ctx)
        self.mlm = MLM(MLMConfig(), ctx)

    def attach(self, student: Student) -> None:
        self.clm.attach(student)
        self.mlm.attach(student)

    def phase(self, step: int) -> str:
        return "clm" if step < self.switch_step else "mlm"

    def __call__(self, student: Student, batch: Batch) -> ObjectiveOutput:
        objective = self.clm if self.phase(batch.step) == "clm" else self.mlm
        return objective(student, batch)
