"""Where a study's pre-training runs: in this process, in N local subprocesses, or on slurm.

`local` with jobs = 1 pre-trains the arms one after the other in this process. With jobs > 1 each
arm is a `python -m mlsm pretrain --resume auto` subprocess with `executor.threads` torch threads,
`jobs` of them at once. `slurm` submits one job per arm through submitit (Rapin & Jun 2019's
launcher), with partition / GPUs / time from `executor.slurm`; the driver waits for the jobs
(the later stages depend on them) and records each arm's outcome. A job with more than one GPU
per node starts DDP through submitit's one task per GPU (torch.distributed reads submitit's
environment), which is what `torchrun` would do by hand.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mlsm.config import config_from_dict, config_to_dict, save_config
from mlsm.errors import UserError
from mlsm.study.runner import Study, check_same_config, pretrain_arm, pretrain_done


def run_pretraining(study: Study, arms: list[str]) -> set[str]:
    """Pre-train `arms` with the study's executor; returns the arms that failed."""
    kind, jobs = study.spec.executor.kind, study.spec.executor.jobs
    if kind == "slurm":
        return _slurm(study, arms)
    if jobs <= 1:
        return {a for a in arms
                if not study.stage("pretrain", lambda a=a: pretrain_arm(study, a), a)}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        ok = list(pool.map(
            lambda a: study.stage("pretrain", lambda: _subprocess_arm(study, a), a), arms))
    return {a for a, good in zip(arms, ok, strict=True) if not good}


def _subprocess_arm(study: Study, arm: str) -> str | None:
    """One arm as a `mlsm pretrain` subprocess (its own torch thread pool)."""
    cfg = study.arm_config(arm)
    check_same_config(study, arm, cfg)
    if pretrain_done(study, arm):
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
    with log.open("a") as fh:
        code, cpu = _call_measured(command, fh, env)
    study.add_child_cpu(cpu)
    if code != 0 or not pretrain_done(study, arm):
        raise RuntimeError(f"mlsm pretrain exited with {code}; see {log}")
    return None


def _call_measured(command: list[str], fh: Any, env: dict[str, str]) -> tuple[int, float]:
    """Run `command` to its end like `subprocess.call`; (exit code, its CPU seconds). The child is
    reaped with `os.wait4`, which returns its own resource usage: two arms run at once, and
    RUSAGE_CHILDREN could not tell their costs apart."""
    with subprocess.Popen(command, stdout=fh, stderr=subprocess.STDOUT, env=env) as proc:
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:  # as subprocess.call: an interrupted driver leaves no orphan
            proc.kill()
            raise
        proc.returncode = os.waitstatus_to_exitcode(status)
        return proc.returncode, usage.ru_utime + usage.ru_stime


def pretrain_job(config: dict[str, Any]) -> str:
    """What one slurm job runs: continue (or start) the run; returns its directory."""
    from mlsm.train.loop import pretrain

    return str(pretrain(config_from_dict(config), resume="auto"))


def make_executor(study: Study, cluster: str | None = None) -> Any:
    """A submitit executor configured from `executor.slurm` (cluster: None = auto, 'debug'/'local'
    for tests)."""
    try:
        import submitit
    except ImportError:
        raise UserError("executor.kind: slurm needs submitit; install it with pip "
                        "install 'mlsm[slurm]'") from None
    params = dict(study.spec.executor.slurm)
    folder = Path(params.pop("folder", study.root / "slurm"))
    cluster = params.pop("cluster", cluster)
    executor = submitit.AutoExecutor(folder=folder, cluster=cluster)
    native = ("timeout_min", "nodes", "gpus_per_node", "cpus_per_task", "tasks_per_node", "mem_gb")
    mapped = {k if k in native or executor.cluster != "slurm" else f"slurm_{k}": v
              for k, v in params.items()}
    if executor.cluster != "slurm":
        mapped = {k: v for k, v in mapped.items() if k in native}
    executor.update_parameters(name=f"mlsm-{study.spec.name}", **mapped)
    return executor


def _slurm(study: Study, arms: list[str]) -> set[str]:
    todo: list[str] = []

    # config checks and skips happen in the driver, before anything is queued
    def check(arm: str) -> str:
        check_same_config(study, arm, study.arm_config(arm))
        if not pretrain_done(study, arm):
            todo.append(arm)
        return "skipped"

    failed = {a for a in arms if not study.stage("pretrain-check", lambda a=a: check(a), a)}
    executor = make_executor(study)
    jobs = {arm: executor.submit(pretrain_job, config_to_dict(study.arm_config(arm)))
            for arm in todo}
    for arm, job in jobs.items():
        study.log(f"[study] pretrain:{arm}: submitted as job {job.job_id}")
    for arm, job in jobs.items():
        if not study.stage("pretrain", lambda j=job, a=arm: _wait(j, study, a), arm):
            failed.add(arm)
    return failed


def _wait(job: Any, study: Study, arm: str) -> None:
    job.result()  # raises submitit's FailedJobError with the job's traceback
    if not pretrain_done(study, arm):
        raise RuntimeError(f"slurm job {job.job_id} ended before the last step of {arm}")


def run_evaluation(study: Study, stage: str, arms: list[str]) -> set[str]:
    """Run an evaluation stage (probe, finetune, blimp) for `arms`; returns the arms that failed.

    Locally the stage runs here. On slurm each arm's stage is one job (`run_study` restricted to
    that arm and stage, so skip-if-complete and failure records work inside the job as here),
    submitted after pre-training finished and awaited before the next stage.
    """
    from mlsm.study import stages as st

    if study.spec.executor.kind != "slurm" or not arms:
        return getattr(st, f"run_{stage}")(study, arms)
    executor = make_executor(study)
    spec = dataclasses.asdict(study.spec)
    jobs = {arm: executor.submit(stage_job, spec, stage, arm) for arm in arms}
    failed = {a for a, job in jobs.items()
              if not study.stage(f"{stage}-job", lambda j=job: j.result() and None, a)}
    status = study.status()
    return failed | {a for a in arms
                     if any((k == f"{stage}:{a}" or k.startswith(f"{stage}:{a}@"))
                            and v.get("state") == "failed" for k, v in status.items())}


def stage_job(spec: dict[str, Any], stage: str, arm: str) -> bool:
    """What one evaluation job runs: that stage of that arm, in the same study folder."""
    from mlsm.study.runner import run_study
    from mlsm.study.spec import study_from_dict

    run_study(study_from_dict(spec), stages=[stage], arms=[arm])
    return True
