"""Study executors and bookkeeping under concurrency: local jobs > 1, concurrent status writers."""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from mlsm.errors import Incomplete
from mlsm.study.runner import OUTPUTS, Study, run_study
from mlsm.study.spec import study_from_dict
from tests.helpers import TINY_MODEL


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


@pytest.fixture(scope="module")
def two_jobs(corpus_dir, tokenizer_dir, tmp_path_factory) -> tuple[dict, Path]:
    """A two-arm study with jobs = 2, pre-trained (shared by the tests below: ~30 s)."""
    out = tmp_path_factory.mktemp("jobs") / "study"
    raw = _two_arm_spec(corpus_dir, tokenizer_dir, out)
    run_study(study_from_dict(raw), stages=["store", "pretrain"], log=lambda s: None)
    return raw, out


def test_local_executor_with_two_jobs_runs_both_arms_with_their_thread_budget(two_jobs) -> None:
    """jobs = 2: each arm is a `mlsm pretrain` subprocess; both finish, each ran with
    executor.threads torch threads (recorded by the subprocess itself in run.json, not torch's
    default of one per core), and status / stages.jsonl hold a record of each."""
    raw, out = two_jobs
    spec = study_from_dict(raw)
    status = Study(spec).status()
    for arm in ("a", "b"):
        assert status[f"pretrain:{arm}"]["state"] == "done", status
        assert (out / "runs" / arm / "checkpoints" / "step-0000004").is_dir()
        assert json.loads((out / "runs" / arm / "run.json").read_text())["threads"] == 1
        assert (out / "logs" / f"pretrain-{arm}.log").is_file()
    assert {p.name for p in out.iterdir()} <= set(OUTPUTS), sorted(os.listdir(out))
    rows = [json.loads(x) for x in (out / "stages.jsonl").read_text().splitlines()]
    assert sorted(r["arm"] for r in rows if r["stage"] == "pretrain") == ["a", "b"]
    assert all(r["state"] == "done" for r in rows if r["stage"] in ("store", "pretrain"))
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
    other one's (RUSAGE_CHILDREN grows by every child reaped meanwhile, whichever stage ran it).

    The bounds rest only on what the test controls, not on the machine's speed or the resolution
    of its CPU clock: a burn loop costs at least its own CPU seconds (plus start-up), and the big
    child's 1.5 s dwarfs the small stage's 0.2 s, so charging it to the small stage shows."""
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
        child(0.2)

    def big() -> None:
        child(1.5)
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
    # rows are rounded to 0.1 s, hence the 0.05 below each burn
    assert cpu["big"] >= 1.5 - 0.05, cpu
    assert 0.2 - 0.05 <= cpu["small"] < 1.5, cpu  # with the big child's 1.5 s it would be >= 1.7
    assert 0.2 - 0.05 <= cpu["here"] < 1.5, cpu  # its own loop, no child's


def _pairs(root: Path) -> Path:
    """A one-phenomenon pair set in BLiMP's format, from fixture words (PLL of 4 pairs: cheap)."""
    from tests.helpers import make_text

    words = " ".join(make_text(1, seed=3)).split()
    lines = [json.dumps({"sentence_good": " ".join(words[i:i + 5]),
                         "sentence_bad": " ".join(reversed(words[i:i + 5])), "UID": "uid_a",
                         "field": "syntax", "linguistics_term": "order", "pairID": str(i)})
             for i in range(0, 20, 5)]
    (root / "pairs").mkdir()
    (root / "pairs" / "uid_a.jsonl").write_text("\n".join(lines) + "\n")
    return root / "pairs"


def test_the_one_arm_left_to_pre_train_runs_here_with_every_thread(corpus_dir, tokenizer_dir,
                                                                   tmp_path) -> None:
    """jobs = 2 x 1 thread, but one arm has pre-training left (the other is done, as in a
    resumed study): it runs in the driver with jobs x threads = 2 threads (run.json records what
    the run used), not as a 1-thread subprocess beside an idle core."""
    raw = _two_arm_spec(corpus_dir, tokenizer_dir, tmp_path / "study")
    raw["arms"] = {"a": raw["arms"]["a"]}
    run_study(study_from_dict(raw), stages=["store", "pretrain"], log=lambda s: None)
    out = tmp_path / "study"
    assert json.loads((out / "runs" / "a" / "run.json").read_text())["threads"] == 2
    assert not (out / "logs" / "pretrain-a.log").exists()  # no subprocess
    assert Study(study_from_dict(raw)).status()["pretrain:a"]["state"] == "done"


def test_eval_jobs_one_runs_evaluation_here_with_all_threads(two_jobs, tmp_path) -> None:
    """jobs = 2, eval_jobs = 1 (the demo's setting): the arms' BLiMP stages run in the driver,
    one after the other, with jobs x threads torch threads, and no subprocess is started."""
    import shutil

    raw, out = two_jobs
    copy = tmp_path / "study"
    shutil.copytree(out, copy)  # the shared study stays without blimp results for the next test
    raw = {**raw, "out": str(copy), "blimp": {"data": [str(_pairs(tmp_path))], "readiness": [1.0]},
           "probe": {"heldout_batches": 1, "batch_size": 2},
           "executor": {**raw["executor"], "eval_jobs": 1}}
    run_study(study_from_dict(raw), stages=["blimp"], log=lambda s: None)
    for arm in ("a", "b"):
        assert json.loads((copy / "blimp" / f"{arm}@100pct.json").read_text())["threads"] == 2
        assert not list((copy / "logs").glob(f"blimp-{arm}*.log"))
    stages = [r["stage"] for r in map(json.loads, (copy / "stages.jsonl").read_text().splitlines())]
    assert "blimp" in stages and "blimp-job" not in stages


def test_local_jobs_run_each_arms_evaluation_as_its_own_subprocess(two_jobs, tmp_path) -> None:
    """jobs = 2: each arm's BLiMP stage is a `python -m mlsm.study.job FILE blimp ARM 100%`
    subprocess with executor.threads torch threads (the scorer records its threads; in the driver
    it would have had jobs x threads), both at once (their job rows overlap in time), and an arm
    whose stage fails is recorded as failed while the other arm's score is written."""
    import shutil

    raw, shared = two_jobs
    out = tmp_path / "study"
    shutil.copytree(shared, out)  # b's checkpoint is broken below; the fixture's stays whole
    raw = {**raw, "out": str(out), "blimp": {"data": [str(_pairs(tmp_path))], "readiness": [1.0]},
           "probe": {"heldout_batches": 1, "batch_size": 2}}
    spec = study_from_dict(raw)
    broken = out / "runs" / "b" / "checkpoints" / "step-0000004" / "model.safetensors"
    broken.write_bytes(broken.read_bytes()[:100])  # b's scorer cannot load: its stage fails
    with pytest.raises(Incomplete, match="blimp-job:b"):  # the exit status says so
        run_study(spec, stages=["blimp"], log=lambda s: None)
    status = Study(spec).status()
    assert status["blimp:a@100%"]["state"] == "done", status
    assert status["blimp:b@100%"]["state"] == "failed", status
    assert status["blimp-job:b@100%"]["state"] == "failed" and "blimp:b@100%" in \
        status["blimp-job:b@100%"]["error"]
    row = json.loads((out / "blimp" / "a@100pct.json").read_text())
    assert row["threads"] == 1 and row["n_pairs"] == 4
    assert "[study] blimp:a@100%: start" in (out / "logs" / "blimp-a@100pct.log").read_text()
    assert "blimp:b@100%: FAILED" in (out / "logs" / "blimp-b@100pct.log").read_text()
    jobs = [r for r in map(json.loads, (out / "stages.jsonl").read_text().splitlines())
            if r["stage"] == "blimp-job"]
    assert sorted(r["arm"] for r in jobs) == ["a@100%", "b@100%"]
    ends = [time.mktime(time.strptime(r["finished"], "%Y-%m-%dT%H:%M:%SZ")) for r in jobs]
    (s0, e0), (s1, e1) = [(e - r["seconds"] - 1, e + 1) for r, e in zip(jobs, ends, strict=True)]
    assert s0 < e1 and s1 < e0, "the two arms' stages ran one after the other"
    # the report's wall-time table: each subprocess beside the stage it ran, never a row of its
    # own that a reader would add to the stage's (the seconds column sums each work once)
    from mlsm.study.cost_report import _wall_rows, stage_times

    rows = _wall_rows(stage_times(Study(spec)))
    assert not any(r.startswith("| blimp-job ") for r in rows), rows
    a_job = next(r["seconds"] for r in jobs if r["arm"] == "a@100%")
    assert any(r.startswith("| blimp | a@100% |") and r.endswith(f"| {a_job:.0f} |")
               for r in rows), rows


def test_an_arm_is_evaluated_while_a_slower_arm_still_pre_trains(two_jobs, tmp_path,
                                                                 monkeypatch) -> None:
    """jobs = 2, eval_jobs = 2: each arm's evaluation starts when its own pre-training ends. Arm
    b's pre-training is held here until arm a's BLiMP subprocess has started (or 30 s): under a
    stage-by-stage order a's evaluation would wait for b, and b would see nothing start."""
    import shutil

    from mlsm.study import executors

    raw, out = two_jobs
    copy = tmp_path / "study"
    shutil.copytree(out, copy)
    raw = {**raw, "out": str(copy), "blimp": {"data": [str(_pairs(tmp_path))], "readiness": [1.0]},
           "probe": {"heldout_batches": 1, "batch_size": 2}}
    a_started, a_ended, seen = threading.Event(), threading.Event(), {}
    real = executors._stage_subprocess

    def slow_pretrain(study, arm):  # both runs are trained already: only the wait is b's
        if arm == "b":
            seen["a still evaluating when b began"] = not a_ended.is_set()
            seen["a evaluating while b pre-trains"] = a_started.wait(30)
        return "skipped"

    def stage_subprocess(study, spec_file, stage, arm):
        a_started.set() if arm == "a" else None
        try:
            return real(study, spec_file, stage, arm)
        finally:
            a_ended.set() if arm == "a" else None

    monkeypatch.setattr(executors, "_subprocess_arm", slow_pretrain)
    monkeypatch.setattr(executors, "_stage_subprocess", stage_subprocess)
    run_study(study_from_dict(raw), stages=["pretrain", "blimp"], log=lambda s: None)
    assert seen == {"a still evaluating when b began": True,
                    "a evaluating while b pre-trains": True}
    for arm in ("a", "b"):  # both chains went on to their (real) BLiMP subprocesses
        assert json.loads((copy / "blimp" / f"{arm}@100pct.json").read_text())["n_pairs"] == 4
        assert (copy / "logs" / f"blimp-{arm}@100pct.log").is_file()


def test_an_arms_readiness_points_are_evaluated_side_by_side(two_jobs, tmp_path,
                                                             monkeypatch) -> None:
    """Each readiness point of an arm is an evaluation chain of its own (issue #50: one chain
    per arm left a core idle for half of v2's seed pair). jobs = 2, eval_jobs = 3: arm b's
    pre-training is held until arm a's two BLiMP points have both started (or 10 s), so they
    overlap only as two chains; and never more than max(jobs, eval_jobs) subprocesses at once."""
    import shutil

    from mlsm.study import executors

    raw, out = two_jobs
    copy = tmp_path / "study"
    shutil.copytree(out, copy)
    raw = {**raw, "out": str(copy), "readiness": [0.5, 1.0],
           "blimp": {"data": [str(_pairs(tmp_path))], "readiness": [0.5, 1.0]},
           "executor": {"kind": "local", "jobs": 2, "eval_jobs": 3, "threads": 1}}
    lock, running, peak, a_points = threading.Lock(), [0], [0], threading.Semaphore(0)
    seen: dict[str, bool] = {}
    intervals: dict[str, tuple[float, float]] = {}

    def counted(fn):  # every stand-in subprocess counts who is inside
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        try:
            return fn()
        finally:
            with lock:
                running[0] -= 1

    def held_pretrain(study, arm):  # both runs are trained already: only b's wait is real
        if arm == "b":
            seen["a's two points overlapped"] = all(a_points.acquire(timeout=10) for _ in "ab")
        return "skipped"

    def stage_subprocess(study, spec_file, stage, arm):
        name = f"{arm}@{study.points[0]}"
        start = time.time()
        if arm == "a":
            a_points.release()
        counted(lambda: time.sleep(0.5))
        intervals[name] = (start, time.time())
        return None

    monkeypatch.setattr(executors, "_subprocess_arm", lambda s, a: counted(
        lambda: held_pretrain(s, a)))
    monkeypatch.setattr(executors, "_stage_subprocess", stage_subprocess)
    # an arm-wide job record of an older mlsm: its per-point records replace it
    Study(study_from_dict(raw)).set_status("blimp-job:a", {"state": "failed", "error": "old"})
    run_study(study_from_dict(raw), stages=["pretrain", "blimp"], log=lambda s: None)
    assert "blimp-job:a" not in Study(study_from_dict(raw)).status()
    assert seen == {"a's two points overlapped": True}
    (s50, e50), (s100, e100) = intervals["a@0.5"], intervals["a@1.0"]
    assert s50 < e100 and s100 < e50, intervals
    assert sorted(intervals) == ["a@0.5", "a@1.0", "b@0.5", "b@1.0"]
    assert peak[0] <= 3
    rows = [json.loads(x) for x in (copy / "stages.jsonl").read_text().splitlines()]
    assert sorted(r["arm"] for r in rows if r["stage"] == "blimp-job") == [
        "a@100%", "a@50%", "b@100%", "b@50%"]


def test_a_stopped_study_starts_no_chain_that_was_waiting() -> None:
    """SIGTERM (here a timer's signal) reaches the driver while one chain holds the only slot and
    two wait: the driver stops as soon as the running stage ends, and the waiting chains never
    start theirs (they used to run every stage left, one after another, after the stop)."""
    import signal

    from mlsm.study.executors import run_chains
    from mlsm.study.gates import FairGate

    class Stop(Exception):
        pass

    def interrupt(signum, frame):
        raise Stop

    gate, started = FairGate(1), []

    def chain(arm: str) -> None:
        with gate:
            started.append(arm)
            time.sleep(1.0)

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        t0 = time.time()
        with pytest.raises(Stop):
            run_chains(["a", "b", "c"], chain, stop=gate.close)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert started == ["a"] and time.time() - t0 < 2.5, (started, time.time() - t0)


def test_a_probe_job_answers_for_its_readout_controls(tmp_path) -> None:
    """The probe stage of an arm fits its readout controls too (records probe-vocab:ARM@P): a
    failed control fails the job with its own error, and an arm whose only probes are controls
    (MLM) is not taken for complete when they ran (its job's time was left out of stages.jsonl)."""
    from mlsm.study.executors import _outcome

    spec = study_from_dict({"name": "c", "out": str(tmp_path / "s"),
                            "arms": {"m": {"objective": {"name": "mlm"}}},
                            "probe": {"controls": ["vocab"]}})
    study = Study(spec, log=lambda s: None)
    study.set_status("probe-vocab:m@100%", {"state": "done", "seconds": 3.0})
    study.set_status("probe-job:m@100%", {"state": "failed", "error": "an older job"})
    assert _outcome(study, "probe", "m") is None
    assert _outcome(study.at(1.0), "probe", "m") is None
    study.set_status("probe-vocab:m@100%", {"state": "done"})
    assert _outcome(study, "probe", "m") == "skipped"
    study.set_status("probe-vocab:m@50%", {"state": "failed", "error": "no memory"})
    with pytest.raises(RuntimeError, match="probe-vocab:m@50%: no memory"):
        _outcome(study, "probe", "m")
    assert _outcome(study.at(1.0), "probe", "m") == "skipped"  # the 50 % point is not its


def test_fair_gate_lets_waiters_through_in_arrival_order() -> None:
    """A holder that leaves and asks again at once queues behind those already waiting (a
    `threading.Semaphore` hands it straight back), and never more than n hold it at once."""
    from mlsm.study.gates import FairGate

    gate, order, inside, peak = FairGate(1), [], [0], [0]
    lock = threading.Lock()

    def hold(who: str) -> None:
        with gate:
            with lock:
                inside[0] += 1
                peak[0] = max(peak[0], inside[0])
            order.append(who)
            time.sleep(0.05)
            with lock:
                inside[0] -= 1

    def first() -> None:
        with gate:
            order.append("first")
            while len(gate._queue) < 2:  # b and c are waiting
                time.sleep(0.01)
        hold("first again")  # at once, as a chain asks for its next stage

    threads = [threading.Thread(target=first)]
    threads[0].start()
    while not order:
        time.sleep(0.01)
    for who in ("b", "c"):
        threads.append(threading.Thread(target=hold, args=(who,)))
        threads[-1].start()
        while who == "b" and len(gate._queue) < 1:  # b arrives before c
            time.sleep(0.01)
    for t in threads:
        t.join(10)
    assert order == ["first", "b", "c", "first again"]
    assert peak[0] == 1


@pytest.mark.parametrize("jobs, most", [(1, 1), (2, 2)])
def test_chains_pre_train_at_most_jobs_arms_at_once(corpus_dir, tokenizer_dir, tmp_path,
                                                    monkeypatch, jobs: int, most: int) -> None:
    """eval_jobs = 2 makes the arms chains, but `jobs` still bounds how many pre-train at once:
    jobs = 1 trains one arm after the other (the other chain waits), jobs = 2 both together."""
    from mlsm.study import executors

    raw = _two_arm_spec(corpus_dir, tokenizer_dir, tmp_path / "study")
    raw["executor"] = {"kind": "local", "jobs": jobs, "eval_jobs": 2, "threads": 1}
    lock, running, peak = threading.Lock(), [0], [0]

    def counted_pretrain(study, arm):  # stands in for the subprocess: counts who is inside
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(1.5)
        with lock:
            running[0] -= 1
        return None  # recorded as a run of its own wall time

    monkeypatch.setattr(executors, "_subprocess_arm", counted_pretrain)
    run_study(study_from_dict(raw), stages=["store", "pretrain"], log=lambda s: None)
    assert peak[0] == most
    rows = [json.loads(x) for x in (tmp_path / "study" / "stages.jsonl").read_text().splitlines()]
    seconds = [r["seconds"] for r in rows if r["stage"] == "pretrain"]
    assert len(seconds) == 2 and max(seconds) < 2.5, \
        f"a chain's wait for its turn (1.5 s) was counted as pre-training time: {seconds}"


def test_sigterm_to_a_study_stops_both_arms_at_a_checkpoint(corpus_dir, tokenizer_dir,
                                                            tmp_path) -> None:
    """SIGTERM to the study's process group (a scheduler's stop, a closed terminal) while two
    arms pre-train as subprocesses: each run saves a checkpoint and stops, the driver exits with
    its one line, and each arm's record says it was stopped and how to resume (a run that stops
    on a signal exits 143 now; its exit 0 was once recorded as a failure "with 0")."""
    import signal
    import subprocess

    raw = _two_arm_spec(corpus_dir, tokenizer_dir, tmp_path / "study")
    raw["base"]["train"]["steps"] = 5000
    (tmp_path / "s.json").write_text(json.dumps(raw))
    proc = subprocess.Popen([sys.executable, "-m", "mlsm", "study", str(tmp_path / "s.json"),
                             "--stages", "store", "pretrain"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    runs = [tmp_path / "study" / "runs" / arm / "metrics.jsonl" for arm in ("a", "b")]
    start = time.time()
    while not all(m.is_file() for m in runs) and proc.poll() is None and time.time() - start < 240:
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert err.strip().splitlines()[-1].startswith("mlsm study: stopped by SIGTERM"), err
    status = json.loads((tmp_path / "study" / "status.json").read_text())
    for arm in ("a", "b"):
        saved = sorted((tmp_path / "study" / "runs" / arm / "checkpoints").iterdir())
        assert saved and 0 < int(saved[-1].name.removeprefix("step-")) < 5000
        assert "stopped by a signal before its last step (exit 143); re-run the same command " \
            "to resume from its newest checkpoint" in status[f"pretrain:{arm}"]["error"]


def test_slurm_executor_without_slurm_is_refused_before_anything_is_written(
        corpus_dir, tmp_path, monkeypatch, capsys) -> None:
    """Where no Slurm client is on PATH, submitit's AutoExecutor would run the 'slurm' study on
    this machine without a word; the study refuses with one line naming the fix instead."""
    pytest.importorskip("submitit")
    from mlsm.cli import main

    out = tmp_path / "study"
    study = tmp_path / "s.yaml"
    study.write_text(f"corpus: {{sources: [{corpus_dir}]}}\nout: {out}\n"
                     "arms: {a: {objective: {name: mlm}}}\n"
                     "executor: {kind: slurm, slurm: {timeout_min: 10}}\n")
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # no srun, no sbatch
    capsys.readouterr()
    assert main(["study", str(study), "--stages", "report"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no Slurm" in err and "executor.slurm.cluster: local" in err, err
    assert not out.exists()


def test_timed_out_pretrain_job_is_requeued_and_resumes_from_its_last_checkpoint(
        corpus_dir, tokenizer_dir, tmp_path) -> None:
    """What submitit does when a slurm pre-training job reaches its time limit: call the job's
    `checkpoint`, pickle the DelayedSubmission it returns and run that in the requeued job. The
    run, stopped after step 2 of 4, must continue from its checkpoint to the last step."""
    submitit = pytest.importorskip("submitit")
    from mlsm.config import config_to_dict
    from mlsm.study.slurm import PretrainJob
    from mlsm.train.loop import pretrain
    from tests.test_study import _stop_after

    raw = _two_arm_spec(corpus_dir, tokenizer_dir, tmp_path / "study")
    raw["base"]["train"]["save_every"] = 2
    spec = study_from_dict(raw)
    run_study(spec, stages=["store"], log=lambda s: None)
    study = Study(spec, log=lambda s: None)
    cfg = study.arm_config("a")
    _stop_after(cfg, 2, pretrain)  # as the time limit's signal leaves it: checkpoint 2 saved
    run = study.run_dir("a")
    assert not (run / "checkpoints" / "step-0000004").exists()
    requeued = PretrainJob().checkpoint(config_to_dict(cfg))
    requeued.dump(tmp_path / "submitted.pkl")  # what the requeued job reads back
    result = submitit.helpers.DelayedSubmission.load(tmp_path / "submitted.pkl").result()
    assert result["run"] == str(run)
    assert (run / "checkpoints" / "step-0000004" / "model.safetensors").is_file()
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4], steps  # resumed after step 2, not started over


def test_mae_arm_is_skipped_by_blimp_with_its_reason_and_the_mlm_arm_is_scored(
        corpus_dir, tokenizer_dir, tmp_path) -> None:
    """A MAE-LM arm's checkpoints cannot be scored by PLL (its vocabulary head reads the decoder,
    Meng et al. 2024): the study records its blimp stage as skipped with the reason, writes no
    score for it, scores the MLM arm as usual, and the report says n/a where its BLiMP would be."""
    out = tmp_path / "study"
    raw = {**_two_arm_spec(corpus_dir, tokenizer_dir, out),
           "arms": {"m": {"objective": {"name": "mlm"}}, "e": {"objective": {"name": "mae_lm"}}},
           "blimp": {"data": [str(_pairs(tmp_path))], "readiness": [1.0]},
           "probe": {"heldout_batches": 1, "batch_size": 2},
           "executor": {"kind": "local", "jobs": 1, "threads": 1}}
    raw["base"]["train"]["steps"] = 2
    spec = study_from_dict(raw)
    report = run_study(spec, stages=["store", "pretrain", "probe", "blimp", "report"],
                       log=lambda s: None)
    status = Study(spec).status()
    assert status["blimp:m@100%"]["state"] == "done", status
    assert json.loads((out / "blimp" / "m@100pct.json").read_text())["n_pairs"] == 4
    skipped = status["blimp:e@100%"]
    assert skipped["state"] == "skipped" and "fine-tuning only" in skipped["reason"], status
    assert not (out / "blimp" / "e@100pct.json").exists()
    assert not any(v.get("state") == "failed" for v in status.values()), status
    assert "| e@100% | n/a (scored by fine-tuning only) |" in report.read_text()


def test_clm_arms_are_scored_only_at_readiness_points_past_their_causal_phase(tmp_path) -> None:
    """A CLM arm is never scored by PLL (it learnt under a causal mask); a CLM -> MLM arm is
    skipped at the readiness points still in its CLM phase and scored after the switch: BLiMP
    work exists for the latter only at those points, and the skips carry the reason."""
    from mlsm.study import stages

    spec = study_from_dict({"name": "c", "out": str(tmp_path / "s"),
                            "base": {"train": {"steps": 100}},
                            "arms": {"c": {"objective": {"name": "clm"}},
                                     "cm": {"objective": {"name": "clm_then_mlm",
                                                          "clm_fraction": 0.5}}},
                            "blimp": {"data": [str(_pairs(tmp_path))],
                                      "readiness": [0.25, 0.5, 1.0]}})
    study = Study(spec, log=lambda s: None)
    assert [bool(study.unscored_reason("c", f)) for f in (0.25, 0.5, 1.0)] == [True] * 3
    assert [bool(study.unscored_reason("cm", f)) for f in (0.25, 0.5, 1.0)] == [True, True, False]
    assert "causal mask" in study.unscored_reason("cm", 0.5)
    assert not stages.has_work(study, "blimp", "c") and stages.has_work(study, "blimp", "cm")
    stages.blimp_path(study, "cm", 1.0).parent.mkdir(parents=True)
    stages.blimp_path(study, "cm", 1.0).write_text("{}")
    assert stages.has_work(study, "blimp", "cm")  # a file without its stage record is not done
    from mlsm.study.reuse import blimp_inputs
    from mlsm.study.sameness import fingerprint_of

    current = fingerprint_of(blimp_inputs(study, "cm", 1.0))  # the one scored point is done
    study.set_status("blimp:cm@100%", {"state": "done", "fingerprint": current})
    assert not stages.has_work(study, "blimp", "cm")


def test_mae_mlsm_arm_has_no_probe_or_blimp_work_and_its_probe_skip_is_recorded(tmp_path) -> None:
    """A latent arm not scored by PLL (MAE-MLSM: its latent head reads decoder states) gets no
    probe or BLiMP job (`has_work`, what the slurm and local-jobs drivers submit by), and the
    probe stage records a skip with the reason at each readiness point instead of training a
    probe; an MLM arm of the same study still has BLiMP work."""
    from mlsm.study import stages

    spec = study_from_dict({"name": "p", "out": str(tmp_path / "s"),
                            "arms": {"x": {"objective": {"name": "mae_mlsm"}},
                                     "m": {"objective": {"name": "mlm"}}},
                            "blimp": {"data": [str(_pairs(tmp_path))], "readiness": [0.5, 1.0]}})
    study = Study(spec, log=lambda s: None)
    assert study.is_latent("x")
    assert not stages.has_work(study, "probe", "x") and not stages.has_work(study, "blimp", "x")
    assert stages.has_work(study, "blimp", "m")
    assert stages.run_probe(study, ["x", "m"]) == set()
    status = study.status()
    assert sorted(status) == ["probe:x@100%", "probe:x@50%"], status
    assert all(v["state"] == "skipped" and "fine-tuning only" in v["reason"]
               for v in status.values()), status


STUDIES = sorted((Path(__file__).resolve().parents[1] / "studies").glob("*.yaml"))


@pytest.mark.parametrize("path", STUDIES, ids=[p.stem for p in STUDIES])
def test_the_job_file_gives_the_driver_s_study_back_exactly(path: Path) -> None:
    """What a local evaluation subprocess reads (`spec_record` as JSON) is the driver's study
    exactly: seeded runs not seeded again, relative paths not resolved again (a shipped study's
    are relative), hypotheses kept."""
    from mlsm.study.spec import load_study, spec_from_record, spec_record

    spec = load_study(os.path.relpath(path))
    assert spec_from_record(json.loads(json.dumps(spec_record(spec)))) == spec


def test_a_seeded_study_evaluates_each_run_in_its_own_subprocess(corpus_dir, tokenizer_dir,
                                                                  tmp_path, monkeypatch) -> None:
    """Seeds x jobs = 2, a study file with relative paths: each run's BLiMP stage is a
    subprocess that scores its own run, and the driver takes its rows as current (the
    subprocess computed the same fingerprints). It used to re-read a YAML copy of the study,
    whose seeded runs (a-s0) were refused as arm names."""
    import yaml

    from mlsm.study import reuse
    from mlsm.study.spec import load_study

    raw = _two_arm_spec(corpus_dir, tokenizer_dir, Path("../out"))
    raw["arms"]["b"] = {"objective": {"name": "mlm"}}
    raw.update(out="../out", seeds=[0], blimp={"data": ["pairs"], "readiness": [1.0]},
               probe={"heldout_batches": 1, "batch_size": 2})
    (tmp_path / "studies").mkdir()
    _pairs(tmp_path / "studies")
    (tmp_path / "studies" / "s.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(tmp_path)  # the study file's paths are relative to where it is
    spec = load_study("studies/s.yaml")
    run_study(spec, stages=["store", "pretrain", "blimp"], log=lambda s: None)
    study = Study(spec)
    for run in ("a-s0", "b-s0"):
        row = json.loads((tmp_path / "out" / "blimp" / f"{run}@100pct.json").read_text())
        assert row["threads"] == 1 and row["n_pairs"] == 4
        assert reuse.is_current(study, "blimp", row)
        log = tmp_path / "out" / "logs" / f"blimp-{run}@100pct.log"
        assert "[study] blimp:" in log.read_text()


def test_lines_logged_from_threads_at_once_stay_whole(tmp_path) -> None:
    """Two arms' stages log from threads at once: the sink gets one whole line at a time, even
    one that, like `print`, writes a line and its newline separately (a v2 log read
    `...mlsm_l5-s0: start[study] blimp:...`)."""
    written: list[str] = []

    def sink(line: str) -> None:  # print's two writes to a file, each letting other threads run
        written.append(line)
        time.sleep(0)
        written.append("\n")

    spec = study_from_dict({"name": "t", "out": str(tmp_path),
                            "arms": {"m": {"objective": {"name": "mlm"}}}})
    study = Study(spec, log=sink)
    lines = [f"[study] line {i}" for i in range(2000)]
    threads = [threading.Thread(target=lambda part=part: [study.log(x) for x in part])
               for part in (lines[::2], lines[1::2])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted("".join(written).splitlines()) == sorted(lines)


def test_an_arm_training_in_a_subprocess_shows_its_progress_in_the_study_log(tmp_path) -> None:
    """The arm's own progress bar goes to its log file; the study's log (the demo's console)
    gets a line each time the run's metrics pass another tenth of its steps. A resumed run's
    old rows are where it starts, not progress; a torn last row is skipped."""
    from mlsm.study.executors import _ProgressLines

    spec = study_from_dict({"name": "p", "out": str(tmp_path / "study"),
                            "arms": {"m": {"objective": {"name": "mlm"}}}})
    said: list[str] = []
    study = Study(spec, log=said.append)
    metrics = study.run_dir("m") / "metrics.jsonl"
    metrics.parent.mkdir(parents=True)
    metrics.write_text("".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in (10, 20)))
    watch = _ProgressLines(study, "m", steps=100)
    watch()  # resumed at step 20: where it starts, said by the run itself
    for step in range(25, 101, 5):
        with metrics.open("a") as fh:
            fh.write(json.dumps({"step": step, "loss": 10.0 - step / 100}) + "\n")
        watch()
        watch()  # looking again without progress says nothing
    with metrics.open("a") as fh:
        fh.write('{"step": 1')  # torn by a crash
    watch()
    steps = [int(line.split("step ")[1].split("/")[0]) for line in said]
    assert steps == [30, 40, 50, 60, 70, 80, 90, 100], said
    assert said[-1] == "[study] pretrain:m: step 100/100, loss 9.000"


def test_a_points_probe_heads_are_asked_for_widest_first() -> None:
    """The runner starts a point's probe subprocesses in `probe_heads` order: the factored
    control (d -> k -> |V|), then a latent arm's own probe (k -> |V|), then vocab (d -> |V|), so
    on two slots the longest fit never waits behind a short one (v3 seed 0: factored 707-1,532
    CPU s, latent 350-1,034, vocab 107-340); a view of one head holds that head only."""
    from mlsm.study.folder import Study
    from mlsm.study.spec import study_from_dict
    from mlsm.study.stages import probe_heads

    spec = study_from_dict({"name": "h", "out": "unused", "probe": {"controls": ["vocab",
                                                                                 "factored"]},
                            "arms": {"m": {"objective": {"name": "mlm"}},
                                     "s": {"objective": {"name": "mlsm"},
                                           "dictionary": {"layer": 5}}}})
    study = Study(spec, create=False)
    assert probe_heads(study, "s") == ["factored", "latent", "vocab"]
    assert probe_heads(study, "m") == ["factored", "vocab"]
    assert probe_heads(study.at(1.0, "latent"), "s") == ["latent"]
    assert probe_heads(study.at(1.0, "latent"), "m") == []
