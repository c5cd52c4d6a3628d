"""Hostile inputs of issue #52's classes on cases the other tests do not try (a red-team re-test):
each case failed on the code before its fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_stats import results  # noqa: F401 (a fixture of these tests too)
from tests.test_study_reuse import _ran_since, _raw, _rows, _run


def test_a_study_redoes_blimp_when_its_pairs_changed_in_place(
    corpus_dir, tokenizer_dir, tmp_path
) -> None:
    """The BLiMP folder keeps its path and file names, one phenomenon's pairs are replaced: the
    stage is redone (the old file reused the old pairs' score, exit 0)."""
    raw = _raw(corpus_dir, tokenizer_dir, tmp_path, readout=None)
    out = Path(raw["out"])
    _run(raw)
    first = json.loads((out / "blimp" / "mlm@100pct.json").read_text())
    assert str(tmp_path) not in json.dumps(first["data"])  # rows travel: no machine's path
    pairs = sorted(Path(raw["blimp"]["data"][0]).glob("*.jsonl"))[0]
    rows = [json.loads(x) for x in pairs.read_text().splitlines()]
    pairs.write_text("".join(json.dumps({**r, "sentence_good": r["sentence_bad"],
                                         "sentence_bad": r["sentence_good"]}) + "\n"
                             for r in rows))  # the same file name, the pairs swapped
    before = len(_rows(out))
    _run(raw)
    assert _ran_since(out, before) == ["blimp"]
    again = json.loads((out / "blimp" / "mlm@100pct.json").read_text())
    assert again["overall"] != first["overall"]


def test_a_study_redoes_finetuning_when_a_task_file_changed_in_place(
    corpus_dir, tokenizer_dir, tmp_path
) -> None:
    """The task folder keeps its path and file names, its labels are flipped: the fine-tuning
    stage is redone, its old rows superseded (the stage was reused whole, exit 0). A record made
    before the data were kept is adopted, not redone: the stage fingerprints are unchanged."""
    from tests.test_study_reuse import _status

    raw = _raw(corpus_dir, tokenizer_dir, tmp_path, readout=None, blimp={})
    tasks = Path(raw["_tasks"])
    raw["finetune"] = {"tasks": ["word_order"], "data_dir": str(tasks), "readiness": [1.0],
                       "seeds": 1, "lrs": [1e-3], "epochs": 1, "batch_size": 16, "max_len": 32}
    out = Path(raw["out"])
    _run(raw)
    status = _status(out)
    assert status["finetune:mlm"]["inputs"]["data"]["word_order"]
    legacy = {**status, "finetune:mlm": {**status["finetune:mlm"], "inputs": {
        k: v for k, v in status["finetune:mlm"]["inputs"].items() if k != "data"}}}
    (out / "status.json").write_text(json.dumps(legacy))  # as recorded before data were kept
    before = len(_rows(out))
    _run(raw)
    assert _ran_since(out, before) == []  # the same fingerprint: adopted, data recorded now
    assert _status(out)["finetune:mlm"]["inputs"] == status["finetune:mlm"]["inputs"]
    train = tasks / "WordOrder" / "train.tsv"
    lines = train.read_text().splitlines()
    train.write_text("\n".join([lines[0], *(s.rsplit("\t", 1)[0] + "\t" + str(
        1 - int(s.rsplit("\t", 1)[1])) for s in lines[1:])]) + "\n")
    before = len(_rows(out))
    _run(raw)
    assert _ran_since(out, before) == ["finetune"]
    assert (out / "superseded" / "results.jsonl").is_file()


def test_trainer_resume_refuses_another_objective_or_masking_than_the_checkpoints(
        store_dir, teacher_dir, dictionary_path, tmp_path) -> None:
    """`mlsm pretrain --resume` refuses a config that changes the weights (`check_same_run`);
    `train(resume_from_checkpoint=)` trained on with another λ or mask rate than the
    checkpoint's, a mix of two objectives in one run."""
    import dataclasses

    from mlsm.errors import UserError
    from tests.test_hf_trainer import OBJECTIVES, _cfg, _trainer

    objective = OBJECTIVES["mlsm"](dictionary_path, teacher_dir)
    cfg = _cfg(store_dir, tmp_path / "unused", objective)
    trainer, _ = _trainer(cfg, tmp_path / "hf", steps=2, save_strategy="steps", save_steps=1)
    trainer.train()
    checkpoint = str(tmp_path / "hf" / "checkpoint-1")
    other = _cfg(store_dir, tmp_path / "unused", {**objective, "lam": 0.2})
    again, _ = _trainer(other, tmp_path / "again", steps=2)
    with pytest.raises(UserError, match=r"objective\.lam") as info:
        again.train(resume_from_checkpoint=checkpoint)
    assert "\n" not in str(info.value)
    masked = _cfg(store_dir, tmp_path / "unused", objective)
    masked.data = dataclasses.replace(masked.data, mask_rate=0.4)
    again, _ = _trainer(masked, tmp_path / "again2", steps=2)
    with pytest.raises(UserError, match=r"data\.mask_rate"):
        again.train(resume_from_checkpoint=checkpoint)
    same, _ = _trainer(cfg, tmp_path / "same", steps=2)  # its own settings resume
    same.train(resume_from_checkpoint=checkpoint)


def _files(folder: Path) -> dict[str, bytes]:
    """Every entry of a report folder, hidden ones too, by name and bytes."""
    return {p.name: p.read_bytes() if p.is_file() else b"<folder>" for p in folder.iterdir()}


def _killed_after(calls: int, real):  # noqa: ANN001, ANN202
    """`real`, except that call number `calls` + 1 stops the process as a kill would."""
    seen = []

    def write(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.append(1)
        if len(seen) > calls:
            raise KeyboardInterrupt
        return real(*args, **kwargs)
    return write


def test_a_blimp_report_killed_between_its_files_keeps_the_earlier_pair_whole(
        blimp_dir, tok, tmp_path, monkeypatch) -> None:
    """blimp.md was written, then blimp.json: a kill between left the new table beside the old
    JSON. The new pair lands as one unit; a rerun repairs."""

    from mlsm.evaluate.zeroshot import blimp
    from tests.helpers import UnigramScorer

    out = tmp_path / "out"
    blimp.write_blimp_report(blimp.evaluate_blimp(UnigramScorer(), tok, blimp_dir), out)
    before = _files(out)
    fewer = blimp.evaluate_blimp(UnigramScorer(), tok, blimp_dir, limit_per_phenomenon=1)
    monkeypatch.setattr(blimp, "atomic_write_text", _killed_after(1, blimp.atomic_write_text))
    with pytest.raises(KeyboardInterrupt):
        blimp.write_blimp_report(fewer, out)
    assert {k: v for k, v in _files(out).items() if not k.startswith(".")} == before
    monkeypatch.undo()
    paths = blimp.write_blimp_report(fewer, out)
    assert json.loads(paths["json"].read_text()) == fewer
    assert sorted(_files(out)) == ["blimp.json", "blimp.md"]  # no staging left behind


def test_a_report_killed_while_drawing_keeps_the_earlier_set_and_a_rerun_drops_old_figures(
        results, tmp_path, monkeypatch) -> None:  # noqa: F811 (test_stats' fixture)
    """`mlsm report` wrote its tables, then each figure, then report.md: a kill while drawing
    left new tables beside the old figures and report.md, and a rerun on fewer tasks kept the
    figure of a task no longer compared."""

    from mlsm.evaluate.compare import report
    first = results
    out = tmp_path / "report"
    report.make_report(first, out)
    before = _files(out)
    assert "paired_mrpc.png" in before
    second = tmp_path / "sst2.jsonl"  # the rows of one task (the fixture's torn line left out)
    second.write_text("".join(x + "\n" for x in first.read_text().splitlines()
                              if x.endswith("}") and json.loads(x)["task"] == "sst2"))
    monkeypatch.setattr(report, "plot_wilcoxon", _killed_after(0, report.plot_wilcoxon))
    with pytest.raises(KeyboardInterrupt):
        report.make_report(second, out)
    assert {k: v for k, v in _files(out).items() if not k.startswith(".")} == before
    monkeypatch.undo()
    report.make_report(second, out)
    names = sorted(_files(out))
    assert "paired_mrpc.png" not in names and "paired_sst2.png" in names
    assert not [n for n in names if n.startswith(".")]


@pytest.mark.parametrize("forged", ["NaN", "Infinity", "-1e12", "0", "1e300", "true", '"9e9"'])
def test_a_damaged_cpu_peak_cache_is_measured_again(forged, tmp_path, monkeypatch) -> None:
    """~/.cache/mlsm/cpu_peaks.json holds the measured GEMM peak behind every CPU run's MFU: a
    value of NaN, inf, 0, a negative or absurd rate was used as the peak (MFU NaN, negative or
    zero in metrics.jsonl, exit 0), and `measure=True` kept the larger, forged one for good."""
    from mlsm.train import throughput

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(throughput, "_PEAKS", {})
    monkeypatch.setattr(throughput, "matmul_rate", lambda dtype: 5e10)  # the CPU's rate
    cache = tmp_path / "mlsm" / "cpu_peaks.json"
    cache.parent.mkdir(parents=True)
    cache.write_text(f'{{"{throughput.peak_key("fp32")}": {forged}}}')
    assert throughput.cpu_peak("fp32") == 5e10
    assert json.loads(cache.read_text())[throughput.peak_key("fp32")] == 5e10


def test_a_study_report_killed_in_the_study_folder_keeps_the_earlier_report_whole(
        corpus_dir, tokenizer_dir, tmp_path, monkeypatch) -> None:
    """`mlsm study report` rewrote its figures, summary.json and report.md in the study folder
    one by one: a kill between left a summary of now beside the report of before."""
    from mlsm.study import report
    from mlsm.study.folder import REPORT_OUTPUTS
    from mlsm.study.runner import Study
    from tests.test_study_reuse import QUIET, _spec

    raw = _raw(corpus_dir, tokenizer_dir, tmp_path, readout=None)
    out = Path(raw["out"])
    _run(raw)
    study = Study(_spec(raw), **QUIET)
    report.write_report(study)
    mine = lambda: {k: v for k, v in _files(out).items() if k in REPORT_OUTPUTS}  # noqa: E731
    before = mine()
    assert {"report.md", "summary.json"} <= set(before)
    study.set_status("note", {"state": "done"})  # the next summary differs
    monkeypatch.setattr(report, "atomic_write_text", _killed_after(1, report.atomic_write_text))
    with pytest.raises(KeyboardInterrupt):
        report.write_report(study)
    assert mine() == before
    monkeypatch.undo()
    report.write_report(study)
    assert '"note"' in (out / "summary.json").read_text()
    assert not [p for p in out.iterdir() if p.name.startswith(".mlsm-staging")]


def test_trainer_resume_refuses_a_checkpoint_of_mlsm_pretrain(store_dir, mlm_run,
                                                               tmp_path) -> None:
    """A checkpoint of `mlsm pretrain` holds no Trainer state (optimizer, schedule): the
    Trainer names the verb that resumes it, in one line (the other way round, `pretrain
    --resume` already refuses a Trainer's folder as not an mlsm run)."""
    import shutil

    from mlsm.errors import UserError
    from tests.test_hf_trainer import _cfg, _trainer

    run = shutil.copytree(mlm_run, tmp_path / "run")
    checkpoint = sorted((run / "checkpoints").iterdir())[-1]
    trainer, _ = _trainer(_cfg(store_dir, tmp_path / "unused", {"name": "mlm"}), tmp_path / "hf")
    with pytest.raises(UserError, match="mlsm pretrain --resume") as info:
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert "\n" not in str(info.value)


def test_blimp_through_a_probe_refuses_a_checkpoint_replaced_since_the_probe_was_fitted(
        mlsm_run, tmp_path) -> None:
    """`mlsm probe RUN` copies the probed backbone into its own checkpoint; a checkpoint replaced
    in place afterwards (re-trained, or another run's copied over it) was scored through the
    old copy, as if it were the new one (exit 0). The probe records what it probed; the scorer
    compares."""
    import shutil

    from mlsm.errors import UserError
    from mlsm.evaluate.probe.probe import load_scorer, run_probe
    from tests.helpers import _perturb, last_checkpoint

    run = Path(shutil.copytree(mlsm_run, tmp_path / "run"))
    run_probe(last_checkpoint(run))
    load_scorer(run)  # as fitted: scored through its probe
    _perturb(last_checkpoint(run))  # the checkpoint replaced in place
    with pytest.raises(UserError, match="fit its probe again: mlsm probe") as info:
        load_scorer(run)
    assert "\n" not in str(info.value)
    run_probe(last_checkpoint(run))  # the fix it prints
    load_scorer(run)


def test_a_full_disk_while_writing_a_report_names_the_report_file(blimp_dir, tok, tmp_path,
                                                                   monkeypatch) -> None:
    """A report folder's files are written in a hidden staging folder first: a full disk there
    names the file the user asked for (OUT/blimp.json), not the staging folder that is removed
    as the error is raised; the earlier report stays."""
    import errno

    from mlsm.cli.args import path_fix
    from mlsm.evaluate.zeroshot import blimp
    from tests.helpers import UnigramScorer

    out = tmp_path / "out"
    result = blimp.evaluate_blimp(UnigramScorer(), tok, blimp_dir)
    blimp.write_blimp_report(result, out)
    before = _files(out)
    real = Path.write_text

    def full(self, text, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if self.name.startswith(".blimp.json"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(OSError) as info:
        blimp.write_blimp_report(result, out)
    assert info.value.filename == str(out / "blimp.json")
    assert "free" in path_fix(info.value)  # the CLI's one line names the fix by errno
    monkeypatch.undo()
    assert _files(out) == before


def test_a_disk_filling_midway_through_a_cells_rows_leaves_none_of_them(tmp_path,
                                                                          monkeypatch) -> None:
    """A nearly full disk takes part of an append and says so only in the count: the first rows
    of a fine-tuning cell were kept (read back as a whole cell, a mean over fewer seeds or
    metrics), the rest lost, exit 0. Now the append is all or none, the error names the file and
    appending again (the rerun) repairs."""
    import errno
    import os

    from mlsm.artifacts import jsonl
    from mlsm.artifacts.results_file import append_results, read_results

    def row(seed: int, metric: str) -> dict:
        return {"model": "m", "task": "sst2", "seed": seed, "metric": metric, "value": 0.5,
                "lr": 1e-4, "n_train": 8, "epochs": 1, "batch_size": 8, "max_len": 16}

    path = tmp_path / "results.jsonl"
    append_results(path, [row(0, "accuracy")])
    before = path.read_bytes()
    cell = [row(1, m) for m in ("accuracy", "f1", "mcc", "loss")]
    real, taken = os.write, []

    def nearly_full(fd: int, data) -> int:  # noqa: ANN001
        if os.path.realpath(f"/proc/self/fd/{fd}") != str(path.resolve()):
            return real(fd, data)
        if taken:
            raise OSError(errno.ENOSPC, "No space left on device")
        taken.append(real(fd, bytes(data[: len(data) // 2])))  # what fitted
        return taken[0]

    monkeypatch.setattr(jsonl.os, "write", nearly_full)
    with pytest.raises(OSError) as info:
        append_results(path, cell)
    monkeypatch.undo()
    assert info.value.filename == str(path)
    assert path.read_bytes() == before  # none of the cell's rows: its cell is redone
    append_results(path, cell)
    assert [r["metric"] for r in read_results(path)] == ["accuracy", "accuracy", "f1", "mcc",
                                                         "loss"]


def test_a_probe_fit_killed_over_an_earlier_one_leaves_no_record_of_other_weights(
    mlsm_ckpt, tmp_path, monkeypatch
) -> None:
    """A probe run fitted again (another lr) saves its step-N over the earlier fit's own, then
    writes probe.json: a kill between them left the earlier record (its held-out loss, its
    better-than-unigram verdict) naming the new weights. Now the record is dropped first and
    written last; a rerun fits again and its record names what it measured."""
    from mlsm.artifacts.probe_record import has_probe_record, read_probe_record
    from mlsm.evaluate.probe import probe_fit

    out = tmp_path / "probe"
    fit = {"inputs": ("logprobs",), "max_steps": 40, "eval_every": 20, "select_steps": 40,
           "patience": 5, "heldout_batches": 2, "batch_size": 8, "min_delta": 0.0}
    first = probe_fit.train_probe_to_plateau(mlsm_ckpt, out, lr=0.2, **fit)
    weights = Path(first["checkpoint"]) / "heads.safetensors"
    before = weights.read_bytes()
    monkeypatch.setattr(probe_fit, "write_probe_record",
                        _killed_after(0, probe_fit.write_probe_record))
    with pytest.raises(KeyboardInterrupt):
        probe_fit.train_probe_to_plateau(mlsm_ckpt, out, lr=1.0, **fit)
    monkeypatch.undo()
    assert weights.read_bytes() != before  # the new fit's step-N is where the old one was
    assert not has_probe_record(out)  # so no record may describe it
    again = probe_fit.train_probe_to_plateau(mlsm_ckpt, out, lr=1.0, **fit)
    assert read_probe_record(out)["heldout_loss"] == again["heldout_loss"] != first["heldout_loss"]


def test_readout_figures_killed_between_them_stay_one_set(tmp_path, monkeypatch) -> None:
    """`mlsm readout` redraws readouts_steps.png and readouts_flops.png from every row: a kill
    after the first left it drawn from the new rows beside the second drawn from the old. Now
    both land together (or neither), and a rerun redraws both."""
    from mlsm.evaluate import readout_plots
    from mlsm.evaluate.readouts import plot_rows, write_rows

    def row(step: int, value: float) -> dict:
        return {"kind": "masked", "task": "heldout", "metric": "loss", "value": value,
                "step": step, "train_flops": step * 1e9, "model": "run@step-" + str(step),
                "checkpoint": f"run/checkpoints/step-{step}"}

    path = tmp_path / "readouts.jsonl"
    write_rows([row(10, 3.0), row(20, 2.5)], path)
    plot_rows(path)
    figures = {p.name: p.read_bytes() for p in tmp_path.glob("*.png")}
    assert sorted(figures) == ["readouts_flops.png", "readouts_steps.png"]
    write_rows([row(30, 1.0)], path)
    monkeypatch.setattr(readout_plots, "atomic_write",
                        _killed_after(1, readout_plots.atomic_write))
    with pytest.raises(KeyboardInterrupt):
        plot_rows(path)
    monkeypatch.undo()
    assert _files(tmp_path) == {**figures, "readouts.jsonl": path.read_bytes()}
    plot_rows(path)
    assert all((tmp_path / n).read_bytes() != figures[n] for n in figures)


def test_export_ships_the_probe_its_record_names_after_a_fit_killed_before_pruning(
    mlsm_run, tmp_path, monkeypatch
) -> None:
    """A probe fitted again to an earlier step is killed after writing probe.json, before the
    earlier fit's later step-N is pruned: scoring resolves the probe run to the checkpoint the
    record names, `mlsm export` shipped the newest folder (the earlier fit's probe) instead."""
    import shutil

    from mlsm.artifacts.probe_record import read_probe_record
    from mlsm.evaluate.probe import probe_fit
    from mlsm.integrations.export import export_checkpoint

    run = tmp_path / "run"
    shutil.copytree(mlsm_run, run)
    ckpt = sorted((run / "checkpoints").iterdir())[-1]
    probes = ckpt.parent.parent / f"probe-{ckpt.name}"
    fit = {"inputs": ("logprobs",), "eval_every": 20, "patience": 5, "heldout_batches": 2,
           "batch_size": 8, "min_delta": 0.0, "lr": 0.2}
    probe_fit.train_probe_to_plateau(ckpt, probes, max_steps=40, select_steps=40, **fit)
    monkeypatch.setattr(probe_fit, "_drop_other_checkpoints",
                        _killed_after(0, probe_fit._drop_other_checkpoints))
    with pytest.raises(KeyboardInterrupt):
        probe_fit.train_probe_to_plateau(ckpt, probes, max_steps=20, select_steps=20, **fit)
    monkeypatch.undo()
    named = Path(read_probe_record(probes)["checkpoint"])
    newest = probes / "checkpoints" / "step-0000040"  # the earlier fit's, not yet pruned
    assert named.name < newest.name and newest.is_dir()
    out = export_checkpoint(ckpt, tmp_path / "export")
    assert (out / "heads.safetensors").read_bytes() == (named / "heads.safetensors").read_bytes()
