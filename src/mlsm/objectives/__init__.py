"""Objectives behind one literal registry. Adding one = one module + one line here + its test.

Each objective registers its typed `Config` with `mlsm.config` (the tagged union of the
`objective` group): the config module never imports an objective. `OBJECTIVES` is what users pick
from (`mlsm pretrain --help`, docs/configuration.md); `INTERNAL` objectives load the same way but
serve mlsm itself: `probe` (the probe fitted on a frozen MLSM model by `mlsm probe`) and
`mlsm_naive` (the official recipe, for the FLOPs / step-time comparison).
"""

from __future__ import annotations

from typing import Any

from mlsm.artifacts.checkpoint import register_legacy_facts
from mlsm.config import register_objective
from mlsm.errors import UserError
from mlsm.objectives.base import Context, Objective, ObjectiveOutput, TrainModule, forward_step
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

OBJECTIVES: dict[str, type[Objective]] = {
    "mlm": MLM,
    "mlsm": MLSM,
    "kd": KD,
    "mtl": MTL,
    "clm": CLM,
    "clm_then_mlm": CLMThenMLM,
    "mae_lm": MAELM,
    "mae_mlsm": MAEMLSM,
}
INTERNAL: dict[str, type[Objective]] = {"mlsm_naive": MLSMNaive, "probe": Probe}

for _name, _cls in {**OBJECTIVES, **INTERNAL}.items():
    register_objective(_cls.Config, internal=_name in INTERNAL)


def objective_class(name: object) -> type[Objective] | None:
    """The class registered under `name` (OBJECTIVES or INTERNAL); None for an unknown name."""
    return {**OBJECTIVES, **INTERNAL}.get(name) if isinstance(name, str) else None


def checkpoint_facts(name: object, objective: dict[str, Any], step: object,
                     total: object) -> dict[str, Any]:
    """What a checkpoint of objective `name` records for its readers (`mlsm.artifacts.checkpoint`):
    its latent head's name and why it cannot be scored by PLL at `step` of `total` (or None).
    Written at save time; registered below as the fallback for checkpoints that predate that."""
    cls = objective_class(name) or Objective
    if isinstance(step, int) and isinstance(total, int):
        refusal = cls.pll_refusal_at(objective, step, total)
    else:  # the step's fraction is unknown: the class alone
        refusal = None if cls.scored_by_pll else cls.pll_refusal
    return {"latent_head": cls.latent_head, "pll_refusal": refusal or None}


register_legacy_facts(checkpoint_facts)


def build_objective(spec: object, ctx: Context) -> Objective:
    """Instantiate the objective of `spec`: its typed Config, or a dict {name: ..., options}."""
    from mlsm.config import resolve_objective

    cfg = spec if not isinstance(spec, dict) else resolve_objective(spec)
    cls = objective_class(getattr(cfg, "name", None))
    if cls is None:
        raise UserError(f"unknown objective {spec!r}; valid: {', '.join(OBJECTIVES)}")
    return cls(cfg, ctx)


__all__ = ["INTERNAL", "OBJECTIVES", "Context", "Objective", "ObjectiveOutput", "TrainModule",
           "build_objective", "checkpoint_facts", "forward_step", "objective_class"]
