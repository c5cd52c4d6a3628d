"""Every YAML recipe in configs/ loads and its objective options validate against the registry."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlsm.objectives import INTERNAL, OBJECTIVES
from mlsm.run_config import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").rglob("*.yaml"))


def test_there_are_recipes() -> None:
    names = {p.relative_to(p.parents[1]).as_posix() for p in CONFIGS}
    assert {"tiny/mlm.yaml", "tiny/mlsm.yaml", "tiny/kd.yaml", "tiny/mtl.yaml",
            "hitchhiker/mlsm.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.relative_to(p.parents[1]).as_posix())
def test_recipe_loads_and_objective_validates(path: Path) -> None:
    cfg = load_config(path)
    name = cfg.objective.name
    assert name in {**OBJECTIVES, **INTERNAL}, f"{path}: unknown objective {name!r}"
    assert isinstance(cfg.objective, {**OBJECTIVES, **INTERNAL}[name].Config)
    assert cfg.train.batch_size % (cfg.train.micro_batch_size or cfg.train.batch_size) == 0
