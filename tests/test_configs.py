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


def test_a_home_folder_in_a_path_key_is_the_home_folder(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`train.out=~/runs/x` (the shell leaves `~` after `=` alone) wrote into a folder named `~`
    below the working folder, while `check_apart` and a study's `out` read `~` as home."""
    from mlsm.run_config import PATH_KEYS

    monkeypatch.setenv("HOME", str(tmp_path))
    overrides = ["objective.name=mlsm", *(f"{g}.{k}=~/{k}" for g, k in PATH_KEYS)]
    cfg = load_config(None, overrides)
    for group, key in PATH_KEYS:
        assert getattr(getattr(cfg, group), key) == str(tmp_path / key), (group, key)
