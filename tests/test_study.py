"""`mlsm study`: stages on the fixture corpus with tiny students, skip-if-complete, resume,
failures."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import scipy.stats
import torch
import yaml

from mlsm.artifacts.legacy import FORMS
from mlsm.errors import Incomplete, UserError
from mlsm.study.runner import OUTPUTS, Study, run_study
from mlsm.study.spec import load_study, study_from_dict
from tests.helpers import TINY_MODEL


def _raw(
    corpus_dir: Path, tokenizer_dir: Path, teacher_dir: Path, out: Path, **extra: object
) -> dict:
    raw = {
        "name": "tiny",
        "out": str(out),
        "corpus": {"sources": [str(corpus_dir)], "tokenizer": str(tokenizer_dir)},
        "base": {
            "data": {"max_len": 32},
            "model": {"arch": "bert", "overrides": dict(TINY_MODEL)},
            "optim": {"lr": 1e-3},
            "train": {"steps": 8, "batch_size": 8, "log_every": 1, "device": "cpu"},
        },
        "readiness": [0.5, 1.0],
        "arms": {
            "mlm": {"objective": {"name": "mlm"}},
            "mlsm": {
                "objective": {"name": "mlsm"},
                "dictionary": {"layer": 1, "k": 64, "lam": 0.05},
            },
        },
        "dictionary": {"teacher": str(teacher_dir), "n_vectors": 2000, "max_len": 32},
        "executor": {"kind": "local", "threads": 1},
    }
    raw.update(extra)
    return raw


def _write(tmp_path: Path, raw: dict) -> Path:
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _stages(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "stages.jsonl").read_text().splitlines()]


def test_pretrain_stage_trains_every_arm_then_skips(
    corpus_dir, tokenizer_dir, teacher_dir, tmp_path
) -> None:
    out = tmp_path / "study"
    spec = load_study(_write(tmp_path, _raw(corpus_dir, tokenizer_dir, teacher_dir, out)))
    run_study(spec, stages=["store", "dictionary", "pretrain"], log=lambda s: None)
    for arm in ("mlm", "mlsm"):
        assert (out / "runs" / arm / "checkpoints" / "step-0000008" / "COMPLETE").exists() or \
            (out / "runs" / arm / "checkpoints" / "step-0000008").is_dir()
        assert (out / "runs" / arm / "checkpoints" / "step-0000004").is_dir()  # readiness 50 %
    # identical batches across arms: the logged batch digests agree step by step
    digests = [
        [
            json.loads(x)["batch_digest"]
            for x in (out / "runs" / a / "metrics.jsonl").read_text().splitlines()
        ]
        for a in ("mlm", "mlsm")
    ]
    assert digests[0] == digests[1]
    first = len(_stages(out))
    run_study(spec, stages=["store", "dictionary", "pretrain"], log=lambda s: None)
    assert len(_stages(out)) == first  # nothing re-ran: a skipped stage records no time
    assert Study(spec).status()["pretrain:mlm"]["state"] == "done"


def test_changed_config_is_an_error_naming_the_arm(
    corpus_dir, tokenizer_dir, teacher_dir, tmp_path
) -> None:
    out = tmp_path / "study"
    raw = _raw(corpus_dir, tokenizer_dir, teacher_dir, out)
    raw["arms"] = {"mlm": raw["arms"]["mlm"]}
    run_study(load_study(_write(tmp_path, raw)), stages=["store", "pretrain"], log=lambda s: None)
    raw["base"]["optim"]["lr"] = 5e-4
    spec = load_study(_write(tmp_path, raw))
    with pytest.raises(Incomplete, match="pretrain:mlm"):
        run_study(spec, stages=["store", "pretrain"], log=lambda s: None)
    error = Study(spec).status()["pretrain:mlm"]["error"]
    assert "arm mlm" in error and "optim.lr" in error


def test_interrupted_arm_resumes_and_matches_an_uninterrupted_run(
    corpus_dir, tokenizer_dir, teacher_dir, tmp_path
) -> None:
    from safetensors.torch import load_file

    raws = []
    for name in ("once", "twice"):
        raw = _raw(corpus_dir, tokenizer_dir, teacher_dir, tmp_path / name)
        raw["arms"] = {"mlm": raw["arms"]["mlm"]}
        raws.append(raw)
    run_study(study_from_dict(raws[0]), stages=["store", "pretrain"], log=lambda s: None)
    # the interrupted study: pre-training stopped after the 50 % checkpoint
    # (as a kill would leave it)
    spec = study_from_dict(raws[1])
    study = Study(spec, log=lambda s: None)
    from mlsm.train.loop import pretrain

    cfg = study.arm_config("mlm")
    run_study(spec, stages=["store"], log=lambda s: None)
    _stop_after(cfg, 4, pretrain)
    assert not (tmp_path / "twice" / "runs" / "mlm" / "checkpoints" / "step-0000008").exists()
    run_study(spec, stages=["store", "pretrain"], log=lambda s: None)
    a = load_file(
        tmp_path / "once" / "runs" / "mlm" / "checkpoints" / "step-0000008" / "model.safetensors"
    )
    b = load_file(
        tmp_path / "twice" / "runs" / "mlm" / "checkpoints" / "step-0000008" / "model.safetensors"
    )
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def _stop_after(cfg, step: int, pretrain) -> None:
    """Run `cfg` but stop right after `step` the way SIGTERM does (checkpoint, then leave)."""
    import signal

    from mlsm.data import batches

    real = batches.BatchSource.micro_batches

    def micro_batches(self, s, *args, **kw):  # noqa: ANN001 - the interrupt arrives during step `step`
        if s == step - 1:
            signal.raise_signal(signal.SIGTERM)
        return real(self, s, *args, **kw)

    batches.BatchSource.micro_batches = micro_batches
    try:
        pretrain(cfg)
    finally:
        batches.BatchSource.micro_batches = real


def test_a_failing_arm_is_recorded_and_the_others_finish(
    corpus_dir, tokenizer_dir, teacher_dir, tmp_path
) -> None:
    out = tmp_path / "study"
    raw = _raw(corpus_dir, tokenizer_dir, teacher_dir, out)
    raw["arms"]["broken"] = {"objective": {"name": "mlsm", "teacher": str(tmp_path / "missing")},
                             "dictionary": {"layer": 1, "k": 64, "lam": 0.05}}
    spec = study_from_dict(raw)
    with pytest.raises(Incomplete, match="of study .* failed: .*pretrain:broken"):
        run_study(spec, stages=["store", "dictionary", "pretrain"], log=lambda s: None)
    status = Study(spec).status()
    assert status["pretrain:broken"]["state"] == "failed"
    assert status["pretrain:mlm"]["state"] == "done" and status["pretrain:mlsm"]["state"] == "done"


def test_bad_study_files_fail_with_one_line(tmp_path) -> None:
    with pytest.raises(UserError, match="arms.a.objective has no name"):
        study_from_dict({"arms": {"a": {"objective": {"kappa": 1.0}}}})
    with pytest.raises(UserError, match="unknown key arms.a.oops"):
        study_from_dict({"arms": {"a": {"oops": 1}}})
    with pytest.raises(UserError, match="finetune.readiness lists 0.3"):
        study_from_dict({"arms": {"a": {}}, "finetune": {"readiness": [0.3]}})
    with pytest.raises(UserError, match="executor.slurm.timeout_min is not set"):
        study_from_dict({"arms": {"a": {}}, "executor": {"kind": "slurm",
                                                         "slurm": {"partition": "gpu"}}})
    with pytest.raises(UserError, match="study file .* not found"):
        load_study(tmp_path / "nope.yaml")


def _tiny_tasks(root: Path) -> tuple[Path, Path]:
    """A word-order task (real sentence vs shuffled) and a 2-phenomenon BLiMP file, from fixture
    text."""
    import random

    from tests.helpers import make_text

    rng = random.Random(0)
    sents = [s.strip() for d in make_text(30, seed=7) for s in d.split(".") if len(s.split()) >= 4]
    rows = []
    for s in sents[:120]:
        words = s.split()
        shuffled = words[:]
        rng.shuffle(shuffled)
        rows.append((" ".join(shuffled), 0) if rng.random() < 0.5 else (s, 1))
    folder = root / "tasks" / "WordOrder"
    folder.mkdir(parents=True)
    for name, part in (("train.tsv", rows[:80]), ("dev.tsv", rows[80:])):
        (folder / name).write_text("sentence\tlabel\n" + "".join(f"{s}\t{y}\n" for s, y in part))
    blimp = root / "blimp"
    blimp.mkdir()
    for uid in ("uid_a", "uid_b"):
        lines = [
            json.dumps(
                {
                    "sentence_good": s,
                    "sentence_bad": " ".join(reversed(s.split())),
                    "UID": uid,
                    "field": "syntax",
                    "linguistics_term": "order",
                    "pairID": str(i),
                }
            )
            for i, s in enumerate(sents[:5])
        ]
        (blimp / f"{uid}.jsonl").write_text("\n".join(lines) + "\n")
    return root / "tasks", blimp


def test_whole_study_writes_a_report_with_every_section(
    corpus_dir, tokenizer_dir, teacher_dir, tmp_path
) -> None:
    tasks, blimp = _tiny_tasks(tmp_path)
    out = tmp_path / "study"
    raw = _raw(
        corpus_dir, tokenizer_dir, teacher_dir, out,
        finetune={
            "tasks": ["word_order"],
            "data_dir": str(tasks),
            "readiness": [0.5, 1.0],
            "seeds": 2,
            "lrs": [1e-3],
            "epochs": 1,
            "batch_size": 16,
            "max_len": 32,
        },
        blimp={"data": [str(blimp)], "readiness": [1.0]},
        # min_delta tiny: on the random-word fixture corpus the probe beats the unigram
        # only a little
        probe={
            "max_steps": 40,
            "eval_every": 10,
            "select_steps": 10,
            "heldout_batches": 1,
            "batch_size": 8,
            "min_delta": 1e-4,
        },
        readout={"glue": str(tasks), "tasks": ["word_order"], "pairs": [str(blimp)],
                 "masked_batches": 1, "batch_size": 4},
    )
    spec = load_study(_write(tmp_path, raw))
    report = run_study(spec, log=lambda s: None)
    assert report == out / "report.md"
    _check_readouts(out, report.read_text())
    text = report.read_text()
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert {r["model"] for r in rows} == {"mlm@50%", "mlm@100%", "mlsm@50%", "mlsm@100%"}
    assert {r["seed"] for r in rows} == {0, 1}
    for section in (
        "Compute per arm", "Wilcoxon", "Pair sets (PLL", "Wall time of every stage",
        "readiness.png", "| mlsm@50% | mlm@100% |", "| mlsm@100% | mlm@100% |",
        "its metrics averaged",
    ):
        assert section in text
    # the report names the machine: the CPU model (/proc/cpuinfo on Linux), cores and torch
    machine = json.loads((out / "summary.json").read_text())["machine"]
    assert f"machine: {machine}." in text
    assert f"{os.cpu_count()} CPUs" in machine and f"torch {torch.__version__}" in machine
    cpuinfo = Path("/proc/cpuinfo")
    names = [x.split(":", 1)[1].strip() for x in
             (cpuinfo.read_text().splitlines() if cpuinfo.exists() else [])
             if x.startswith("model name")]
    assert not names or names[0] in machine
    summary = json.loads((out / "summary.json").read_text())["finetune"]
    # word_order reports accuracy only: one metric per run, so both pairings agree
    assert summary["per_run"]["n_pairs"] == summary["n_pairs"]
    # BLiMP pairs by phenomenon: SciPy's Wilcoxon on the two models' per-phenomenon accuracies
    (pair,) = json.loads((out / "summary.json").read_text())["blimp_pairs"]
    assert (pair["a"], pair["b"]) == ("mlsm@100%", "mlm@100%")
    acc = {m: next(iter(json.loads((out / "blimp" / f"{m}@100pct.json").read_text())["sets"]
                        .values()))["phenomena"] for m in ("mlsm", "mlm")}
    x, y = (np.array([acc[m][k] for k in sorted(acc["mlm"])]) for m in ("mlsm", "mlm"))
    assert pair["n_phenomena"] == len(x) and pair["wins_a"] == int(np.sum(x > y))
    assert pair["mean_diff"] == pytest.approx(float(np.mean(x - y)))
    expected = 1.0 if np.all(x == y) else scipy.stats.wilcoxon(x, y).pvalue
    assert pair["p_two_sided"] == pytest.approx(expected)
    assert "paired by phenomenon" in text
    probe = json.loads((out / "runs" / "mlsm" / "probe-100" / "probe.json").read_text())
    blimp_row = json.loads((out / "blimp" / "mlsm@100pct.json").read_text())
    assert (
        blimp_row["probe"]["heldout_loss"] == probe["heldout_loss"]
    )  # the probe's quality travels with its score
    assert (out / "summary.json").is_file() and (out / "pretraining.png").is_file()
    # what a study writes is all in the list that keeps a corpus source out of its outputs
    assert {p.name for p in out.iterdir()} <= set(OUTPUTS), sorted(p.name for p in out.iterdir())
    _check_precision_column(spec, out, text)


def _check_precision_column(spec, out: Path, text: str) -> None:
    """Each arm's precision comes from its run.json (what the run trained in, auto resolved);
    arms that trained in different precisions are named in one warning line."""
    from mlsm.study.report import write_report

    compute = json.loads((out / "summary.json").read_text())["compute"]
    assert {c["arm"]: c["precision"] for c in compute} == {"mlm": "fp32", "mlsm": "fp32"}
    assert "different precisions" not in text
    marker = out / "runs" / "mlsm" / "run.json"
    record = json.loads(marker.read_text())
    marker.write_text(json.dumps({**record, "precision": "bf16"}))
    text = write_report(Study(spec, log=lambda s: None)).read_text()
    assert "**Arms trained in different precisions** (mlm: fp32, mlsm: bf16)" in text
    # a segment written before precisions were recorded is no precision of its own
    old_segment = {k: v for k, v in record.items() if k != "precision"}
    marker.write_text(json.dumps({**record, "resumed": [old_segment]}))
    text = write_report(Study(spec, log=lambda s: None)).read_text()
    assert "| mlsm | mlsm | fp32 + not recorded |" in text
    assert "different precisions" not in text
    marker.write_text(json.dumps({**record, "resumed": [{**old_segment, "precision": "bf16"}]}))
    text = write_report(Study(spec, log=lambda s: None)).read_text()  # within one arm
    assert "(mlm: fp32, mlsm: bf16 + fp32)" in text
    marker.unlink()  # trained, but no run.json to read (a piece published before pieces kept it)
    text = write_report(Study(spec, log=lambda s: None)).read_text()
    assert "| mlsm | mlsm | not recorded |" in text


def _check_readouts(out: Path, text: str) -> None:
    """The readout stage read every readiness checkpoint of every arm; the MLSM arm in words
    only where the study trained its probe (100 %); the report plots and tabulates them; the
    BLiMP stage scored the unigram control on the same pairs."""
    rows = {m: [json.loads(x) for x in (out / "readouts" / f"{m}.jsonl").read_text().splitlines()]
            for m in ("mlm@50pct", "mlm@100pct", "mlsm@50pct", "mlsm@100pct")}
    for model, got in rows.items():
        kinds = {r["kind"] for r in got}
        assert kinds == {"probe", "pairs", "masked"}, model
        assert all(r["step"] in (4, 8) and r["train_flops"] > 0 for r in got), model
    assert {r.get("note") for r in rows["mlsm@50pct"] if r["kind"] != "probe"} == {"no probe"}
    masked = [r for r in rows["mlsm@100pct"] if r["kind"] == "masked"]
    assert {r["metric"] for r in masked} == {"loss", "top1", "pppl"}
    assert "## Readouts" in text and "| mlm@50% |" in text
    assert (out / "readouts_steps.png").is_file() and (out / "readouts_flops.png").is_file()
    blimp_set = next(iter(json.loads((out / "blimp" / "mlm@100pct.json").read_text())["sets"]
                          .values()))
    assert blimp_set["control_phenomena"].keys() == blimp_set["phenomena"].keys()
    assert blimp_set["tests"]["n_paired"] == 2 and "| unigram % |" in text


def test_slurm_executor_through_submitit_local(
    corpus_dir, tokenizer_dir, teacher_dir, tmp_path
) -> None:
    """The slurm path end to end with submitit's local executor: one job per arm, outcome
    recorded."""
    pytest.importorskip("submitit")
    out = tmp_path / "study"
    raw = _raw(corpus_dir, tokenizer_dir, teacher_dir, out,
               executor={"kind": "slurm", "slurm": {"cluster": "local", "timeout_min": 20}})
    raw["arms"] = {
        "mlm": raw["arms"]["mlm"],
        "bad": {"objective": {"name": "mlsm"}},
    }  # no dictionary: fails in its job
    spec = study_from_dict(raw)
    with pytest.raises(Incomplete, match="pretrain:bad"):
        run_study(spec, stages=["store", "pretrain"], log=lambda s: None)
    status = Study(spec).status()
    assert status["pretrain:mlm"]["state"] == "done"
    assert (out / "runs" / "mlm" / "checkpoints" / "step-0000008").is_dir()
    assert (
        status["pretrain:bad"]["state"] == "failed"
        and "objective.dictionary is not set" in status["pretrain:bad"]["error"]
    )
    assert any((out / "slurm").glob("*_log.out"))  # submitit's own job logs


def test_training_time_sums_every_resumed_window_once() -> None:
    """An arm killed and resumed twice: its training time is the sum of every logged window
    (tokens since the previous row / that row's rate), not the last segment's wall time."""
    from mlsm.study.cost_report import training_seconds

    rows = [{"step": 10, "tokens": 100, "tokens_per_s": 10.0},   # 10 s
            {"step": 20, "tokens": 200, "tokens_per_s": 20.0},   # 5 s, then killed, resumed at 20
            {"step": 30, "tokens": 300, "tokens_per_s": 50.0},   # 2 s
            {"step": 30, "loss": 1.0},                           # a row without a rate
            {"step": 40, "tokens": 400, "tokens_per_s": 25.0}]   # 4 s
    assert training_seconds(rows) == pytest.approx(21.0)
    assert training_seconds([]) == 0.0


def test_report_skips_a_torn_last_results_line_with_a_warning(tmp_path, capsys) -> None:
    """A fine-tuning writer killed mid-line leaves a torn last line; the resumed grid skips it
    (and redoes its cell), so the report skips it too, with a warning naming file and line."""
    from mlsm.cli import main
    from tests.test_bad_inputs_classes import _rows

    out = tmp_path / "study"
    study = _write(tmp_path, {"out": str(out), "arms": {"a": {"objective": {"name": "mlm"}}}})
    out.mkdir()
    (out / "results.jsonl").write_text(_rows('{"model": "a", "task": "rt'))
    row = {"stage": "store", "arm": None, "seconds": 3.0, "state": "done"}
    (out / "stages.jsonl").write_text(json.dumps(row) + '\n{"stage": "pretr')  # the same
    capsys.readouterr()
    assert main(["study", "report", str(study)]) == 0
    printed = capsys.readouterr().out
    assert f"warning: {out / 'results.jsonl'}: skipped line 7, torn" in printed, printed
    assert f"warning: {out / 'stages.jsonl'}: skipped line 2, torn" in printed, printed
    assert "Wilcoxon matrix" in (out / "report.md").read_text()  # the 12 whole rows compared


def test_study_out_may_hold_the_corpus_only_where_the_study_writes_nothing(tmp_path) -> None:
    """A corpus source at a path the study writes (OUT/results.jsonl, inside OUT/runs, ...) is
    refused before anything is written; one in a folder of its own inside OUT is not (the demo
    keeps its generated corpus in OUT/corpus)."""
    from mlsm.study.runner import check_study_inputs

    out = tmp_path / "study"
    (out / "runs" / "text").mkdir(parents=True)
    (out / "runs" / "text" / "a.txt").write_text("some text\n")
    spec = study_from_dict({"out": str(out), "corpus": {"sources": [str(out / "runs" / "text")]},
                            "arms": {"a": {"objective": {"name": "mlm"}}}})
    with pytest.raises(UserError, match=r"the study's output .*runs overlaps the corpus source"):
        run_study(spec, log=lambda s: None)
    assert sorted(p.name for p in out.iterdir()) == ["runs"]  # nothing written
    (out / "corpus").mkdir()
    (out / "corpus" / "a.txt").write_text("some text\n")
    check_study_inputs(study_from_dict({"out": str(out),
                                        "corpus": {"sources": [str(out / "corpus")]},
                                        "arms": {"a": {"objective": {"name": "mlm"}}}}))


def test_blimp_pairs_by_phenomenon_match_scipy(tmp_path) -> None:
    """BLiMP comparisons pair the two models' accuracies per phenomenon: SciPy's Wilcoxon on the
    same vectors (one-sided both ways and two-sided), the win counts and the mean difference; a
    phenomenon only one model scored is left out, and a model at a readiness not compared is
    ignored."""
    from mlsm.study.report import blimp_comparisons

    raw = {"out": str(tmp_path / "s"), "arms": {
        "mlm": {"objective": {"name": "mlm"}},
        "mlsm": {"objective": {"name": "mlsm"}, "dictionary": {"layer": 5, "k": 64}}}}
    study = Study(load_study(_write(tmp_path, raw)), log=lambda s: None)
    rng = np.random.default_rng(0)
    base = rng.uniform(0.5, 0.9, 12)
    diff = np.array([3, -1, 4, 1, -5, 9, 2, 6, -5, 3, 5, 8]) / 100  # no ties in |d|

    def row(arm: str, frac: float, acc: np.ndarray, extra: dict | None = None) -> dict:
        phenomena = {f"ph{i}": float(v) for i, v in enumerate(acc)} | (extra or {})
        return {"arm": arm, "readiness": frac, "sets": {"blimp": {"phenomena": phenomena}}}

    rows = [row("mlm", 1.0, base, {"only_mlm": 0.9}), row("mlsm", 1.0, base + diff),
            row("mlsm", 0.25, base - diff)]
    (pair,) = blimp_comparisons(study, rows)
    x, y = base + diff, base
    assert (pair["a"], pair["b"], pair["n_phenomena"]) == ("mlsm@100%", "mlm@100%", 12)
    assert (pair["wins_a"], pair["wins_b"]) == (9, 3)
    assert pair["mean_diff"] == pytest.approx(diff.mean())
    assert pair["p_two_sided"] == pytest.approx(scipy.stats.wilcoxon(x, y).pvalue)
    assert pair["p_a_better"] == pytest.approx(
        scipy.stats.wilcoxon(x, y, alternative="greater").pvalue)
    assert pair["p_b_better"] == pytest.approx(
        scipy.stats.wilcoxon(y, x, alternative="greater").pvalue)


def test_blimp_table_row_shows_a_dash_for_optional_fields_of_the_wrong_type() -> None:
    from mlsm.study.report import _blimp_line

    row = {"arm": "a", "readiness": 1.0, "overall": 0.625, "n_pairs": 8,
           "sets": {"blimp": {"phenomena": {"x": 0.625}, "p_vs_chance": "low", "tests": "?"}},
           "heldout": {"top1": "high", "loss": [1], "unigram_loss": 7.25},
           "probe": {"heldout_top1": {"a": 1}, "input": "logprobs"}}
    cells = [c.strip() for c in _blimp_line(row).strip("|").split("|")]
    assert cells[:5] == ["a@100%", "62.5", "8", "—", "—"]
    assert cells[9:12] == ["—", "7.250", "logprobs"] and cells[13] == "—"


def test_paper_probe_recipe_trains_fixed_steps_and_records_its_score(
    corpus_dir, tokenizer_dir, teacher_dir, tmp_path
) -> None:
    """probe.recipe paper: `probe.steps` steps through the training loop with readiness
    checkpoints, no plateau stop, then a probe.json the BLiMP stage reads."""
    from mlsm.artifacts.probe_record import read_probe_record
    from mlsm.evaluate.probe.probe import ProbeScorer, load_scorer

    _, blimp = _tiny_tasks(tmp_path)
    out = tmp_path / "study"
    raw = _raw(corpus_dir, tokenizer_dir, teacher_dir, out,
               blimp={"data": [str(blimp)], "readiness": [1.0]},
               probe={"recipe": "paper", "steps": 4, "heldout_batches": 1, "batch_size": 8})
    raw["arms"] = {"mlsm": raw["arms"]["mlsm"]}
    spec = load_study(_write(tmp_path, raw))
    run_study(spec, stages=["store", "dictionary", "pretrain", "probe"], log=lambda s: None)
    probe = out / "runs" / "mlsm" / "probe-100"
    info = read_probe_record(probe)
    assert (info["recipe"], info["steps"]) == ("paper", 4)
    # readiness checkpoints of the 4 probe steps (10/25 % round to step 1), the last one scored
    assert sorted(p.name for p in (probe / "checkpoints").iterdir()) == [
        "step-0000001", "step-0000002", "step-0000004"]
    assert Path(info["checkpoint"]) == probe / "checkpoints" / "step-0000004"
    assert isinstance(load_scorer(info["checkpoint"])[0], ProbeScorer)
    assert info["unigram_loss"] > 0 and info["n_heldout_targets"] > 0


SEEDED_TOP1 = {"mlm-s0": 0.20, "mlm_hi-s0": 0.23, "mlm-s1": 0.21, "mlm_hi-s1": 0.25}
"""Held-out top-1 of each run of the `seeded_raw` study, as the tests give it."""


def seeded_raw(corpus_dir: Path, tokenizer_dir: Path, teacher_dir: Path, out: Path) -> dict:
    """Two arms (lr 1e-3 and 3e-3) x two pre-training seeds, 2 steps each, and one pre-registered
    hypothesis on their held-out top-1."""
    raw = _raw(corpus_dir, tokenizer_dir, teacher_dir, out, seeds=[0, 1])
    raw["base"]["train"]["steps"] = 2
    raw["arms"] = {"mlm": {"objective": {"name": "mlm"}},
                   "mlm_hi": {"objective": {"name": "mlm"}, "overrides": {"optim": {"lr": 3e-3}}}}
    raw["hypotheses"] = [{"id": "H1", "statement": "higher lr helps", "a": "mlm_hi@100%",
                          "b": "mlm@100%", "kind": "masked", "task": "heldout",
                          "metric": "top1"}]
    return raw


def write_readout_rows(study_file: Path, values: dict[str, float]) -> None:
    """Held-out top-1 readout rows (`values`: run -> top-1) as the readout stage writes them: one
    file per model, each row stamped with the fingerprint of its inputs (the report leaves out
    rows of other inputs)."""
    from mlsm.study.reuse import readout_inputs
    from mlsm.study.sameness import fingerprint_of

    study = Study(load_study(study_file), log=lambda s: None)
    (study.root / "readouts").mkdir(exist_ok=True)
    for run, v in values.items():
        (study.root / "readouts" / f"{run}@100pct.jsonl").write_text(json.dumps(
            {"model": f"{run}@100%", "arm": run, "kind": "masked", "task": "heldout",
             "metric": "top1", "value": v, "control": 0.05,
             "fingerprint": fingerprint_of(readout_inputs(study, run, 1.0))}) + "\n")


def test_seeded_study_pairs_arms_by_seed_and_reports_registered_hypotheses(
    corpus_dir, tokenizer_dir, teacher_dir, tmp_path
) -> None:
    """Two arms x two pre-training seeds: runs ARM-s<seed>; the same seed gives every arm the same
    batches and initial weights (same first loss), another seed others; the hypotheses' hash is
    recorded before any row exists, the report tests them over seeds and flags a later change."""
    out = tmp_path / "study"
    raw = seeded_raw(corpus_dir, tokenizer_dir, teacher_dir, out)
    path = _write(tmp_path, raw)
    run_study(load_study(path), stages=["store", "pretrain"], log=lambda s: None)
    record = json.loads((out / "preregistration.json").read_text())
    assert record["results_existed"] is False and record["hypotheses"][0]["id"] == "H1"

    def first(run: str, key: str) -> object:
        return json.loads((out / "runs" / run / "metrics.jsonl").read_text().splitlines()[0])[key]

    for s in (0, 1):
        assert first(f"mlm-s{s}", "batch_digest") == first(f"mlm_hi-s{s}", "batch_digest")
        assert first(f"mlm-s{s}", "loss") == first(f"mlm_hi-s{s}", "loss")  # same init, batch
    assert first("mlm-s0", "batch_digest") != first("mlm-s1", "batch_digest")
    assert first("mlm-s0", "loss") != first("mlm-s1", "loss")
    write_readout_rows(path, SEEDED_TOP1)
    run_study(load_study(path), stages=["report"], log=lambda s: None)
    report = (out / "report.md").read_text()
    p = scipy.stats.ttest_rel([0.23, 0.25], [0.20, 0.21], alternative="greater").pvalue
    assert "## Pre-registered hypotheses" in report and "## Exploratory analyses" in report
    assert str(tmp_path) not in report  # no machine path: reports get published as they are
    assert "| H1 | mlm_hi@100% | mlm@100% | 2 | 0.2300, 0.2500 | 0.2000, 0.2100 |" in report
    assert f"| {p:.3g} | {p:.3g} |" in report and "WARNING" not in report
    summary = json.loads((out / "summary.json").read_text())
    assert summary["hypotheses"][0]["p"] == pytest.approx(p)
    # no latent arm here, so no headline pair: the across-seeds table needs one
    from mlsm.study.hypotheses import comparison_lines, seed_comparisons, study_rows

    got = seed_comparisons([("mlm_hi@100%", "mlm@100%")], study_rows(out), True)
    two = scipy.stats.ttest_rel([0.23, 0.25], [0.20, 0.21]).pvalue
    assert [(g["task"], g["n"]) for g in got] == [("heldout", 2)]
    assert got[0]["p"] == pytest.approx(two) and "| masked | heldout | top1 | 2 |" in \
        "\n".join(comparison_lines(got))
    raw["hypotheses"][0]["direction"] = "two-sided"  # changed once results exist
    run_study(load_study(_write(tmp_path, raw)), stages=["report"], log=lambda s: None)
    assert "PRE-REGISTRATION BROKEN" in (out / "report.md").read_text()
    # one paired seed left: no test, and summary.json stays strict JSON (null, never NaN)
    (out / "readouts" / "mlm_hi-s1@100pct.jsonl").unlink()
    run_study(load_study(path), stages=["report"], log=lambda s: None)

    def refuse(constant: str) -> None:
        raise AssertionError(f"summary.json holds {constant}")

    h1 = json.loads((out / "summary.json").read_text(), parse_constant=refuse)["hypotheses"][0]
    assert h1["n"] == 1 and h1["p"] is None and h1["ci95"] == [None, None]


def test_target_store_is_built_once_and_shared_by_seeds(
    corpus_dir, tokenizer_dir, teacher_dir, tmp_path
) -> None:
    """`dictionary.targets: true`: one target store per dictionary, built in the dictionary
    stage, read by every seed's run of the arm (objective.targets), which then trains."""
    out = tmp_path / "study"
    raw = _raw(corpus_dir, tokenizer_dir, teacher_dir, out, seeds=[0, 1])
    raw["base"]["train"]["steps"] = 2
    raw["arms"] = {"mlsm": {"objective": {"name": "mlsm"},
                            "dictionary": {"layer": 1, "k": 64, "lam": 0.05, "targets": True}}}
    spec = study_from_dict(raw)
    run_study(spec, stages=["store", "dictionary", "pretrain"], log=lambda s: None)
    stores = list((out / "targets").iterdir())
    assert len(stores) == 1 and (stores[0] / "meta.json").is_file()
    study = Study(spec, log=lambda s: None)
    for run in ("mlsm-s0", "mlsm-s1"):
        assert study.arm_config(run).objective.targets == str(stores[0])
        saved = yaml.safe_load((out / "runs" / run / "config.yaml").read_text())
        assert saved["objective"]["targets"] == str(stores[0])
        assert (out / "runs" / run / "checkpoints" / "step-0000002").is_dir()
    assert [r["stage"] for r in _stages(out)].count("targets") == 1
    with pytest.raises(UserError, match="dictionary.targets must be true or false"):
        study_from_dict({**raw, "arms": {"m": {"objective": {"name": "mlsm"},
                                               "dictionary": {"targets": "yes"}}}})


def test_a_target_build_begun_before_fingerprints_resumes_and_another_is_moved_aside(
    corpus_dir, tokenizer_dir, teacher_dir, tmp_path, monkeypatch
) -> None:
    """A study folder from an mlsm that kept no stage fingerprints, whose target store was
    interrupted half-way (build.json and progress.json, no meta.json): the newer mlsm resumes
    it when its build record names the current store and dictionary (the v2 replication's
    3-hour build was moved aside and begun again before this), and moves it to superseded/
    when it names another dictionary."""
    out = tmp_path / "study"
    raw = _raw(corpus_dir, tokenizer_dir, teacher_dir, out)
    raw["arms"] = {"mlsm": {"objective": {"name": "mlsm"},
                            "dictionary": {"layer": 1, "k": 64, "lam": 0.05, "targets": True}}}
    spec = study_from_dict(raw)
    run_study(spec, stages=["store", "dictionary"], log=lambda s: None)
    (folder,) = list((out / "targets").iterdir())
    whole = {f.name: f.read_bytes() for f in folder.iterdir() if f.suffix == ".bin"}
    meta = json.loads((folder / "meta.json").read_text())

    def interrupt(dictionary_hash: str) -> None:
        """Back to a build half done by an mlsm without stage fingerprints."""
        (folder / "meta.json").unlink(missing_ok=True)
        build = json.loads((folder / "build.json").read_text())
        (folder / "build.json").write_text(json.dumps({**build,
                                                       "dictionary_hash": dictionary_hash}))
        (folder / "progress.json").write_text(json.dumps({"done": meta["n_chunks"] // 2,
                                                          "truncated": 0}))
        status = json.loads((out / "status.json").read_text())
        (out / "status.json").write_text(json.dumps({
            k: {f: v for f, v in r.items() if f not in ("fingerprint", "inputs")}
            | ({"state": "started"} if k.startswith("targets") else {})
            for k, r in status.items()}))

    interrupt(meta["dictionary_hash"])
    lines: list[str] = []
    run_study(spec, stages=["dictionary"], log=lines.append)
    assert not (out / "superseded").exists(), lines
    assert json.loads((folder / "meta.json").read_text())["n_chunks"] == meta["n_chunks"]
    assert {f.name: f.read_bytes() for f in folder.iterdir() if f.suffix == ".bin"} == whole
    assert "fingerprint" in json.loads((out / "status.json").read_text())["targets:mlsm"]

    interrupt("0" * 16)  # begun from another dictionary: not resumed, kept aside
    run_study(spec, stages=["dictionary"], log=lambda s: None)
    (moved,) = (out / "superseded").glob("*/targets/*")
    assert json.loads((moved / "build.json").read_text())["dictionary_hash"] == "0" * 16
    assert {f.name: f.read_bytes() for f in folder.iterdir() if f.suffix == ".bin"} == whole

    monkeypatch.delitem(FORMS, "study-shared-unrecorded")  # struck: never adopted
    interrupt(meta["dictionary_hash"])
    run_study(spec, stages=["dictionary"], log=lambda s: None)
    assert len(list((out / "superseded").glob("*/targets/*"))) == 2


def test_study_rows_name_a_torn_blimp_result_in_one_line(tmp_path: Path) -> None:
    """The hypotheses' reader of a study folder meets a BLiMP result torn by a kill (or edited by
    hand) as one line naming the file and the fix, not a JSON traceback."""
    from mlsm.study.hypotheses import study_rows

    (tmp_path / "blimp").mkdir()
    (tmp_path / "blimp" / "mlm-s0@100pct.json").write_text('{"arm": "mlm-s0", "readi')
    with pytest.raises(UserError, match=r"mlm-s0@100pct\.json.*--stages blimp"):
        study_rows(tmp_path)


def test_a_failed_stage_whose_traceback_cannot_be_written_is_still_recorded(tmp_path: Path
                                                                             ) -> None:
    """A stage that fails with an internal error while errors.log cannot be written (a full disk;
    here a folder in its place) is still recorded as failed, and the console says where its
    traceback did not go; the write's OSError used to escape the stage runner."""
    spec = study_from_dict({"out": str(tmp_path / "s"), "corpus": {"sources": ["x.txt"]},
                            "arms": {"a": {"objective": {"name": "mlm"}}}})
    lines: list[str] = []
    study = Study(spec, log=lines.append)
    (study.root / "errors.log").mkdir(parents=True)

    def broken() -> None:
        raise RuntimeError("inside a library")

    assert study.stage("pretrain", broken, arm="a") is False
    assert study.status()["pretrain:a"]["state"] == "failed"
    assert any("not written to errors.log" in line for line in lines)


def test_evaluation_chains_per_point_score_what_the_driver_scores(
    corpus_dir, tokenizer_dir, teacher_dir, tmp_path
) -> None:
    """The same pre-trained arms evaluated twice: in this process, one stage after another
    (jobs = 1), and as chains of subprocesses, one per arm and readiness point (jobs = 2,
    eval_jobs = 2: the probes, then BLiMP through that point's probe). Every score is the same,
    readout control included, and the chains ran each point of each arm, and each probe head of
    a point, as subprocesses of their own."""
    import shutil

    _, blimp = _tiny_tasks(tmp_path)
    here, chained = tmp_path / "here", tmp_path / "chained"
    raw = _raw(
        corpus_dir, tokenizer_dir, teacher_dir, here,
        blimp={"data": [str(blimp)], "readiness": [0.5, 1.0]},
        probe={"max_steps": 10, "eval_every": 5, "select_steps": 5, "heldout_batches": 1,
               "batch_size": 8, "min_delta": 1e-4, "controls": ["vocab"]},
    )
    run_study(load_study(_write(tmp_path, raw)), stages=["store", "dictionary", "pretrain"],
              log=lambda s: None)
    shutil.copytree(here, chained)
    evaluation = ["probe", "blimp"]
    run_study(load_study(_write(tmp_path, raw)), stages=evaluation, log=lambda s: None)
    raw = {**raw, "out": str(chained),
           "executor": {"kind": "local", "jobs": 2, "eval_jobs": 2, "threads": 1}}
    run_study(load_study(_write(tmp_path, raw)), stages=evaluation, log=lambda s: None)
    for model in ("mlm@50pct", "mlm@100pct", "mlsm@50pct", "mlsm@100pct"):
        a, b = (json.loads((o / "blimp" / f"{model}.json").read_text()) for o in (here, chained))
        assert (a["sets"], a["heldout"], a["probe"], a["controls"]) == \
            (b["sets"], b["heldout"], b["probe"], b["controls"])
        assert set(a["controls"]) == {"vocab"}
    jobs = {(r["stage"], r["arm"]) for r in _stages(chained) if r["stage"].endswith("-job")}
    points = [f"{a}@{p}%" for a in ("mlm", "mlsm") for p in (50, 100)]
    heads = {"mlm": ["vocab"], "mlsm": ["latent", "vocab"]}
    assert jobs == {("blimp-job", m) for m in points} | {
        ("probe-job", f"{m}/{h}") for m in points for h in heads[m.partition("@")[0]]}
