"""Refusals that need no model, made before torch and transformers import.

Importing torch and transformers takes seconds on an idle machine and close to a minute on a
loaded one; a verb given a checkpoint that does not exist, an --out holding something else or a
missing token store should say so at once. The verbs call these checks first, then import the
library that does the work (which checks the same things again, for its Python callers). Every
module imported here stays light: tests/test_cli_early.py runs each refusal in a fresh
interpreter and checks that torch and transformers were never imported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlsm.artifacts.checkpoint import Checkpoint, expand_models, resolve_checkpoint
from mlsm.config import merge, parse_overrides, read_yaml
from mlsm.errors import UserError
from mlsm.hf import check_folder
from mlsm.inputs import beside, store_missing


def mlsm_checkpoint(spec: str, fix: str, *, hf_folder: bool = False) -> Checkpoint:
    """The mlsm checkpoint a verb's argument names (a folder, RUN, RUN@50%, RUN@step-N); `fix`
    ends the line when it names none. hf_folder: a folder with an HF config.json passes too (the
    verb reads what it can tell of itself: `mlsm export` of a plain Trainer's folder)."""
    ck = Checkpoint.open(spec)
    if hf_folder and (ck.folder / "config.json").is_file():
        return ck
    if not ck.is_checkpoint:
        what = ("does not exist" + beside(ck.folder) if not ck.folder.exists()
                else "is not an mlsm checkpoint (no checkpoint.json)")
        raise UserError(f"{ck.folder} {what}; {fix}")
    return ck


def model(spec: str) -> None:
    """A model argument of an evaluation verb: a run spec that resolves, a local folder that
    exists and is not code, or a hub id; a checkpoint PLL cannot score is refused here too."""
    folder = resolve_checkpoint(spec)
    text = str(folder)
    local = folder.is_absolute() or text.startswith((".", "~")) or text.count("/") > 1
    if not folder.exists() and not local:
        return  # a hub id (org/name): transformers decides, offline or not
    if not folder.exists():
        raise UserError(f"{folder} does not exist{beside(folder)}; pass a run, a checkpoint "
                        "or an HF model folder")
    check_folder(folder)


def scorer(spec: str) -> None:
    """A model argument that PLL scores (blimp, score): `model`, and an mlsm checkpoint whose
    objective PLL can score."""
    model(spec)
    ck = Checkpoint.open(spec)
    if ck.is_checkpoint:
        ck.require_pll()


def models(specs: list[str], readiness: str) -> None:
    """The MODEL arguments of `mlsm finetune` ([NAME=]SPEC), after --readiness."""
    for spec in expand_models(specs, readiness):
        named = "=" in spec and not Path(spec).is_dir()
        model(spec.partition("=")[2] if named else spec)


def store(path: str, flag: str = "--store") -> None:
    """A token-store argument (`flag` names it in the line): a folder
    (`mlsm.inputs.store_missing`)."""
    if path and (missing := store_missing(path)):
        raise UserError(f"{flag}: {missing}")


def run_config(config: str | None, overrides: list[str]) -> None:
    """The paths of a pretrain recipe that can be checked without the objectives: the YAML file
    and its data.store."""
    raw: Any = read_yaml(config) if config else {}
    if not isinstance(raw, dict):
        return  # load_config names the problem
    data = merge(raw, parse_overrides(overrides)).get("data")
    if isinstance(data, dict) and isinstance(data.get("store"), str):
        store(data["store"], "data.store")
