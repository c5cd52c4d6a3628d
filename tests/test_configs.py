"""Every YAML recipe in configs/ loads and its objective options validate against the registry."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlsm.config import build_dataclass, load_config
from mlsm.objectives import OBJECTIVES
from mlsm.objectives.base import options_of

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").rglob("*.yaml"))


def test_there_are_recipes() -> None:
    names = {p.relative_to(p.parents[1]).as_posix() for p in CONFIGS}
    assert {"tiny/mlm.yaml", "tiny/mlsm.yaml", "tiny/kd.yaml", "tiny/mtl.yaml", "hitchhiker/mlsm.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.relative_to(p.parents[1]).as_posix())
def test_recipe_loads_and_objective_validates(path: Path) -> None:
    cfg = load_config(path)
    name = cfg.objective.get("name", "mlm")
    assert name in OBJECTIVES, f"{path}: unknown objective {name!r}"
    build_dataclass(OBJECTIVES[name].Config, options_of(cfg.objective), "objective")
    assert cfg.train.batch_size % (cfg.train.micro_batch_size or cfg.train.batch_size) == 0
