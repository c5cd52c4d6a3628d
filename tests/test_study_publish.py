"""`mlsm study report STUDY.yaml --to DIR`: the report of what a study has done, with the rows it
reads, written elsewhere while the study holds its folder's lock, the study folder only read.
Its bad destinations are cases of the guard table (tests/test_bad_inputs_guards.py)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import scipy.stats

from mlsm import cli
from mlsm.study.publish import publish_report
from mlsm.study.runner import run_study
from mlsm.study.spec import load_study
from tests.test_study import SEEDED_TOP1, _write, seeded_raw, write_readout_rows


@pytest.fixture(scope="module")
def seeded(corpus_dir, tokenizer_dir, teacher_dir, tmp_path_factory) -> Path:
    """A two-arm, two-seed study: pre-trained (2 steps), with one readout row per run as the
    readout stage writes them (stamped with their inputs' fingerprint)."""
    tmp = tmp_path_factory.mktemp("publish")
    path = _write(tmp, seeded_raw(corpus_dir, tokenizer_dir, teacher_dir, tmp / "study"))
    run_study(load_study(path), stages=["store", "pretrain"], log=lambda s: None)
    write_readout_rows(path, SEEDED_TOP1)
    return path


@contextmanager
def _held_elsewhere(folder: Path) -> Iterator[None]:
    """The study folder's lock held by another process (this one's `hold` is re-entrant)."""
    code = ("import sys; from mlsm import locking\n"
            "with locking.hold(sys.argv[1], 'study folder'):\n"
            "    print('held', flush=True); sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", code, str(folder)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        yield
    finally:
        holder.communicate("", timeout=60)


def _state(folder: Path) -> dict[str, tuple[str, int]]:
    """Every file under `folder`: its bytes' hash and its modification time."""
    return {str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(),
                                         p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_report_to_a_folder_runs_beside_the_study_and_leaves_its_folder_alone(
        seeded, tmp_path, capsys) -> None:
    spec = load_study(seeded)
    before = _state(spec.root)
    dest = tmp_path / "published"
    with _held_elsewhere(spec.root):  # as while `mlsm study` runs
        assert cli.main(["study", "report", str(seeded)]) == 2  # the study's own report waits
        assert "is being written by" in capsys.readouterr().err
        assert cli.main(["study", "report", str(seeded), "--to", str(dest)]) == 0
    assert _state(spec.root) == before  # nothing written, touched or moved in the study folder
    text = (dest / "report.md").read_text()
    p = scipy.stats.ttest_rel([0.23, 0.25], [0.20, 0.21], alternative="greater").pvalue
    assert "| H1 | mlm_hi@100% | mlm@100% | 2 | 0.2300, 0.2500 | 0.2000, 0.2100 |" in text
    assert json.loads((dest / "summary.json").read_text())["hypotheses"][0]["p"] == \
        pytest.approx(p)
    assert str(tmp_path) not in text and (dest / "pretraining.png").is_file()
    assert "as it was at" in text  # a copy taken mid-study says when
    # the evidence, byte for byte: the rows the report read, each run's metrics
    for run in SEEDED_TOP1:
        name = f"{run}@100pct.jsonl"
        assert (dest / "readouts" / name).read_bytes() == \
            (spec.root / "readouts" / name).read_bytes()
        assert (dest / "metrics" / f"{run}.jsonl").read_bytes() == \
            (spec.root / "runs" / run / "metrics.jsonl").read_bytes()
    assert (dest / "preregistration.json").read_bytes() == \
        (spec.root / "preregistration.json").read_bytes()
    # the same study's own report, once the lock is free, says the same about the hypothesis
    run_study(spec, stages=["report"], log=lambda s: None)
    own = json.loads((spec.root / "summary.json").read_text())
    assert own["hypotheses"] == json.loads((dest / "summary.json").read_text())["hypotheses"]


def test_publishing_again_replaces_the_earlier_copy_and_keeps_hidden_entries(
        seeded, tmp_path) -> None:
    spec = load_study(seeded)
    dest = tmp_path / "published"
    publish_report(spec, dest, log=lambda s: None)
    (dest / ".git").mkdir()  # a user's repository around the published folder
    gone = spec.root / "readouts" / "mlm_hi-s1@100pct.jsonl"
    kept = gone.read_bytes()
    gone.unlink()  # the study no longer has this row (e.g. redone under new settings)
    try:
        publish_report(spec, dest, log=lambda s: None)
    finally:
        gone.write_bytes(kept)
    assert not (dest / "readouts" / gone.name).exists()  # no stale row stays in the copy
    assert (dest / ".git").is_dir()
    h1 = json.loads((dest / "summary.json").read_text())["hypotheses"][0]
    assert h1["n"] == 1 and h1["p"] is None


def test_a_kill_while_publishing_keeps_the_earlier_copy_whole_and_a_rerun_repairs(
        seeded, tmp_path, monkeypatch) -> None:
    """A kill between the copies left a mix of the old and the new publication, without
    report.md, which the rerun then refused as a folder not its own. The next publication is
    built beside (hidden) and swapped in; a kill in the swap is repaired by the rerun."""
    from mlsm.study import publish, report

    spec = load_study(seeded)
    dest = tmp_path / "published"
    publish_report(spec, dest, log=lambda s: None)
    earlier = _state(dest)

    def killed(*args, **kwargs):  # noqa: ANN002, ANN003
        raise KeyboardInterrupt

    monkeypatch.setattr(report, "write_report", killed)  # dies after the evidence is copied
    with pytest.raises(KeyboardInterrupt):
        publish_report(spec, dest, log=lambda s: None)
    assert {k: v for k, v in _state(dest).items() if not k.startswith(".")} == earlier
    monkeypatch.undo()
    real_rename, moved = Path.rename, []

    def rename_then_die(self: Path, target: Path) -> Path:
        if self.parent.name == publish.STAGING and moved:
            raise KeyboardInterrupt  # the old entries gone, one of the new in
        moved.append(self)
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", rename_then_die)
    with pytest.raises(KeyboardInterrupt):
        publish_report(spec, dest, log=lambda s: None)
    monkeypatch.undo()
    assert cli.main(["study", "report", str(seeded), "--to", str(dest)]) == 0  # repairs
    assert (dest / "report.md").is_file() and not (dest / publish.SWAPPING).exists()
    assert not (dest / publish.STAGING).exists()
    assert set(_state(dest)) == set(earlier)
