"""The artifacts layer's checkpoint and run folder (mlsm.artifacts.checkpoint, .rundir).

- `Checkpoint.open` reads every spec form (FOLDER, RUN, RUN@50%, RUN@step-N, an HF folder);
- the facts readers need (latent head, PLL refusal) are written at save time and read back by a
  process that never imports the objectives; a checkpoint written before they were is refused,
  naming `mlsm migrate` (tests/test_migrate.py), whatever the process imported;
- `--resume` refuses a token store or dictionary rebuilt in place with other content, and a run
  written before fingerprints were recorded resumes with one note.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mlsm.artifacts.checkpoint import COMPLETE, Checkpoint
from mlsm.artifacts.fingerprint import folder_fingerprint
from mlsm.artifacts.legacy import FORMS
from mlsm.errors import UserError

from .helpers import make_text, train_tiny

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture(scope="module")
def clm_run(store_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-step CLM run: an objective that refuses PLL scoring (its own training: neither shared
    run of conftest.py has a refusal to read back). `mlm_run` is the session's (conftest.py)."""
    return train_tiny(store_dir, tmp_path_factory.mktemp("art") / "clm",
                **{"train.steps": 2, "objective.name": "clm", "train.readiness": "[1.0]"})


def test_open_reads_every_spec_form(mlm_run: Path, tmp_path: Path) -> None:
    final = Checkpoint.open(mlm_run)
    assert (final.kind, final.step, final.readiness, final.objective) == ("checkpoint", 8, 1.0,
                                                                          "mlm")
    assert final.folder == mlm_run / "checkpoints" / "step-0000008"
    assert final.config["train"]["steps"] == 8 and final.store == final.config["data"]["store"]
    assert (final.latent_head, final.pll_refusal) == ("latent", None)
    assert final.tokens == 8 * final.config["train"]["batch_size"] * final.config["data"]["max_len"]
    assert final.fingerprint == folder_fingerprint(final.folder)
    assert final.probe_run == mlm_run / "probe-step-0000008"
    assert Checkpoint.open(f"{mlm_run}@50%").step == 4
    assert Checkpoint.open(f"{mlm_run}@step-1").step == 1
    assert Checkpoint.open(final.folder).info == final.info
    # an HF folder (no checkpoint.json): no facts, the defaults, and the same weights' fingerprint
    hf = tmp_path / "hf"
    shutil.copytree(final.folder, hf, ignore=shutil.ignore_patterns(COMPLETE))
    plain = Checkpoint.open(hf)
    assert (plain.kind, plain.step, plain.objective, plain.config) == ("hf", None, None, {})
    assert plain.fingerprint != final.fingerprint  # checkpoint.json is one of its files
    with pytest.raises(UserError, match="no checkpoint at step 3"):
        Checkpoint.open(f"{mlm_run}@step-3")


_READ_ALONE = """
import json, sys
from mlsm.artifacts.checkpoint import Checkpoint
ck = Checkpoint.open(sys.argv[1])
print(json.dumps({"head": ck.latent_head, "refusal": ck.pll_refusal,
                  "loaded": sorted(m for m in sys.modules if m.startswith(("mlsm.objectives",
                                                                            "mlsm.config")))}))
"""


def _read_alone(spec: str | Path) -> dict:
    """Open a checkpoint in a fresh process that imports only the artifacts layer."""
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run([sys.executable, "-c", _READ_ALONE, str(spec)], env=env, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout)


def test_facts_are_written_at_save_time_and_read_without_objectives(clm_run: Path) -> None:
    from mlsm.objectives import objective_class

    ck = Checkpoint.open(clm_run)
    declared = objective_class("clm").pll_refusal_at(ck.config["objective"], 2, 2)
    assert declared and ck.info["pll_refusal"] == declared  # in checkpoint.json itself
    alone = _read_alone(clm_run)
    assert alone == {"head": "latent", "refusal": declared, "loaded": []}


def test_a_checkpoint_without_the_facts_is_refused_naming_the_migration(
        clm_run: Path, tmp_path: Path) -> None:
    """No fallback: a process that imported the objectives reads no more than one that did not."""
    from mlsm.evaluate.probe.probe import load_scorer

    old = tmp_path / "old"
    shutil.copytree(Checkpoint.open(clm_run).folder, old)
    info = json.loads((old / COMPLETE).read_text())
    for key in ("latent_head", "pll_refusal"):
        del info[key]
    (old / COMPLETE).write_text(json.dumps(info))
    ck, said = Checkpoint.open(old), re.escape(str(old))
    for read in (lambda: ck.latent_head, lambda: ck.pll_refusal, lambda: load_scorer(old)):
        with pytest.raises(UserError, match=f"does not record .*: mlsm migrate {said}$"):
            read()


def _store(corpus: Path, tokenizer_dir: Path, out: Path, seed: int,
           overwrite: bool = False) -> Path:
    from mlsm.data.corpus import prepare_corpus

    corpus.mkdir(exist_ok=True)
    (corpus / "a.txt").write_text("\n\n".join(make_text(30, seed=seed)) + "\n")
    prepare_corpus(str(corpus), str(tokenizer_dir), out, overwrite=overwrite)
    return out


def test_resume_refuses_a_store_rebuilt_in_place(tokenizer_dir: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    store = _store(tmp_path / "corpus", tokenizer_dir, tmp_path / "store", seed=11)
    short = {"train.steps": 2, "train.readiness": "[1.0]"}
    run = train_tiny(store, tmp_path / "run", **short)
    train_tiny(store, run, resume="auto", **short)  # same: ok
    _store(tmp_path / "corpus", tokenizer_dir, store, seed=12, overwrite=True)  # other text
    with pytest.raises(UserError, match=r"data\.store: .*another train\.out"):
        train_tiny(store, run, resume="auto", **{"train.steps": 2, "train.readiness": "[1.0]"})
    # a run written before fingerprints were recorded resumes as before, with one note
    for path in (run / "run.json", Checkpoint.open(run).folder / COMPLETE):
        data = json.loads(path.read_text())
        del data["inputs"]
        path.write_text(json.dumps(data))
    capsys.readouterr()
    train_tiny(store, run, resume="auto", **{"train.steps": 2, "train.readiness": "[1.0]"})
    assert "records no fingerprints of its inputs" in capsys.readouterr().err
    for path in (run / "run.json", Checkpoint.open(run).folder / COMPLETE):
        data = json.loads(path.read_text())
        data.pop("inputs", None)
        path.write_text(json.dumps(data))
    monkeypatch.delitem(FORMS, "run-inputs-unrecorded")  # struck: not resumed
    with pytest.raises(UserError, match="no longer resumes such a run"):
        train_tiny(store, run, resume="auto", **{"train.steps": 2, "train.readiness": "[1.0]"})


def test_resume_refuses_a_dictionary_relearned_in_place(mlm_run: Path, store_dir: Path,
                                                        tmp_path: Path) -> None:
    from mlsm.teacher.dictionary import Dictionary, save_dictionary
    from mlsm.teacher.teacher import load_teacher

    teacher = load_teacher(str(Checkpoint.open(mlm_run).folder), 1)

    def dictionary(seed: int) -> None:  # of this teacher, as `mlsm dictionary` records it
        atoms = torch.randn(32, 16, generator=torch.Generator().manual_seed(seed))  # (d, k)
        save_dictionary(Dictionary(atoms / atoms.norm(dim=0), {"lam": 0.05,
                                                               **teacher.identity()}),
                        tmp_path / "dict.safetensors")

    dictionary(0)
    extra = {"train.steps": 2, "train.readiness": "[1.0]", "objective.name": "mlsm",
             "objective.teacher": str(Checkpoint.open(mlm_run).folder),
             "objective.dictionary": str(tmp_path / "dict.safetensors")}
    run = train_tiny(store_dir, tmp_path / "run", **extra)
    assert Checkpoint.open(run).latent_head == "latent"
    dictionary(1)  # re-learned: other atoms at the same path
    with pytest.raises(UserError, match=r"objective\.dictionary: .*another train\.out"):
        train_tiny(store_dir, run, resume="auto", **extra)


_MARKER_NAMES = re.compile(r"\b(COMPLETE|EXPORT_MARKER)\b|[\"'](checkpoint|mlsm)\.json[\"']")
_FILE_IO = re.compile(r"\b(write_text|atomic_write_text|json\.dump|read_json|json\.loads|"
                      r"read_text|open)\(")


def test_checkpoint_json_is_written_and_parsed_in_one_module() -> None:
    """checkpoint.json (and an export's mlsm.json) has one writer, `write_marker`, and one parser,
    in `mlsm.artifacts.checkpoint`: no other module of the package names the file in a line that
    reads or writes a file. (The export's own format check of a folder it wrote is the one
    reader of mlsm.json left outside, by name.)"""
    src = Path(__file__).resolve().parents[1] / "src" / "mlsm"
    home = src / "artifacts" / "checkpoint.py"
    found = [f"{path.relative_to(src)}:{n}: {line.strip()}"
             for path in sorted(src.rglob("*.py")) if path != home
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if _MARKER_NAMES.search(line) and _FILE_IO.search(line)
             ]
    assert not found, "checkpoint markers read or written outside artifacts/checkpoint.py:\n" + \
        "\n".join(found)
