"""Where a study's stages run: in this process, in N local subprocesses, or on slurm.

`local` with one evaluation at a time (`eval_jobs` 1, or 0 with jobs = 1) or one arm goes stage
by stage: the pre-training runs in this process (jobs = 1, or one arm left to train) or as `jobs`
`python -m mlsm pretrain --resume auto` subprocesses at once, each with `executor.threads` torch
threads; every evaluation stage then runs here, one model at a time. With `eval_jobs` above 1
(0 = jobs) and several arms, each arm runs its stages as chains of its own (`run_chains`): its
pre-training a subprocess (`jobs` at once), then per readiness point each evaluation stage
(probe, blimp, readout; the fine-tuning grid a chain of its own) a `python -m mlsm.study.job`
subprocess (`eval_jobs` at once, max(jobs, eval_jobs) subprocesses in all), so its evaluation
starts when its own pre-training ends, not when the slowest arm's does.
`slurm` submits one job per arm (`mlsm.study.slurm`); the driver waits for them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mlsm.artifacts.rundir import RunDir
from mlsm.config import save_config
from mlsm.errors import UserError
from mlsm.fileio import atomic_write_text
from mlsm.study.folder import Study, pretrain_done
from mlsm.study.preparation import pretrain_arm, pretrain_todo
from mlsm.study.slurm import await_job, job_cpus, make_executor, slurm_pretraining
from mlsm.study.spec import readiness_label, spec_record
from mlsm.study.stages import (
    EVALUATIONS,
    driver_threads,
    has_work,
    model_name,
    probe_stage,
    run_arm_stage,
)
from mlsm.train.signals import STOP_SIGNALS, exit_status


def run_pretraining(study: Study, arms: list[str]) -> set[str]:
    """Pre-train `arms` with the study's executor; returns the arms that failed."""
    kind, jobs = study.spec.executor.kind, study.spec.executor.jobs
    if kind == "slurm":
        return slurm_pretraining(study, arms)
    if jobs <= 1 or sum(not pretrain_done(study, a) for a in arms) <= 1:
        # one arm left to train (a resumed study, often): here, with all jobs x threads threads,
        # not one subprocess holding `threads` while the other cores idle
        threads = driver_threads(study)
        return {a for a in arms
                if not study.stage("pretrain", lambda a=a: pretrain_arm(study, a, threads), a)}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        ok = list(pool.map(
            lambda a: study.stage("pretrain", lambda: _subprocess_arm(study, a), a), arms))
    return {a for a, good in zip(arms, ok, strict=True) if not good}


def _subprocess_arm(study: Study, arm: str) -> str | None:
    """One arm as a `mlsm pretrain` subprocess (its own torch thread pool)."""
    cfg = study.arm_config(arm)
    if not pretrain_todo(study, arm, cfg):
        return "skipped"
    path = study.root / "configs" / f"{arm}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    save_config(cfg, path)
    log = study.root / "logs" / f"pretrain-{arm}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if study.spec.executor.threads:  # OpenMP's pool too, or N jobs x all cores oversubscribe
        env["OMP_NUM_THREADS"] = str(study.spec.executor.threads)
    command = [sys.executable, "-m", "mlsm", "pretrain", "--config", str(path), "--resume", "auto"]
    watch = _ProgressLines(study, arm, cfg.train.steps)
    with log.open("a") as fh:
        code, cpu = _call_measured(command, fh, env, watch)
    study.add_child_cpu(cpu)
    # a signalled run saves a checkpoint and exits 128 + the signal (0 with train.signal_exit_zero);
    # one killed by it before the CLI's handlers were in place: minus the signal (Popen's way)
    signalled = code in {exit_status(s) for s in STOP_SIGNALS} | {-s for s in STOP_SIGNALS}
    if signalled or (code == 0 and not pretrain_done(study, arm)):
        raise RuntimeError(f"mlsm pretrain was stopped by a signal before its last step (exit "
                           f"{code}); re-run the same command to resume from its newest "
                           f"checkpoint; see {log}")
    if code != 0:
        raise RuntimeError(f"mlsm pretrain exited with {code}; see {log}")
    return None


class _ProgressLines:
    """The study log's view of an arm training in a subprocess (whose own progress bar goes to
    its log file): one line each time the run's metrics pass another tenth of its steps."""

    def __init__(self, study: Study, arm: str, steps: int):
        self.study, self.arm, self.steps = study, arm, max(1, steps)
        self.run = RunDir(study.run_dir(arm))
        self.tenths = -1  # the tenth last said; the first look only notes where a resume starts

    def __call__(self) -> None:
        row = self.run.last_logged()
        if row is None:
            return
        tenths = min(10, row["step"] * 10 // self.steps)
        if tenths > self.tenths >= 0:
            loss = row.get("loss")
            said = f", loss {loss:.3f}" if isinstance(loss, (int, float)) else ""
            self.study.log(f"[study] pretrain:{self.arm}: step {row['step']}/{self.steps}{said}")
        self.tenths = max(self.tenths, tenths)


def _call_measured(command: list[str], fh: Any, env: dict[str, str],
                   watch: Callable[[], None] | None = None,
                   every_s: float = 2.0) -> tuple[int, float]:
    """Run `command` to its end like `subprocess.call`; (exit code, its CPU seconds). The child is
    reaped with `os.wait4`, which returns its own resource usage: two arms run at once, and
    RUSAGE_CHILDREN could not tell their costs apart. `watch` is called every `every_s` seconds
    while the child runs."""
    with subprocess.Popen(command, stdout=fh, stderr=subprocess.STDOUT, env=env) as proc:
        try:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            delay = 0.05  # a short child (a skipped or refused run) is reaped at once
            while pid == 0:
                time.sleep(delay)
                delay = min(every_s, 2 * delay)
                if watch is not None:
                    watch()
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        except BaseException:  # as subprocess.call: an interrupted driver leaves no orphan
            proc.kill()
            raise
        proc.returncode = os.waitstatus_to_exitcode(status)
        return proc.returncode, usage.ru_utime + usage.ru_stime


def run_evaluation(study: Study, stage: str, arms: list[str]) -> set[str]:
    """Run an evaluation stage (probe, finetune, blimp) for `arms`; returns the arms that failed.

    `local` runs the stage here, one model at a time (a local study whose evaluation runs in
    subprocesses goes through `run_chains` instead). On slurm each arm's stage is one job,
    submitted after pre-training finished and awaited before the next stage. Jobs run
    `run_arm_stage` with that arm and stage, so skip-if-complete and the failure records
    work inside them as here; an arm whose stage has nothing to do (its files exist, or the stage
    does not apply to it) gets none.
    """
    run_here = EVALUATIONS[stage]
    if study.in_job or not arms:
        return run_here(study, arms)
    if study.spec.executor.kind == "local":
        return run_here(study, arms)
    work = [a for a in arms if has_work(study, stage, a)]
    failed = run_here(study, [a for a in arms if a not in work])  # records their skips
    if not work:
        return failed
    executor = make_executor(study)
    spec = dataclasses.asdict(study.spec)
    jobs = {arm: executor.submit(stage_job, spec, stage, arm) for arm in work}
    for arm, job in jobs.items():
        study.log(f"[study] {stage}:{arm}: submitted as job {job.job_id}, log {job.paths.stdout}")
    return failed | {a for a, job in jobs.items()
                     if not study.stage(f"{stage}-job", lambda j=job: await_job(j), a,
                                        record={"slurm_job": str(job.job_id)})}


def eval_jobs(study: Study) -> int:
    """How many arms' evaluation stages run at once locally (executor.eval_jobs, 0 = jobs)."""
    return study.spec.executor.eval_jobs or study.spec.executor.jobs


def job_spec_file(study: Study) -> Path:
    """Write OUT/configs/study-job.json, the study an evaluation subprocess reads: the driver's,
    with jobs = 1, so each subprocess runs its arm in itself with `executor.threads` threads."""
    spec = dataclasses.replace(study.spec, executor=dataclasses.replace(study.spec.executor,
                                                                        jobs=1, eval_jobs=0))
    path = study.root / "configs" / "study-job.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(spec_record(spec), indent=1) + "\n")
    return path


def chained(study: Study, arms: list[str]) -> bool:
    """Whether `arms` run as chains (`run_chains`): local, evaluations in subprocesses
    (eval_jobs > 1) and more than one arm (a lone arm trains in the driver with every thread)."""
    return (study.spec.executor.kind == "local" and eval_jobs(study) > 1 and len(arms) > 1
            and not study.in_job)


def run_chains(arms: list[str], chain: Callable[[str], None],
               stop: Callable[[], None] = lambda: None) -> None:
    """chain(arm) for every arm, all started at once: each arm's stages in order, the arms side
    by side; the chains' gates, not a bound on arms in progress, keep `jobs` pre-training,
    `eval_jobs` evaluating and max(jobs, eval_jobs) in all. Under the stage-by-stage order every
    arm waited for the slowest arm's pre-training before any evaluation began (v2's MLSM arms
    finished 20-26 min before MLM's, a core idle); with at most max(jobs, eval_jobs) arms in
    progress, an arm's pre-training waited for a whole earlier arm's evaluation
    (benchmarks/schedule_projection.py replays a study's stage times both ways).

    stop: called when this thread is interrupted (SIGTERM, Ctrl-C) or a chain raises, before
    waiting for the chains to end: it closes their gates, so no chain starts another
    subprocess (they would otherwise run every stage left, one after another, after the stop)."""
    with ThreadPoolExecutor(max_workers=max(1, len(arms))) as pool:
        try:
            list(pool.map(chain, arms))  # re-raises what a chain raised
        except BaseException:
            stop()
            raise


def pretrain_subprocess(study: Study, arm: str, gate: contextlib.AbstractContextManager) -> bool:
    """One arm's pre-training as a `mlsm pretrain` subprocess, at most as many at once as `gate`
    lets through (`jobs`), recorded; False if it failed. A finished run starts no subprocess."""
    # the wait for the gate stays outside the stage: its wall time is the run's, not the queue's
    with contextlib.nullcontext() if pretrain_done(study, arm) else gate:
        return study.stage("pretrain", lambda: _subprocess_arm(study, arm), arm)


def evaluation_subprocess(study: Study, stage: str, arm: str, spec_file: Path,
                          gate: contextlib.AbstractContextManager) -> set[str]:
    """One arm's evaluation stage as a subprocess (spec_file: `job_spec_file`), at the readiness
    point `study` is restricted to (`Study.at`) or at all, at most as many at once as `gate`
    lets through; returns {arm} if it failed. An arm with nothing to do for the stage gets no
    subprocess: the stage records its skips here."""
    if not has_work(study, stage, arm):
        return EVALUATIONS[stage](study, [arm])
    name = _job_name(study, arm)
    with gate:
        ok = study.stage(f"{stage}-job", lambda: _stage_subprocess(study, spec_file, stage, arm),
                         name)
    if study.points:  # the per-point records replace an arm-wide one of an older mlsm
        study.drop_status(f"{stage}-job:{arm}")
    return set() if ok else {arm}


def _job_name(study: Study, arm: str) -> str:
    """The record's name of a stage subprocess: ARM, ARM@P% (one point: `Study.at`) or
    ARM@P%/HEAD (one probe head)."""
    name = model_name(arm, study.points[0]) if study.points else arm
    return f"{name}/{study.heads[0]}" if study.points and study.heads else name


def job_inner(stage: str, name: str) -> tuple[str, str]:
    """The stage record a subprocess's record (`STAGE-job`, `_job_name`) ran:
    ("probe-vocab", "A@100%") for ("probe-job", "A@100%/vocab"), ("blimp", "A@100%") for
    ("blimp-job", "A@100%"). A job of a whole arm (an older mlsm's, or Slurm's) names the arm,
    which no per-point record matches."""
    model, _, head = name.partition("/")
    return (probe_stage(head) if head else stage.removesuffix("-job")), model


def standing_failures(study: Study) -> dict[str, dict[str, Any]]:
    """The failures status.json records that still stand, for the report: those of the study's
    arms (a piece published with `--arms` shows its own) or of no arm (the store), less each
    failed subprocess (`STAGE-job:NAME`, e.g. one a stop killed) whose work was done since by
    another run: in this process (a lone arm runs here) or in another subprocess of another
    name. Its record is the last of its key, but the work it wrapped is recorded under the
    stage's own keys, and `has_work` reads those (fingerprints and all)."""
    standing = {}
    for key, record in study.owned_status().items():
        if record.get("state") != "failed":
            continue
        name, _, model = key.partition(":")
        arm, _, where = model.partition("@")
        if not name.endswith("-job") or _job_has_work(study, name.removesuffix("-job"), arm,
                                                      where):
            standing[key] = record
    return standing


def _job_has_work(study: Study, stage: str, arm: str, where: str) -> bool:
    """Whether the work of the subprocess named ARM[@POINT[/HEAD]] (`_job_name`) is still to
    do; True where that cannot be told (a point the study no longer has, an unreadable record),
    so that no failure is hidden."""
    label, _, head = where.partition("/")
    points = set(study.spec.readiness) | set(study.spec.blimp.readiness)
    point = next((f for f in points if readiness_label(f) == label), None)
    if label and point is None:
        return True
    try:
        return has_work(study.at(point, head or None), stage, arm)
    except (UserError, OSError):
        return True


def _stage_subprocess(study: Study, spec_file: Path, stage: str, arm: str) -> str | None:
    point = [readiness_label(study.points[0])] if study.points else []
    point += list(study.heads or []) if point else []
    name = _job_name(study, arm)
    log = study.root / "logs" / f"{stage}-{name.replace('%', 'pct').replace('/', '-')}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    study.log(f"[study] {stage}:{name}: running as a subprocess, log {log}")
    env = dict(os.environ)  # the job writes inside this command's lock on the study folder
    if study.spec.executor.threads:  # OpenMP's pool too, or N jobs x all cores oversubscribe
        env["OMP_NUM_THREADS"] = str(study.spec.executor.threads)
    command = [sys.executable, "-m", "mlsm.study.job", str(spec_file), stage, arm, *point]
    with log.open("a") as fh:
        code, cpu = _call_measured(command, fh, env)
    study.add_child_cpu(cpu)
    outcome = _outcome(study, stage, arm)  # raises with the records of a failed stage
    if code != 0:  # it stopped before its stage could record anything
        raise RuntimeError(f"the {stage} subprocess of {name} (python -m mlsm.study.job) "
                           f"exited with {code}; see {log}")
    return outcome


def _outcome(study: Study, stage: str, arm: str) -> str | None:
    """What `stage` recorded for `arm` in status.json (keys STAGE:ARM and STAGE:ARM@READINESS,
    the probe stage's readout controls (probe-HEAD:...) with it, only the readiness point of a
    `Study.at` view): raises with every failure; "skipped" if it found all its work done, else
    None."""
    names = {stage} | ({f"probe-{h}" for h in study.spec.probe.controls}
                       if stage == "probe" else set())
    if stage == "probe" and study.heads is not None:  # one head's subprocess: its records only
        names = {probe_stage(h) for h in study.heads}
    points = {model_name(arm, f) for f in study.points or []}

    def ours(key: str) -> bool:
        name, _, model = key.partition(":")
        return name in names and (model in points if points else
                                  model == arm or model.startswith(f"{arm}@"))

    mine = {k: v for k, v in study.status().items() if ours(k)}
    failed = [f"{k}: {v.get('error', '')}" for k, v in mine.items() if v.get("state") == "failed"]
    if failed:
        raise RuntimeError("; ".join(failed))
    # a stage that ran records its seconds; one that found its output complete does not
    return "skipped" if all("seconds" not in v for v in mine.values()) else None


def stage_job(spec: dict[str, Any], stage: str, arm: str) -> str | dict[str, float]:
    """What one evaluation job runs: that stage of that arm, in the same study folder, in this
    process (a job must not submit jobs of its own); raises when the stage failed, and returns
    "skipped" when it found its work done, else the seconds it took here."""
    from mlsm.study.spec import study_from_dict

    start, cpu = time.time(), time.process_time()
    study = study_from_dict(spec)
    threads = study.executor.threads or job_cpus()  # else torch takes every core of the node
    study = dataclasses.replace(study, executor=dataclasses.replace(study.executor,
                                                                    threads=threads))
    run_arm_stage(study, stage, arm)  # _outcome raises with the failures it recorded
    if _outcome(Study(study, log=lambda s: None), stage, arm) == "skipped":
        return "skipped"
    return {"seconds": time.time() - start, "cpu_seconds": time.process_time() - cpu}
