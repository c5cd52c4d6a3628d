"""Objectives as typed components: the objective group is resolved at load and saved in full, the
config module imports no objective, and what a checkpoint exports is declared by the objective."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from mlsm import cli
from mlsm.config import save_config
from mlsm.run_config import config_from_dict, load_config

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "configs").rglob("*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.relative_to(p.parents[1]).as_posix())
def test_saved_recipe_round_trips_with_every_objective_default(path: Path, tmp_path: Path) -> None:
    cfg = load_config(path)
    save_config(cfg, tmp_path / "config.yaml")
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    options = {f.name for f in dataclasses.fields(cfg.objective)}
    assert set(saved["objective"]) == options  # every option, defaults included
    assert saved["objective"]["name"] == cfg.objective.name
    assert load_config(tmp_path / "config.yaml") == cfg


def test_partial_objective_of_an_older_run_resolves_to_its_full_form() -> None:
    old = config_from_dict({"objective": {"name": "mtl", "kappa": 0.25}})
    assert old.objective.lam == 0.0 and old.objective.head == "separate"
    assert old.objective.kappa == 0.25
    full = config_from_dict(json.loads(json.dumps(dataclasses.asdict(old))))
    assert full == old


def _cli_err(capsys: pytest.CaptureFixture, args: list[str]) -> str:
    capsys.readouterr()
    try:
        code = cli.main(args)
    except SystemExit as exc:  # argparse's own exits
        code = int(exc.code or 0)
    assert code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(("name", "override", "needles"), [
    ("mlsm", "optim.schedule=cosine", ["optim.schedule", "linear or wsd"]),
    ("mlsm", "objective.solver=spams", ["objective.solver", "exact", "fista"]),
    ("kd", "objective.teacher_input=both", ["objective.teacher_input", "corrupted", "original"]),
    ("mae_lm", "objective.delta=1.5", ["objective.delta", "[0, 1]"]),
])
def test_invalid_option_fails_at_load_in_one_line(name: str, override: str, needles: list[str],
                                                   capsys, tmp_path: Path) -> None:
    args = ["pretrain", f"objective.name={name}", override, f"train.out={tmp_path / 'run'}"]
    err = _cli_err(capsys, args)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlsm pretrain: error:"), err
    assert all(n in lines[0] for n in needles), lines[0]
    assert not (tmp_path / "run").exists()  # failed at load: nothing was written


def test_import_config_imports_no_objective() -> None:
    code = ("import sys, mlsm.config; "
            "print([m for m in sys.modules if m.startswith('mlsm.objectives')])")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def _objective(store_dir: Path, spec: dict):
    from mlsm.data.corpus import TokenStore
    from mlsm.objectives import Context, build_objective

    tok = TokenStore.open(store_dir).load_tokenizer()
    return build_objective(spec, Context(tok, torch.device("cpu"), 10, str(store_dir), 32)), tok


@pytest.mark.parametrize("clm_first", [True, False])
def test_exports_are_declared_whatever_the_attach_order(store_dir: Path, tmp_path: Path,
                                                        clm_first: bool) -> None:
    """CLM→MLM exports the masked LM and MAE-LM the bare encoder + its heads, whichever of them
    (and of CLM→MLM's members) is attached last to the same student."""
    from transformers import AutoConfig

    from mlsm.config import ModelConfig
    from mlsm.models.backbone import build_student
    from mlsm.objectives import TrainModule
    from mlsm.train.checkpoint import save_model_folder

    from .helpers import TINY_MODEL

    clm_mlm, tok = _objective(store_dir, {"name": "clm_then_mlm"})
    mae, _ = _objective(store_dir, {"name": "mae_lm"})
    student = build_student(ModelConfig(overrides=dict(TINY_MODEL)), tok, 32, 0)
    members = [clm_mlm.clm, clm_mlm.mlm] if clm_first else [clm_mlm.mlm, clm_mlm.clm]
    order = [*members, mae] if clm_first else [mae, *members]
    for part in order:
        part.attach(student)
    for obj, masked_lm in ((clm_mlm, True), (mae, False)):
        module = TrainModule(student, obj)
        assert module.exported_model() is (student.hf if masked_lm else student.backbone)
        folder = tmp_path / obj.Config.name
        save_model_folder(module, tok, folder)
        archs = AutoConfig.from_pretrained(folder).architectures
        assert archs[0].endswith("ForMaskedLM") == masked_lm, archs
        heads = json.loads((folder / "heads.json").read_text()) if not masked_lm else {}
        assert (folder / "heads.json").is_file() == (not masked_lm)
        assert set(heads) == ({"mae_decoder", "mae_lm_head"} if not masked_lm else set())


def test_resume_accepts_a_run_saved_with_a_partial_objective(tmp_path: Path) -> None:
    """config.yaml written before objectives were saved in full (main up to 6892e60) holds only the
    options given; --resume compares resolved configs, so it is the same run."""
    from mlsm.artifacts.rundir import RunDir
    from mlsm.errors import UserError
    from mlsm.train.loop import _plain, resolved_config

    def _check_same_run(run_dir: Path, cfg: object, picked: None) -> None:  # as the loop's resume
        RunDir(run_dir).check_same_run(_plain(cfg), picked, resolved_config)

    cfg = config_from_dict({"objective": {"name": "mtl", "kappa": 0.25}})
    old = {**dataclasses.asdict(cfg), "objective": {"name": "mtl", "kappa": 0.25}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    _check_same_run(tmp_path, cfg, None)
    other = config_from_dict({"objective": {"name": "mtl", "kappa": 0.5}})
    with pytest.raises(UserError, match="objective.kappa"):
        _check_same_run(tmp_path, other, None)
