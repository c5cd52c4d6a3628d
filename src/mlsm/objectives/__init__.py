"""Objectives behind one literal registry. Adding one = one module + one line here + its test.

The `objective` group of a run is a tagged union of the objectives' typed `Config`s: this module
resolves it (`resolve_objective`: the name picks the Config, the other keys are validated against
it and defaulted), above every objective and below `mlsm.run_config`, so the schema
(`mlsm.config`) never knows an objective. `OBJECTIVES` is what users pick
from (`mlsm pretrain --help`, docs/configuration.md); `INTERNAL` objectives load the same way but
serve mlsm itself: `probe` (the probe fitted on a frozen MLSM model by `mlsm probe`) and
`mlsm_naive` (the official recipe, for the FLOPs / step-time comparison).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mlsm.config import build_dataclass, check_fields
from mlsm.errors import UserError
from mlsm.objectives.base import Context, Objective, ObjectiveOutput, TrainModule, forward_step
from mlsm.objectives.clm import CLM
from mlsm.objectives.clm_then_mlm import CLMThenMLM
from mlsm.objectives.feature_kd import FeatureKD
from mlsm.objectives.kd import KD
from mlsm.objectives.mae_lm import MAELM
from mlsm.objectives.mae_mlsm import MAEMLSM
from mlsm.objectives.mlm import MLM
from mlsm.objectives.mlsm import MLSM
from mlsm.objectives.mlsm_naive import MLSMNaive
from mlsm.objectives.mtl import MTL
from mlsm.objectives.probe import Probe

OBJECTIVES: dict[str, type[Objective]] = {
    "mlm": MLM,
    "mlsm": MLSM,
    "kd": KD,
    "mtl": MTL,
    "clm": CLM,
    "clm_then_mlm": CLMThenMLM,
    "mae_lm": MAELM,
    "mae_mlsm": MAEMLSM,
    "feature_kd": FeatureKD,
}
INTERNAL: dict[str, type[Objective]] = {"mlsm_naive": MLSMNaive, "probe": Probe}

DEFAULT_OBJECTIVE = "mlm"  # objective.name when a config names none


def objective_class(name: object) -> type[Objective] | None:
    """The class registered under `name` (OBJECTIVES or INTERNAL); None for an unknown name."""
    return {**OBJECTIVES, **INTERNAL}.get(name) if isinstance(name, str) else None


def user_objectives() -> list[str]:
    """The objective names offered to users (help, docs, error messages)."""
    return list(OBJECTIVES)


def resolve_objective(raw: Any) -> Any:
    """The objective group as its typed Config: name checked, options validated and defaulted."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise UserError(f"objective must be a mapping, got {raw!r}; write objective.name={raw} "
                        "(or `objective: {name: ...}` in YAML)")
    raw = {"name": DEFAULT_OBJECTIVE, **raw}
    cls = objective_class(raw["name"])
    if cls is None:
        raise UserError(f"unknown objective.name {raw['name']!r}; "
                        f"valid: {', '.join(user_objectives())}")
    return build_dataclass(cls.Config, raw, "objective")


def checkpoint_facts(name: object, objective: dict[str, Any], step: object,
                     total: object) -> dict[str, Any]:
    """What a checkpoint of objective `name` records for its readers (`mlsm.artifacts.checkpoint`):
    its latent head's name and why it cannot be scored by PLL at `step` of `total` (or None).
    Written at save time (`mlsm.train.checkpoint.with_facts`), and once by `mlsm migrate` into a
    checkpoint or export of mlsm 0.1.0, which predates them."""
    cls = objective_class(name) or Objective
    if isinstance(step, int) and isinstance(total, int):
        refusal = cls.pll_refusal_at(objective, step, total)
    else:  # the step's fraction is unknown: the class alone
        refusal = None if cls.scored_by_pll else cls.pll_refusal
    return {"latent_head": cls.latent_head, "pll_refusal": refusal or None}


def build_objective(spec: object, ctx: Context) -> Objective:
    """Instantiate the objective of `spec`: its typed Config, or a dict {name: ..., options}."""
    cfg = spec if not isinstance(spec, dict) else resolve_objective(spec)
    cls = objective_class(getattr(cfg, "name", None))
    if cls is None:
        raise UserError(f"unknown objective {spec!r}; valid: {', '.join(OBJECTIVES)}")
    if dataclasses.is_dataclass(cfg) and not isinstance(spec, dict):
        check_fields(cfg, "objective")  # a Config built in Python: the ranges beside its fields
    return cls(cfg, ctx)


__all__ = ["DEFAULT_OBJECTIVE", "INTERNAL", "OBJECTIVES", "Context", "Objective",
           "ObjectiveOutput", "TrainModule", "build_objective", "checkpoint_facts", "forward_step",
           "objective_class", "resolve_objective", "user_objectives"]
