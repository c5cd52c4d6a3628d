"""Study executors and bookkeeping under concurrency: local jobs > 1, concurrent status writers."""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import threading
import time
from pathlib import Path

from mlsm.study.runner import Study, run_study
from mlsm.study.spec import study_from_dict
from tests.conftest import TINY_MODEL


def _two_arm_spec(corpus_dir: Path, tokenizer_dir: Path, out: Path) -> dict:
    return {
        "name": "jobs", "out": str(out),
        "corpus": {"sources": [str(corpus_dir)], "tokenizer": str(tokenizer_dir)},
        "base": {"data": {"max_len": 32}, "model": {"arch": "bert", "overrides": dict(TINY_MODEL)},
                 "optim": {"lr": 1e-3}, "train": {"steps": 4, "batch_size": 4, "log_every": 1,
                                                  "device": "cpu"}},
        "readiness": [1.0],
        "arms": {"a": {"objective": {"name": "mlm"}},
                 "b": {"objective": {"name": "mlm"}, "overrides": {"train": {"seed": 1}}}},
        "executor": {"kind": "local", "jobs": 2, "threads": 1},
    }


def test_local_executor_with_two_jobs_runs_both_arms_with_their_thread_budget(
        corpus_dir, tokenizer_dir, tmp_path) -> None:
    """jobs = 2: each arm is a `mlsm pretrain` subprocess; both finish, each ran with
    executor.threads torch threads (recorded by the subprocess itself in run.json, not torch's
    default of one per core), and status / stages.jsonl hold a record of each."""
    out = tmp_path / "study"
    spec = study_from_dict(_two_arm_spec(corpus_dir, tokenizer_dir, out))
    run_study(spec, stages=["store", "pretrain"], log=lambda s: None)
    status = Study(spec).status()
    for arm in ("a", "b"):
        assert status[f"pretrain:{arm}"]["state"] == "done", status
        assert (out / "runs" / arm / "checkpoints" / "step-0000004").is_dir()
        assert json.loads((out / "runs" / arm / "run.json").read_text())["threads"] == 1
        assert (out / "logs" / f"pretrain-{arm}.log").is_file()
    rows = [json.loads(x) for x in (out / "stages.jsonl").read_text().splitlines()]
    assert sorted(r["arm"] for r in rows if r["stage"] == "pretrain") == ["a", "b"]
    assert all(r["state"] == "done" for r in rows)
    # the two seeds gave two different models: each subprocess ran its own arm's config
    losses = [json.loads((out / "runs" / a / "metrics.jsonl").read_text().splitlines()[0])["loss"]
              for a in ("a", "b")]
    assert losses[0] != losses[1]


def _writer(out: str, who: str, n: int) -> None:
    spec = study_from_dict({"name": "w", "out": out, "arms": {"m": {"objective": {"name": "mlm"}}}})
    study = Study(spec, log=lambda s: None)
    for i in range(n):
        study.set_status(f"{who}:{i}", {"state": "done", "i": i})


def test_concurrent_status_writers_lose_no_record(tmp_path) -> None:
    """Slurm evaluation jobs (processes) and local jobs (threads) record their outcomes in the
    same status.json at the same time; every record must survive (a locked read-modify-write)."""
    out, n = str(tmp_path / "study"), 25
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(out, f"proc{k}", n)) for k in range(3)]
    threads = [threading.Thread(target=_writer, args=(out, f"thread{k}", n)) for k in range(3)]
    for w in procs + threads:
        w.start()
    for w in procs + threads:
        w.join(timeout=300)
    assert all(p.exitcode == 0 for p in procs)
    status = json.loads((Path(out) / "status.json").read_text())
    expected = {f"{who}{k}:{i}" for who in ("proc", "thread") for k in range(3) for i in range(n)}
    assert set(status) == expected, f"{len(expected - set(status))} records lost"


def _burn(seconds: float) -> list[str]:
    """A subprocess that spends `seconds` of CPU time (plus Python's start-up)."""
    loop = f"t = time.process_time()\nwhile time.process_time() - t < {seconds}: pass"
    return [sys.executable, "-c", f"import time\n{loop}"]


def test_each_stage_is_charged_its_own_cpu_seconds(tmp_path) -> None:
    """stages.jsonl records CPU seconds per stage: an in-process stage its own work, and two
    stages running subprocesses at once (local jobs > 1) each their own child's, not also the
    other one's (RUSAGE_CHILDREN grows by every child reaped meanwhile, whichever stage ran it)."""
    from mlsm.study.executors import _call_measured

    spec = study_from_dict({"name": "cpu", "out": str(tmp_path / "study"),
                            "arms": {"m": {"objective": {"name": "mlm"}}}})
    study = Study(spec, log=lambda s: None)
    big_done = threading.Event()

    def child(seconds: float) -> None:
        with (tmp_path / "child.log").open("a") as fh:
            code, cpu = _call_measured(_burn(seconds), fh, dict(os.environ))
        assert code == 0
        study.add_child_cpu(cpu)

    def small_after_big() -> None:  # starts before the big child ends, ends after it was reaped
        assert big_done.wait(timeout=300)
        child(0.02)

    def big() -> None:
        child(0.5)
        big_done.set()

    def in_process() -> None:
        t = time.process_time()
        while time.process_time() - t < 0.2:
            pass

    waiter = threading.Thread(target=study.stage, args=("small", small_after_big))
    waiter.start()
    study.stage("big", big)
    waiter.join(timeout=300)
    study.stage("here", in_process)
    cpu = {r["stage"]: r["cpu_seconds"]
           for r in map(json.loads, (study.root / "stages.jsonl").read_text().splitlines())}
    assert 0.5 <= cpu["big"] < 0.5 + 0.4, cpu
    assert 0.02 <= cpu["small"] < 0.02 + 0.4, cpu  # with the big child's 0.5 s it would be > 0.5
    assert 0.2 <= cpu["here"] < 0.2 + 0.4, cpu
