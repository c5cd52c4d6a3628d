"""A study on Slurm: `executor.kind: slurm` submits one job per arm through submitit (Rapin & Jun
2019's launcher), with partition / GPUs / time from `executor.slurm`; the driver waits for the
jobs (the later stages depend on them) and records each arm's outcome. A pre-training job that
reaches its time limit is requeued by submitit and resumes from its newest checkpoint
(`PretrainJob`). A job with more than one GPU per node starts DDP through submitit's one task per
GPU (torch.distributed reads submitit's environment), which is what `torchrun` would do by hand.

submitit is an optional extra: nothing here imports it before a slurm study asks for it.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import time
from pathlib import Path
from typing import Any

from mlsm.config import config_to_dict
from mlsm.errors import UserError
from mlsm.run_config import config_from_dict
from mlsm.study.folder import Study, pretrain_done
from mlsm.study.preparation import pretrain_todo
from mlsm.study.reuse import pretrain_inputs
from mlsm.study.spec import StudySpec


def pretrain_job(config: dict[str, Any]) -> dict[str, Any]:
    """What one slurm job runs: continue (or start) the run; returns its directory and the
    seconds it took here."""
    from mlsm.train.loop import pretrain

    start, cpu = time.time(), time.process_time()
    cfg = config_from_dict(config)
    if not cfg.train.threads and job_cpus():  # torch would take every core of the node
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, threads=job_cpus()))
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


def job_cpus() -> int:
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


def slurm_pretraining(study: Study, arms: list[str]) -> set[str]:
    """Pre-train `arms` as one submitit job each; returns the arms that failed."""
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
