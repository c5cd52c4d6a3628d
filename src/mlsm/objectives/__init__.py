"""Objectives behind one literal registry. Adding one = one module + one line here + its test."""

from __future__ import annotations

from typing import Any

from mlsm.config import build_dataclass
from mlsm.errors import UserError
from mlsm.objectives.base import Context, Objective, ObjectiveOutput, options_of
from mlsm.objectives.clm import CLM
from mlsm.objectives.clm_then_mlm import CLMThenMLM
from mlsm.objectives.kd import KD
from mlsm.objectives.mae_lm import MAELM
from mlsm.objectives.mae_mlsm import MAEMLSM
from mlsm.objectives.mlm import MLM
from mlsm.objectives.mlsm import MLSM
from mlsm.objectives.mlsm_naive import MLSMNaive
from mlsm.objectives.mtl import MTL
from mlsm.objectives.probe import Probe

OBJECTIVES: dict[str, type] = {
    "mlm": MLM,
    "mlsm": MLSM,
    "mlsm_naive": MLSMNaive,
    "kd": KD,
    "mtl": MTL,
    "clm": CLM,
    "clm_then_mlm": CLMThenMLM,
    "mae_lm": MAELM,
    "mae_mlsm": MAEMLSM,
    "probe": Probe,
}


def build_objective(spec: dict[str, Any], ctx: Context) -> Objective:
    """Instantiate `spec['name']` with the rest of `spec` as its validated options."""
    name = spec.get("name", "mlm")
    if name not in OBJECTIVES:
        raise UserError(f"unknown objective.name {name!r}; valid: {', '.join(OBJECTIVES)}")
    cls = OBJECTIVES[name]
    return cls(build_dataclass(cls.Config, options_of(spec), "objective"), ctx)


__all__ = ["OBJECTIVES", "Context", "Objective", "ObjectiveOutput", "build_objective"]
