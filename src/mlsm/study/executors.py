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
`slurm` submits one job per arm through submitit (Rapin & Jun 2019's launcher), with partition /
GPUs / time from `executor.slurm`; the driver waits for the jobs (the later stages depend on
them) and records each arm's outcome. A pre-training job that reaches its time limit is requeued
by submitit and resumes from its newest checkpoint (`PretrainJob`). A job with more than one GPU
per node starts DDP through submitit's one task per GPU (torch.distributed reads submitit's
environment), which is what `torchrun` would do by hand.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mlsm.artifacts.rundir import RunDir
from mlsm.config import config_to_dict, save_config
from mlsm.errors import UserError
from mlsm.fileio import atomic_write_text
from mlsm.run_config import config_from_dict
from mlsm.study.folder import Study, pretrain_done
from mlsm.study.preparation import pretrain_arm, pretrain_todo
from mlsm.study.reuse import pretrain_inputs
from mlsm.study.spec import StudySpec, readiness_label, spec_record
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
        return _slurm(study, arms)
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


def pretrain_job(config: dict[str, Any]) -> dict[str, Any]:
    """What one slurm job runs: continue (or start) the run; returns its directory and the
    seconds it took here."""
    from mlsm.train.loop import pretrain

    start, cpu = time.time(), time.process_time()
    cfg = config_from_dict(config)
    if not cfg.train.threads and _job_cpus():  # torch would take every core of the node
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, threads=_job_cpus()))
    run = pretrain(cfg, resume="auto")
    return {"run": str(run), "seconds": time.time() - start,
            "cpu_seconds": time.process_time() - cpu}


class PretrainJob:
    """`pretrain_job` as a checkpointable submitit job. Before the time limit submitit signals
    the job (USR2, `signal_delay_s` ahead), calls its `checkpoint` and requeues the
    DelayedSubmission that returns: the same call, which continues the run from its newest saved
    checkpoint (resume="auto"; batches depend only on (data.seed, step)). So a job that runs out
    of time loses at most the steps since the last save (`train.save_every`), not the run.

    What `submitit.helpers.Checkpointable` does, written out: submitit calls any `checkpoint`
    method, and subclassing would make importing mlsm import submitit, an optional extra."""

    def __call__(self, config: dict[str, Any]) -> dict[str, Any]:
        return pretrain_job(config)

    def checkpoint(self, config: dict[str, Any]) -> Any:
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self, config)  # the same call; it resumes from the last save


def _job_cpus() -> int:
    """The cores Slurm gave this job's task (0 outside Slurm or when not stated)."""
    return int(os.environ.get("SLURM_CPUS_PER_TASK", "0") or 0)


PROPAGATED = ("PYTHONPATH", "VIRTUAL_ENV", "CONDA_PREFIX")
"""Variables the jobs get from the driver even where the site sets SBATCH_EXPORT=NONE ..."""
PROPAGATED_PREFIXES = ("HF_", "TRANSFORMERS_", "TOKENIZERS_", "MLSM_", "WANDB_", "MLFLOW_",
                       "TRACKIO_")
"""... and those of mlsm and the libraries it drives (offline switches, caches, trackers)."""
_SECRET = ("TOKEN", "KEY", "SECRET", "PASSWORD")
"""Never written into a submission script (those files stay in the study folder)."""


def _exports() -> list[str]:
    """`export` lines that give a job the driver's Python path and library settings."""
    names = sorted(k for k in os.environ
                   if (k in PROPAGATED or k.startswith(PROPAGATED_PREFIXES))
                   and not any(s in k for s in _SECRET))
    return [f"export {k}={shlex.quote(os.environ[k])}" for k in names]


def _submitit() -> Any:
    try:
        import submitit
    except ImportError:
        raise UserError("executor.kind: slurm needs submitit; from the root of the mlsm clone, "
                        "install it with pip install -e '.[slurm]'") from None
    return submitit


def check_slurm(spec: StudySpec) -> None:
    """A slurm study needs submitit and, unless `executor.slurm.cluster` names submitit's local
    or debug executor, a Slurm client here: submitit's AutoExecutor would otherwise run every job
    on this machine without a word, for hours, where the study file asked for a cluster."""
    submitit = _submitit()
    cluster = spec.executor.slurm.get("cluster")
    if cluster in ("local", "debug"):
        return
    if cluster not in (None, "slurm"):
        raise UserError(f"executor.slurm.cluster is {cluster!r}; use slurm (the default), or "
                        "local / debug for a trial on this machine")
    if submitit.AutoExecutor.which() != "slurm":  # what submitit detects: `srun` on PATH
        raise UserError("executor.kind is slurm but this machine has no Slurm (no srun on PATH); "
                        "run the study on a Slurm login node (or install Slurm here), or set "
                        "executor.slurm.cluster: local (or debug) to try it on this machine")


def make_executor(study: Study, cluster: str | None = None) -> Any:
    """A submitit executor configured from `executor.slurm` (cluster: None = Slurm, which
    `check_slurm` made sure of; 'debug'/'local' for tests)."""
    submitit = _submitit()
    params = dict(study.spec.executor.slurm)
    folder = Path(params.pop("folder", study.root / "slurm")).absolute()
    cluster = params.pop("cluster", cluster)
    # how often a pre-training job may be requeued at its time limit (a constructor argument)
    requeues = {"slurm_max_num_timeout": params.pop("max_num_timeout")} \
        if "max_num_timeout" in params else {}
    executor = submitit.AutoExecutor(folder=folder, cluster=cluster, **requeues)
    native = ("timeout_min", "nodes", "gpus_per_node", "cpus_per_task", "tasks_per_node", "mem_gb")
    mapped = {k if k in native or executor.cluster != "slurm" else f"slurm_{k}": v
              for k, v in params.items()}
    if executor.cluster != "slurm":
        mapped = {k: v for k, v in mapped.items() if k in native}
    else:  # (timeout_min is required by the study file's checks)
        # the job's own shell and srun get the driver's Python path and offline / cache
        # settings even where the site exports nothing (SBATCH_EXPORT=NONE)
        mapped["slurm_setup"] = _exports() + list(params.get("setup", []))
        mapped["slurm_srun_args"] = ["--export=ALL", *params.get("srun_args", [])]
    executor.update_parameters(name=f"mlsm-{study.spec.name}", **mapped)
    return executor


def _slurm(study: Study, arms: list[str]) -> set[str]:
    todo: list[str] = []

    # config checks and skips happen in the driver, before anything is queued
    def check(arm: str) -> str:
        if pretrain_todo(study, arm):
            todo.append(arm)
        return "skipped"

    failed = {a for a in arms if not study.stage("pretrain-check", lambda a=a: check(a), a)}
    if not todo:
        return failed
    executor = make_executor(study)
    jobs = {arm: executor.submit(PretrainJob(), config_to_dict(study.arm_config(arm)))
            for arm in todo}
    for arm, job in jobs.items():
        study.log(f"[study] pretrain:{arm}: submitted as job {job.job_id}, log {job.paths.stdout}")
    for arm, job in jobs.items():
        if not study.stage("pretrain", lambda j=job, a=arm: _wait(j, study, a), arm,
                           record={"slurm_job": str(job.job_id)}):
            failed.add(arm)
    return failed


def _wait(job: Any, study: Study, arm: str) -> dict[str, Any]:
    result = await_job(job)  # raises submitit's FailedJobError with the job's traceback
    study.note_inputs(pretrain_inputs(study, arm))
    if not pretrain_done(study, arm):
        raise RuntimeError(f"slurm job {job.job_id} ended before the last step of {arm}; "
                           f"run the same command to resume (log: {job.paths.stdout})")
    return result


_RUNNING = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED",
            "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD")


def await_job(job: Any, poll_s: float = 2.0, grace_s: float = 30.0) -> Any:
    """The job's result (or its exception, raised), once its result file exists.

    submitit alone waits for a result file or for `sacct` to say the job ended; where Slurm keeps
    no accounting (`sacct` fails, as on a single-node install) a job that was cancelled, ran out of
    time or memory, or lost its node leaves no result and submitit would wait forever. So the
    queue is asked too (`squeue`), and a job that left it without a result is a failure naming
    its state and log.
    """
    if getattr(job, "_cancel_command", "") != "scancel":  # not a slurm job: submitit knows
        return job.result()
    gone_since = None
    while not job.paths.result_pickle.exists():
        state = _queue_state(str(job.job_id))
        if state is None or state in _RUNNING:
            gone_since = None
        elif gone_since is None:
            gone_since = time.time()
        elif time.time() - gone_since > grace_s:  # the result file may lag on a shared disk
            how = f"ended {state}" if state else "left the queue"
            raise RuntimeError(f"slurm job {job.job_id} {how} without a result (cancelled, out "
                               f"of time or memory?); see {job.paths.stderr}")
        time.sleep(poll_s)
        poll_s = min(poll_s * 1.5, 30.0)
    return job.result()


def _queue_state(job_id: str) -> str | None:
    """The job's state per `squeue` ('' once Slurm has forgotten it), None if Slurm did not
    answer (then nothing is concluded)."""
    try:
        out = subprocess.run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return "" if "invalid job id" in out.stderr.lower() else None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else ""


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
    threads = study.executor.threads or _job_cpus()  # else torch takes every core of the node
    study = dataclasses.replace(study, executor=dataclasses.replace(study.executor,
                                                                    threads=threads))
    run_arm_stage(study, stage, arm)  # _outcome raises with the failures it recorded
    if _outcome(Study(study, log=lambda s: None), stage, arm) == "skipped":
        return "skipped"
    return {"seconds": time.time() - start, "cpu_seconds": time.process_time() - cpu}
