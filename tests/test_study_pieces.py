"""`mlsm study report STUDY.yaml --from DIR [DIR ...] --to DEST`: a study run a piece at a time on
machines that keep nothing between sessions, each piece published (`--to`), reported as one. The
report over the pieces must say what the whole study's own report says, and a publication holds
only the rows that report counted."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import scipy.stats

from mlsm import cli
from mlsm.errors import UserError
from mlsm.study.publish import publish_report, report_pieces
from mlsm.study.spec import load_study
from tests.test_study_publish import seeded  # noqa: F401  (the two-arm, two-seed study)

_quiet = dict(log=lambda s: None)


def _piece(study_file: Path, tmp: Path, seed: int) -> Path:
    """The study as a machine that ran only pre-training seed `seed` left it, published: a copy
    of the folder without the other seed's runs and rows."""
    spec = load_study(study_file)
    folder = tmp / f"machine-s{seed}"
    shutil.copytree(spec.root, folder)
    for other in folder.glob("runs/*"):
        if not other.name.endswith(f"-s{seed}"):
            shutil.rmtree(other)
    for rows in folder.glob("readouts/*.jsonl"):
        if f"-s{seed}@" not in rows.name:
            rows.unlink()
    stages = folder / "stages.jsonl"  # its own stages; the store once, on the first machine
    lines = stages.read_text().splitlines(keepends=True)
    run_of = lambda line: (json.loads(line).get("arm") or "-s0").partition("@")[0]  # noqa: E731
    stages.write_text("".join(line for line in lines if run_of(line).endswith(f"-s{seed}")))
    dest = tmp / f"seed{seed}"
    publish_report(load_study(study_file, out=str(folder)), dest, **_quiet)
    return dest


def test_the_report_over_published_pieces_tests_what_the_whole_study_tests(
        seeded, tmp_path, capsys) -> None:  # noqa: F811
    pieces = [_piece(seeded, tmp_path, 0), _piece(seeded, tmp_path, 1)]
    for piece in pieces:  # each piece alone has one seed: no test
        assert json.loads((piece / "summary.json").read_text())["hypotheses"][0]["n"] == 1
    whole = tmp_path / "whole"
    publish_report(load_study(seeded), whole, **_quiet)
    dest = tmp_path / "combined"
    assert cli.main(["study", "report", str(seeded), "--from", *map(str, pieces),
                     "--to", str(dest)]) == 0
    assert "from 2 published pieces" in capsys.readouterr().out
    got = json.loads((dest / "summary.json").read_text())
    want = json.loads((whole / "summary.json").read_text())
    assert got["hypotheses"] == want["hypotheses"]
    assert got["hypotheses"][0]["p"] == pytest.approx(scipy.stats.ttest_rel(
        [0.23, 0.25], [0.20, 0.21], alternative="greater").pvalue)
    for key in ("compute", "readouts", "stage_seconds"):
        assert got[key] == want[key], key
    text = (dest / "report.md").read_text()
    assert "from the published pieces `seed0`, `seed1`" in text and str(tmp_path) not in text
    assert "All 2 arms pre-trained" not in text and "4 arms pre-trained" in text


def test_a_file_two_pieces_hold_differently_is_refused_in_one_line(seeded, tmp_path) -> None:  # noqa: F811
    pieces = [_piece(seeded, tmp_path, 0), _piece(seeded, tmp_path, 1)]
    lost = pieces[0] / "metrics" / "mlm-s1.jsonl"  # an earlier, lost run of seed 1's arm
    lost.write_text(json.dumps({"step": 1, "loss": 9.0}) + "\n")
    with pytest.raises(UserError, match=r"metrics/mlm-s1\.jsonl differs between the published "
                                         r"pieces seed0 and seed1"):
        report_pieces(load_study(seeded), pieces, tmp_path / "combined", **_quiet)
    lost.write_bytes((pieces[1] / "metrics" / "mlm-s1.jsonl").read_bytes())  # the same bytes
    report_pieces(load_study(seeded), pieces, tmp_path / "combined", **_quiet)


def test_a_publication_holds_only_the_rows_the_report_counted(seeded, tmp_path) -> None:  # noqa: F811
    spec = load_study(seeded)
    rows = spec.root / "readouts" / "mlm-s0@100pct.jsonl"
    kept = rows.read_bytes()
    stale = {**json.loads(kept), "value": 0.99, "fingerprint": "0000000000000000"}
    rows.write_bytes(kept + (json.dumps(stale) + "\n").encode())
    try:
        publish_report(spec, tmp_path / "published", **_quiet)
    finally:
        rows.write_bytes(kept)
    assert (tmp_path / "published" / "readouts" / rows.name).read_bytes() == kept


@pytest.mark.parametrize("case", ["not-a-report", "other-study", "into-a-piece", "no-to"])
def test_bad_pieces_are_one_line_naming_the_fix(case, seeded, tmp_path, capsys) -> None:  # noqa: F811
    piece = _piece(seeded, tmp_path, 0)
    dest, args = tmp_path / "combined", []
    if case == "not-a-report":
        args = [str(tmp_path)]
    elif case == "other-study":
        other = tmp_path / "other"
        shutil.copytree(piece, other)
        text = (other / "report.md").read_text()
        (other / "report.md").write_text(text.replace("# Study `", "# Study `another_", 1))
        args = [str(other)]
    elif case == "into-a-piece":
        args, dest = [str(piece)], piece
    before = sorted(p.name for p in piece.rglob("*"))
    to = [] if case == "no-to" else ["--to", str(dest)]
    assert cli.main(["study", "report", str(seeded), "--from", *(args or [str(piece)]), *to]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert {"not-a-report": "is not a published study report", "other-study": "another study",
            "into-a-piece": "would overwrite the piece", "no-to": "--to DEST"}[case] in err
    assert sorted(p.name for p in piece.rglob("*")) == before  # nothing read was touched


def test_run_piece_runs_its_arms_and_publishes_them(corpus_dir, tokenizer_dir, teacher_dir,
                                                    tmp_path) -> None:
    """scripts/run_piece.sh, as docs/results/cpu_replication_v3 runs each session's piece: only
    the arms named are pre-trained, and they alone land in the piece (not an earlier piece's
    arms, which are published in their own folder); no arm is one line, exit 2."""
    import os
    import subprocess
    import sys

    from tests.test_study import _write, seeded_raw

    root = Path(__file__).resolve().parents[1]
    path = _write(tmp_path, seeded_raw(corpus_dir, tokenizer_dir, teacher_dir, tmp_path / "s"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1",  # the script's `python` is this one
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    script = str(root / "scripts" / "run_piece.sh")
    for arm, piece in (("mlm-s0", tmp_path / "seed0a"), ("mlm_hi-s0", tmp_path / "seed0b")):
        done = subprocess.run(["bash", script, str(path), str(piece), arm],
                              capture_output=True, text=True, env=env, cwd=root)
        assert done.returncode == 0, done.stderr[-2000:]
        # each piece holds its own arm only, though the study folder holds both
        assert [p.name for p in (piece / "metrics").glob("*.jsonl")] == [f"{arm}.jsonl"]
    assert not (tmp_path / "s" / "runs" / "mlm-s1").exists()
    assert (piece / "report.md").read_text().startswith("# Study `")
    bare = subprocess.run(["bash", script, str(path), str(piece)], capture_output=True,
                          text=True, env=env, cwd=root)
    assert bare.returncode == 2 and len(bare.stderr.strip().splitlines()) == 1


def test_a_piece_of_some_arms_publishes_their_rows_only(seeded, tmp_path,  # noqa: F811
                                                        capsys) -> None:
    """`report --to DIR --arms ...`: a piece whose other arms are unfinished (their runs would
    be redone on the next machine) holds only the named arms' rows, metrics and stage costs,
    and its report shows theirs only: no other arm's stage times, no warning that the other
    arms' rows are stale."""
    piece = tmp_path / "piece"
    assert cli.main(["study", "report", str(seeded), "--to", str(piece), "--arms",
                     "mlm-s0", "mlm_hi-s0"]) == 0
    assert "warning" not in capsys.readouterr().out
    summary = json.loads((piece / "summary.json").read_text())
    assert {t["arm"] for t in summary["stage_seconds"]} == {None, "mlm-s0", "mlm_hi-s0"}
    assert {k.partition(":")[2].partition("@")[0] for k in summary["status"]} == \
        {"", "mlm-s0", "mlm_hi-s0"}
    table = (piece / "report.md").read_text().partition("## Wall time of every stage")[2]
    assert "| pretrain | mlm-s0 |" in table and "-s1 |" not in table
    assert sorted(p.name for p in (piece / "metrics").iterdir()) == \
        ["mlm-s0.jsonl", "mlm-s0.run.json", "mlm_hi-s0.jsonl", "mlm_hi-s0.run.json"]
    assert sorted(p.name for p in (piece / "readouts").iterdir()) == \
        ["mlm-s0@100pct.jsonl", "mlm_hi-s0@100pct.jsonl"]
    arms = {json.loads(line)["arm"] for line in (piece / "stages.jsonl").read_text().splitlines()}
    assert arms == {None, "mlm-s0", "mlm_hi-s0"}


def test_a_piece_of_an_unknown_arm_is_one_line_and_writes_nothing(seeded, tmp_path,  # noqa: F811
                                                                   capsys) -> None:
    dest = tmp_path / "piece"
    assert cli.main(["study", "report", str(seeded), "--to", str(dest), "--arms", "zz"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unknown arm 'zz'" in err
    assert not dest.exists()


def test_the_report_lists_the_failures_that_still_stand(corpus_dir, tokenizer_dir, teacher_dir,
                                                        tmp_path) -> None:
    """A readout subprocess killed by a stop leaves `readout-job:RUN@100%` failed in
    status.json. Once a later run (here a lone arm, which runs its stages in the driver) has
    done that readout, the failure no longer stands and the report leaves it out; the other
    run's, whose readout is still to do, stays; a piece of some arms shows theirs only."""
    from mlsm.study.folder import Study
    from mlsm.study.runner import run_study
    from tests.test_study import _tiny_tasks, _write, seeded_raw

    tasks, pairs = _tiny_tasks(tmp_path)
    raw = seeded_raw(corpus_dir, tokenizer_dir, teacher_dir, tmp_path / "study")
    raw.update(seeds=[0], readout={"glue": str(tasks), "tasks": ["word_order"],
                                   "pairs": [str(pairs)], "masked_batches": 1, "batch_size": 4})
    path = _write(tmp_path, raw)
    run_study(load_study(path), stages=["store", "pretrain"], **_quiet)
    study = Study(load_study(path), **_quiet)

    def killed() -> None:
        raise RuntimeError("the readout subprocess exited with -15")

    for run in ("mlm-s0", "mlm_hi-s0"):  # what the driver records for a killed subprocess
        assert not study.stage("readout-job", killed, f"{run}@100%")
    run_study(load_study(path), stages=["readout"], arms=["mlm-s0"], **_quiet)

    def failed(dest: Path, arms: list[str] | None = None) -> list[str]:
        publish_report(load_study(path), dest, **_quiet) if arms is None else \
            cli.main(["study", "report", str(path), "--to", str(dest), "--arms", *arms])
        text = (dest / "report.md").read_text()
        return [line.split("`")[1] for line in text.partition("## Failed\n")[2].splitlines()
                if line.startswith("- `")]

    assert failed(tmp_path / "all") == ["readout-job:mlm_hi-s0@100%"]
    assert failed(tmp_path / "piece", ["mlm-s0"]) == []
