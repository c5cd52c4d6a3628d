"""What the repository ships runs from any clone: no shipped study or published result names an
absolute path of the machine it was made on, and a study file's relative paths are read relative
to the file (so `mlsm study studies/cpu_replication.yaml` finds ../shared/data from any folder)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from mlsm.artifacts.results_file import append_results, read_results
from mlsm.study.spec import load_study

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
# an absolute path into a machine's own folders (a user's example like /scratch/$USER is fine)
MACHINE_PATH = re.compile(r"(?<![\w.$])/(work|home|root|tmp|Users|mnt)/\w")


def _shipped() -> list[Path]:
    files = list((ROOT / "studies").glob("*.yaml")) + list((ROOT / "configs").rglob("*.yaml"))
    for ext in ("*.json", "*.jsonl", "*.md", "*.csv"):
        files += [f for f in (ROOT / "docs" / "results").rglob(ext) if f.name != "stages.jsonl"]
    return files


@pytest.mark.parametrize("path", _shipped(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_shipped_file_names_a_machine_path(path: Path) -> None:
    hits = [line for line in path.read_text().splitlines() if MACHINE_PATH.search(line)]
    assert not hits, f"{path}: {hits[0][:160]}"


def test_published_results_rows_name_their_checkpoints_relative_to_the_study() -> None:
    rows = read_results(ROOT / "docs" / "results" / "cpu_replication" / "results.jsonl")
    assert rows and all(not Path(r["path"]).is_absolute() and r["path"].startswith("runs/")
                        for r in rows)


def test_study_paths_are_relative_to_the_study_file(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # anywhere but the repository
    spec = load_study(ROOT / "studies" / "cpu_replication.yaml")
    assert Path(spec.out) == (ROOT / "runs" / "studies" / "cpu_replication").resolve() \
        or os.path.normpath(spec.out) == str(ROOT / "runs" / "studies" / "cpu_replication")
    glue = Path(os.path.normpath(spec.finetune.data_dir))
    corpus = Path(os.path.normpath(spec.corpus.sources[0]))
    assert glue == SHARED / "glue"
    assert corpus == SHARED / "corpus" / "enwiki_2015_prefix" / "train.jsonl.gz"
    if SHARED.is_dir():
        assert glue.is_dir() and corpus.is_file()
        assert Path(spec.blimp.data[0]).is_dir()  # it exists beside the file, so it is a path


def test_relative_paths_in_a_user_study_file(tmp_path, monkeypatch) -> None:
    """hf: sources and HF dataset names stay names; files beside the study are found."""
    folder = tmp_path / "mine"
    (folder / "pairs").mkdir(parents=True)
    (folder / "study.yaml").write_text(
        "out: results/here\ncorpus: {sources: [text/*.txt, 'hf:wikitext']}\n"
        "finetune: {data_dir: glue}\nblimp: {data: [pairs, nyu-mll/blimp]}\n"
        "arms: {m: {objective: {name: mlm}}}\n")
    monkeypatch.chdir(tmp_path)
    spec = load_study(folder / "study.yaml")
    assert spec.out == str(folder / "results" / "here")
    assert spec.corpus.sources == [str(folder / "text" / "*.txt"), "hf:wikitext"]
    assert spec.finetune.data_dir == str(folder / "glue")
    assert spec.blimp.data == [str(folder / "pairs"), "nyu-mll/blimp"]
    assert load_study(folder / "study.yaml", out="elsewhere").out == "elsewhere"  # --out: as typed


def test_results_rows_inside_the_results_folder_are_written_relative(tmp_path, monkeypatch) -> None:
    results = tmp_path / "study" / "results.jsonl"
    inside, outside = tmp_path / "study" / "runs" / "a" / "step-1", tmp_path / "elsewhere"
    append_results(results, [{"path": str(inside), "run": str(inside.parent), "value": 1.0},
                             {"path": str(outside), "run": None, "value": 2.0}])
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert rows[0]["path"] == "runs/a/step-1" and rows[0]["run"] == "runs/a"
    assert rows[1]["path"] == str(outside) and rows[1]["run"] is None
    # a relative path is the working folder's: inside the results folder it is rewritten too
    monkeypatch.chdir(tmp_path)
    append_results(results, [{"path": "study/runs/b", "run": "elsewhere/x", "value": 3.0}])
    last = json.loads(results.read_text().splitlines()[-1])
    assert last["path"] == "runs/b" and last["run"] == "elsewhere/x"
