"""CLM -> MLM in one run (Gisserot-Boukhlef et al. 2025): causal LM for the first `clm_fraction` of
the optimizer steps, then masked LM, under one learning-rate schedule (the recipes use WSD so the
switch happens on the stable plateau, not during a decay).

A composition of the two objectives, not a copy: each batch goes to `CLM` or `MLM` by its
optimizer step (`batch.step`), so the phase is a pure function of the step and resuming on either
side of the switch is exact. Metrics keep each phase's own names (clm_loss / mlm_loss), so
metrics.jsonl shows where the switch happened. Both phases train the vocabulary head, so the
masked LM is exported (declared here, whatever the phase).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from mlsm.config import UNIT, ranged
from mlsm.data.batches import Batch
from mlsm.models.backbone import Student
from mlsm.objectives.base import Context, Objective, ObjectiveOutput
from mlsm.objectives.clm import CLM, CLMConfig
from mlsm.objectives.mlm import MLM, MLMConfig


@dataclass
class CLMThenMLMConfig:
    name: Literal["clm_then_mlm"] = "clm_then_mlm"
    """Objective name (the tag of the objective group)."""
    clm_fraction: float = ranged(0.25, UNIT)
    """Fraction of train.steps trained with CLM (causal mask) before switching to MLM."""


def switch_step(clm_fraction: float, total_steps: int) -> int:
    """The first optimizer step (0-based) trained with MLM; a checkpoint at a step up to it has
    seen CLM steps only."""
    return round(float(clm_fraction) * total_steps)


class CLMThenMLM(Objective):
    Config = CLMThenMLMConfig
    exports_vocab_head = True

    def __init__(self, cfg: CLMThenMLMConfig, ctx: Context):
        super().__init__()
        self.switch_step = switch_step(cfg.clm_fraction, ctx.total_steps)
        """First optimizer step (0-based) trained with MLM."""
        self.clm = CLM(CLMConfig(), ctx)
        self.mlm = MLM(MLMConfig(), ctx)

    def attach(self, student: Student) -> None:
        self.clm.attach(student)
        self.mlm.attach(student)

    @classmethod
    def pll_refusal_at(cls, objective: dict[str, Any], step: int, total_steps: int) -> str | None:
        """A checkpoint still in the CLM phase (no MLM step yet) is CLM's; from the first MLM
        step on it is scored like MLM."""
        switch = switch_step(objective.get("clm_fraction", CLMThenMLMConfig.clm_fraction),
                             total_steps)
        if step > switch:
            return None
        return f"{CLM.pll_refusal} (step {step} is in its CLM phase, the first {switch} steps)"

    def phase(self, step: int) -> str:
        return "clm" if step < self.switch_step else "mlm"

    def _member(self, batch: Batch) -> Objective:
        return self.clm if self.phase(batch.step) == "clm" else self.mlm

    def targets(self, batch: Batch) -> Any:
        return self._member(batch).targets(batch)

    def student_inputs(self, student: Student, batch: Batch, targets: Any) -> dict[str, Any]:
        return self._member(batch).student_inputs(student, batch, targets)

    def loss(self, hidden: torch.Tensor, targets: Any, batch: Batch) -> ObjectiveOutput:
        return self._member(batch).loss(hidden, targets, batch)
