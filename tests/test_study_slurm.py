"""The slurm executor through a real `sbatch`: where a Slurm controller answers (e.g. the one
scripts/slurm_single_node.sh starts), a tiny study runs as Slurm jobs and must give what the local
executor gives. Skipped, with one reason, where there is no Slurm."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from mlsm.study.runner import OUTPUTS, Study, run_study
from mlsm.study.spec import study_from_dict
from tests.test_study import _raw, _tiny_tasks

PARTITION = "debug"


def _slurm_skip_reason() -> str | None:
    if shutil.which("sbatch") is None:
        return "no sbatch on PATH (scripts/slurm_single_node.sh starts a one-machine Slurm)"
    try:
        up = subprocess.run(["sinfo", "-h", "-p", PARTITION, "-o", "%a %T"], capture_output=True,
                            text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"sinfo did not answer: {exc}"
    usable = ("idle", "mixed", "allocated", "completing")  # else the jobs would pend forever
    if up.returncode != 0 or not any(line.startswith("up ") and line.split()[1].rstrip("*~#")
                                     in usable for line in up.stdout.splitlines()):
        reason = up.stderr.strip().splitlines()[-1] if up.stderr.strip() else \
            (up.stdout.strip() or "no such partition")
        return f"no Slurm controller answers with a usable node in partition {PARTITION}: {reason}"
    return None


_SKIP = _slurm_skip_reason()
pytestmark = [pytest.mark.slurm, pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))]


def _spec(corpus_dir: Path, tokenizer_dir: Path, tmp_path: Path, name: str,
          executor: dict) -> dict:
    """Two MLM arms (different init seeds, the same batches), fine-tuned and scored on BLiMP."""
    tasks, blimp = _tiny_tasks(tmp_path / f"data_{name}")
    no_teacher = tmp_path  # MLM arms only: no dictionary, no teacher
    raw = _raw(corpus_dir, tokenizer_dir, no_teacher, tmp_path / name, executor=executor,
               finetune={"tasks": ["word_order"], "data_dir": str(tasks), "readiness": [1.0],
                         "seeds": 1, "lrs": [1e-3], "epochs": 1, "batch_size": 16, "max_len": 32},
               blimp={"data": [str(blimp)], "readiness": [1.0]})
    raw["base"]["train"]["steps"] = 4
    raw["readiness"] = [1.0]
    raw["arms"] = {"a": {"objective": {"name": "mlm"}},
                   "b": {"objective": {"name": "mlm"}, "overrides": {"train": {"seed": 1}}}}
    raw.pop("dictionary")
    return raw


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _scores(out: Path) -> dict:
    """What a study computed: fine-tuning metrics per cell and BLiMP / held-out scores per
    model (times and dates left out)."""
    cells = {(r["model"], r["task"], r["seed"]): {k: v for k, v in r.items()
                                                  if isinstance(v, float) and k != "seconds"}
             for r in _rows(out / "results.jsonl")}
    blimp = {p.name: {k: v for k, v in json.loads(p.read_text()).items()
                      if k in ("overall", "heldout", "sets")}
             for p in sorted((out / "blimp").glob("*.json"))}
    return {"finetune": cells, "blimp": blimp}


def test_study_on_real_slurm_matches_the_local_executor(
        corpus_dir, tokenizer_dir, tmp_path, monkeypatch) -> None:
    """Two arms pre-trained, fine-tuned and scored as Slurm jobs give the checkpoints and scores
    of the local executor on the same batches; every stage ran in a Slurm job of its own (its log
    names the job) with the driver's mlsm and one thread per allotted core; a re-run submits no
    pre-training or BLiMP job and re-runs nothing.

    SBATCH_EXPORT=NONE (the jobs inherit no environment, as some sites configure) makes the
    jobs depend on what the executor propagates itself: without PYTHONPATH they would import
    another mlsm (or none)."""
    pytest.importorskip("submitit")
    from safetensors.torch import load_file

    from mlsm.provenance import git_revision

    local_out, slurm_out = tmp_path / "local", tmp_path / "slurm"
    local = study_from_dict(_spec(corpus_dir, tokenizer_dir, tmp_path, "local",
                                  {"kind": "local", "threads": 1}))
    run_study(local, log=lambda s: None)
    monkeypatch.setenv("SBATCH_EXPORT", "NONE")
    executor = {"kind": "slurm", "slurm": {"partition": PARTITION, "cpus_per_task": 1,
                                           "timeout_min": 5}}
    spec = study_from_dict(_spec(corpus_dir, tokenizer_dir, tmp_path, "slurm", executor))
    run_study(spec, stages=["store", "pretrain"], log=lambda s: None)
    for arm in "ab":  # pre-training first: a job that ran the wrong mlsm fails fast here
        run = json.loads((slurm_out / "runs" / arm / "run.json").read_text())
        assert run["git_revision"] == git_revision()  # the driver's mlsm ran in the job
        assert run["threads"] == 1  # SLURM_CPUS_PER_TASK, not one thread per core of the node
        final = "checkpoints/step-0000004/model.safetensors"
        a = load_file(local_out / "runs" / arm / final)
        b = load_file(slurm_out / "runs" / arm / final)
        assert a.keys() == b.keys() and all(torch_equal(a[k], b[k]) for k in a), arm
        assert _rows(local_out / "runs" / arm / "metrics.jsonl")[-1]["loss"] == \
            _rows(slurm_out / "runs" / arm / "metrics.jsonl")[-1]["loss"]

    lines: list[str] = []
    assert run_study(spec, log=lines.append) == slurm_out / "report.md", "\n".join(lines)
    status = Study(spec).status()
    assert all(v["state"] == "done" for v in status.values()), status
    jobs = {k: v["slurm_job"] for k, v in status.items() if "slurm_job" in v}
    assert set(jobs) == {f"{s}:{a}" for s in ("pretrain", "finetune-job", "blimp-job")
                         for a in "ab"}
    assert len(set(jobs.values())) == len(jobs)  # one job per stage and arm
    submitted = sorted(p.name for p in (slurm_out / "slurm").glob("*_submission.sh"))
    assert submitted == sorted(f"{j}_submission.sh" for j in jobs.values())  # and no others
    for key, job in jobs.items():  # submitit's log of the job, written inside it by Slurm's task
        log = (slurm_out / "slurm" / f"{job}_0_log.out").read_text()
        assert f"JobEnvironment(job_id={job}," in log and "completed successfully" in log, key
    # each job's own time, not how long the driver waited for it after awaiting the other arm's
    times = {(r["stage"], r["arm"]): r["seconds"] for r in _rows(slurm_out / "stages.jsonl")}
    assert all(times[tuple(k.split(":"))] > 0 for k in jobs), times
    assert _scores(slurm_out) == _scores(local_out)
    for out in (local_out, slurm_out):  # all in the list that keeps a corpus source out of them
        assert {p.name for p in out.iterdir()} <= set(OUTPUTS), sorted(os.listdir(out))
    assert len(_scores(slurm_out)["finetune"]) == 2 and len(_scores(slurm_out)["blimp"]) == 2

    before = len(_rows(slurm_out / "stages.jsonl"))
    run_study(spec, log=lambda s: None)
    again = Study(spec).status()
    for key in ("pretrain:a", "pretrain:b", "blimp-job:a", "blimp-job:b"):
        assert again[key]["slurm_job"] == jobs[key], key  # nothing was submitted for these
    new = _rows(slurm_out / "stages.jsonl")[before:]
    assert [r["stage"] for r in new] == ["report"], new  # the finetune jobs found all done


def torch_equal(x, y) -> bool:  # noqa: ANN001 - tensors
    return bool((x == y).all())


def test_a_job_that_leaves_the_queue_without_a_result_is_a_failure(tmp_path) -> None:
    """A cancelled job writes no result; where Slurm keeps no accounting (`sacct` fails) submitit
    alone would wait for it forever. await_job must fail, naming the job and its state."""
    pytest.importorskip("submitit")
    import threading
    import time

    from mlsm.study.slurm import await_job, make_executor

    spec = study_from_dict({"name": "cancel", "out": str(tmp_path / "s"),
                            "arms": {"a": {"objective": {"name": "mlm"}}},
                            "executor": {"kind": "slurm", "slurm": {"partition": PARTITION,
                                                                    "timeout_min": 5}}})
    job = make_executor(Study(spec, log=lambda s: None)).submit(time.sleep, 600)
    subprocess.run(["scancel", str(job.job_id)], check=True)
    outcome: list[BaseException] = []

    def wait() -> None:
        try:
            await_job(job, poll_s=1, grace_s=2)
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            outcome.append(exc)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(timeout=120)
    assert not waiter.is_alive(), "await_job still waits for a cancelled job"
    assert outcome and f"slurm job {job.job_id}" in str(outcome[0]) \
        and "CANCELLED" in str(outcome[0]), outcome
