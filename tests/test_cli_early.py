"""Refusals that need no model come before torch and transformers import (issue #54, item 6).

Each case runs `mlsm.cli.main` in a fresh interpreter and reads, after the refusal, whether torch
or transformers sit in `sys.modules`: an import that sneaks back into the path of a refusal (a
heavy module imported at the top of a verb's handler, a check moved after the model load) fails
here, where a timing test would only be flaky.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from mlsm.inputs import beside

from .test_bad_inputs_data import ENV

PROBE = ("import json, sys; from mlsm.cli import main; rc = main(sys.argv[1:]); "
         "print(json.dumps([rc, 'torch' in sys.modules, 'transformers' in sys.modules]))")


def _refuse(argv: list[str], cwd: Path) -> tuple[int, bool, str]:
    """(exit status, whether torch or transformers was imported, stderr)."""
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=120)
    rc, torch, transformers = json.loads(done.stdout.strip().splitlines()[-1])
    return rc, torch or transformers, done.stderr


def _export_over_folder(tmp: Path, ckpt: Path) -> list[str]:
    (tmp / "mine").mkdir()
    (tmp / "mine" / "notes.txt").write_text("the user's own file")
    return ["export", str(ckpt), "--out", str(tmp / "mine")]


CASES: dict[str, tuple[Callable[[Path, Path], list[str]], str]] = {
    "probe, no such checkpoint": (lambda t, c: ["probe", str(t / "runs" / "nope")],
                                  "does not exist"),
    "probe, RUN@ of no run": (lambda t, c: ["probe", f"{t / 'nope'}@step-5"],
                              "is not a run directory"),
    "probe, no such store": (lambda t, c: ["probe", str(c), "--store", str(t / "st")],
                             "token store"),
    "export, no such checkpoint": (lambda t, c: ["export", str(t / "nope"), "--out",
                                                 str(t / "x")], "does not exist"),
    "export, --out not an export": (_export_over_folder, "is not an mlsm export"),
    "blimp, no such model": (lambda t, c: ["blimp", str(t / "nope"), "--out", str(t / "b")],
                             "does not exist"),
    "score, no such model": (lambda t, c: ["score", str(t / "nope"), str(t / "s.txt"), "--out",
                                           str(t / "s.jsonl")], "does not exist"),
    "readout, no such model": (lambda t, c: ["readout", str(t / "nope"), "--out", str(t / "r")],
                               "does not exist"),
    "rank, no such model": (lambda t, c: ["rank", str(t / "nope"), "--text", str(t / "s.txt"),
                                          "--out", str(t / "k")], "does not exist"),
    "finetune, no such model": (lambda t, c: ["finetune", f"a={t / 'nope'}", "--tasks", "rte"],
                                "does not exist"),
    "dictionary, no such store": (lambda t, c: ["dictionary", "--store", str(t / "st"), "--out",
                                                str(t / "d.safetensors")], "token store"),
    "targets, no such store": (lambda t, c: ["targets", "--store", str(t / "st"), "--dictionary",
                                             str(t / "d"), "--out", str(t / "tg")],
                               "token store"),
    "pretrain, no such recipe": (lambda t, c: ["pretrain", "--config", str(t / "r.yaml")],
                                 "not found"),
    "pretrain, no such store": (lambda t, c: ["pretrain", f"data.store={t / 'st'}"],
                                "token store"),
    "pretrain --text, no such text": (lambda t, c: ["pretrain", "--text", str(t / "mine.txt")],
                                      "not found"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_refusal_before_heavy_imports(case: str, tmp_path: Path, teacher_dir: Path) -> None:
    make, needle = CASES[case]
    (tmp_path / "s.txt").write_text("a sentence .\n")
    rc, heavy, err = _refuse(make(tmp_path, teacher_dir), tmp_path)
    assert rc == 2, err
    assert needle in err and len(err.strip().splitlines()) == 1, err
    assert not heavy, f"{case}: torch or transformers imported before the refusal"
    if case.startswith("export, --out"):
        assert (tmp_path / "mine" / "notes.txt").read_text() == "the user's own file"


def test_a_mistyped_store_names_the_folder_beside_it(tmp_path: Path) -> None:
    (tmp_path / "runs" / "store").mkdir(parents=True)
    (tmp_path / "runs" / "other").mkdir()
    rc, heavy, err = _refuse(["pretrain", "data.store=runs/stor"], tmp_path)
    assert rc == 2 and not heavy
    assert "(did you mean runs/store?)" in err, err


@pytest.mark.parametrize("typed, meant", [("runz/store", "runs/store"),
                                          ("runs/stroe", "runs/store"),
                                          ("runs/store/xyz", "")])
def test_beside_suggests_only_an_existing_folder(tmp_path: Path, typed: str, meant: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "runs" / "store").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert beside(typed) == (f" (did you mean {meant}?)" if meant else "")


def test_export_help_says_it_takes_a_run(capsys: pytest.CaptureFixture) -> None:
    from mlsm.cli import main

    assert main(["export", "--help"]) == 0
    usage = capsys.readouterr().out
    assert usage.rstrip().split("\n\n")[0].split()[-1] == "RUN"  # the positional's name
    assert "RUN@step-N" in usage and "mlsm export runs/" in usage
