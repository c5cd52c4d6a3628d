"""The stages of a study, each skipped when its output is complete.

store -> dictionaries (one per (teacher, layer, k, lam), shared by arms) -> pre-training per arm ->
probes (latent arms, at the BLiMP readiness points) -> fine-tuning of readiness checkpoints ->
BLiMP -> report. A failing arm is recorded in STUDY_OUT/status.json and the other arms go on; every
stage's wall time and CPU time (user + sys of this process and of the subprocesses it ran) is
appended to STUDY_OUT/stages.jsonl, so the report can state what each cost, also on a loaded
machine where wall time says little.
Re-running the same command resumes: finished stages are skipped, an interrupted run continues
from its last checkpoint (batches depend only on (data.seed, step)).
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlsm import locking, tracking
from mlsm.config import config_to_dict, git_revision, merge
from mlsm.defaults import LAM, TEACHER_LAYER, default_k
from mlsm.errors import Incomplete, UserError
from mlsm.fileio import atomic_write_text
from mlsm.inputs import read_json, read_yaml
from mlsm.run_config import RunConfig, config_from_dict
from mlsm.runs import readiness_step
from mlsm.study.hypotheses import RECORD, record_preregistration
from mlsm.study.spec import StudySpec, arm_base, check_arm_dictionary, readiness_label

_VOLATILE = (("train", "threads"), ("train", "device"))
"""Config keys that may change between a run and its resumption (they do not change the result)."""


class Study:
    """Paths and bookkeeping of one study folder."""

    def __init__(self, spec: StudySpec, log: Callable[[str], None] = print,
                 in_job: bool = False):
        self.spec = spec
        self.in_job = in_job  # inside a slurm job of the study: stages run here, never as jobs
        self.root = spec.root
        self.log = log
        self.root.mkdir(parents=True, exist_ok=True)
        self._child_cpu = threading.local()
        self.failures: list[tuple[str, str]] = []  # (stage key, error) failed in this command

    # --- paths ---------------------------------------------------------------------------
    @property
    def store(self) -> Path:
        return self.root / "store"

    @property
    def results(self) -> Path:
        return self.root / "results.jsonl"

    def run_dir(self, arm: str) -> Path:
        return self.root / "runs" / arm

    def dictionary_path(self, arm: str) -> Path | None:
        d = self.spec.arms[arm].dictionary
        if not d:
            return None
        teacher = (self.spec.dictionary.teacher or "minilm").rstrip("/").replace("/", "_")
        layer, lam = d.get("layer", TEACHER_LAYER), d.get("lam", LAM)
        name = f"{teacher}_l{layer}_k{d.get('k', 0)}_lam{lam:g}"
        return self.root / "dictionaries" / f"{name}.safetensors"

    def targets_path(self, arm: str) -> Path | None:
        """The target store of the arm's dictionary (`dictionary.targets: true`), one per
        (dictionary, max_len): shared by every arm and seed using it; None = online targets."""
        path = self.dictionary_path(arm)
        if path is None or not self.spec.arms[arm].dictionary.get("targets"):
            return None
        max_len = config_from_dict(arm_base(self.spec, arm)).data.max_len
        return self.root / "targets" / f"{path.stem}_len{max_len}"

    def steps(self, arm: str) -> int:
        return self.arm_config(arm).train.steps

    def checkpoint(self, arm: str, frac: float) -> Path:
        step = readiness_step(frac, self.steps(arm))
        return self.run_dir(arm) / "checkpoints" / f"step-{step:07d}"

    def probe_dir(self, arm: str, frac: float) -> Path:
        return self.run_dir(arm) / f"probe-{readiness_label(frac).rstrip('%')}"

    def is_latent(self, arm: str) -> bool:
        """The arm's model predicts latent properties and needs a probe to score words (its
        objective declares `predicts_latent`)."""
        from mlsm.objectives import objective_class

        cls = objective_class(self.objective(arm).get("name"))
        return bool(cls and cls.predicts_latent)

    def unscored_reason(self, arm: str, frac: float) -> str | None:
        """Why the arm's checkpoint at readiness `frac` gets no probe and no BLiMP score (its
        objective declares it for that step: `Objective.pll_refusal_at`; MAE-LM, MAE-MLSM, CLM,
        CLM -> MLM in its CLM phase), or None when it is scored."""
        from mlsm.objectives import objective_class

        objective = self.objective(arm)
        cls = objective_class(objective.get("name"))
        steps = self.steps(arm)
        why = cls and cls.pll_refusal_at(objective, readiness_step(frac, steps), steps)
        return f"{objective.get('name')} is scored by fine-tuning only: {why}" if why else None

    # --- configs -------------------------------------------------------------------------
    def objective(self, arm: str) -> dict[str, Any]:
        """The arm's resolved objective group (its recipe's, base's and its own keys)."""
        return config_to_dict(self.arm_config(arm))["objective"]

    def arm_config(self, arm: str) -> RunConfig:
        """The resolved run config of an arm: its recipe, base, the arm's overrides and objective
        (`arm_base`), then the study's store, run folder, readiness and dictionary."""
        a = self.spec.arms[arm]
        given = a.objective  # what the arm sets itself wins over the study's dictionary
        objective: dict[str, Any] = {}
        path = self.dictionary_path(arm)
        if path is not None:
            targets = self.targets_path(arm)
            study_set = {"dictionary": str(path),
                         "layer": int(a.dictionary.get("layer", TEACHER_LAYER)),
                         "teacher": self.spec.dictionary.teacher,
                         "targets": str(targets) if targets else ""}
            objective = {k: v for k, v in study_set.items()  # "" = the recipe's
                         if k not in given and (v or k not in ("teacher", "targets"))}
        fixed = {"data": {"store": str(self.store)},
                 "train": {"out": str(self.run_dir(arm)), "readiness": list(self.spec.readiness)}}
        if self.spec.executor.threads:
            fixed["train"]["threads"] = self.spec.executor.threads
        return config_from_dict(merge(arm_base(self.spec, arm), {**fixed, "objective": objective}))

    # --- bookkeeping ---------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        path = self.root / "status.json"
        if not path.exists():
            return {}
        fix = "restore it, or delete it to let the study redo its bookkeeping"
        status = read_json(path, "study status", fix)
        wrong = next((k for k, v in status.items() if not isinstance(v, dict)), None)
        if wrong is not None:
            raise UserError(f"study status {path}: entry {wrong!r} must be an object like "
                            f'{{"state": "done"}}; {fix}')
        return status

    def set_status(self, key: str, value: dict[str, Any]) -> None:
        """Record one stage's outcome. A locked read-modify-write: local jobs (threads) and slurm
        jobs (processes, maybe on other nodes of a shared file system) update the same file,
        and an unlocked update would drop the records another writer added meanwhile."""
        path = self.root / "status.json"
        with locking.exclusive(self.root / ".status.json.lock"):
            status = self.status()
            status[key] = value
            atomic_write_text(path, json.dumps(status, indent=2) + "\n")

    def add_child_cpu(self, seconds: float) -> None:
        """CPU seconds of a subprocess the current stage ran and reaped itself (`os.wait4`): its
        exact cost, where RUSAGE_CHILDREN would also count another thread's stage's children."""
        self._child_cpu.seconds = (getattr(self._child_cpu, "seconds", None) or 0.0) + seconds

    def stage(self, name: str, fn: Callable[[], Any], arm: str | None = None,
              record: dict[str, Any] | None = None) -> bool:
        """Run one stage, time it (wall and CPU), record success or failure; False when it failed.

        fn returns "skipped" (its output was complete), None, or {"seconds": s} when the work ran
        elsewhere and measured itself (a slurm job: the driver's wait is not the stage's time, and
        its CPU is not the driver's). record: kept with the stage's status and time rows (e.g. the
        slurm job that ran it)."""
        key = f"{name}:{arm}" if arm else name
        extra = dict(record or {})
        start, cpu0 = time.time(), _cpu_now()
        self._child_cpu.seconds = None
        self.log(f"[study] {key}: start")
        try:
            outcome = fn()
        except Exception as exc:  # one arm's failure must not stop the others
            seconds = time.time() - start
            message = f"{type(exc).__name__}: {exc}"
            self.set_status(key, {"state": "failed", "error": message,
                                  "seconds": round(seconds, 1), **extra})
            self._append_time(name, arm, seconds, self._cpu_since(cpu0), "failed", message, extra)
            self.log(f"[study] {key}: FAILED ({message})")
            self.failures.append((key, message))
            if not isinstance(exc, UserError):
                (self.root / "errors.log").open("a").write(f"--- {key}\n{traceback.format_exc()}\n")
            return False
        skipped = outcome == "skipped"
        elsewhere = isinstance(outcome, dict)
        seconds = outcome["seconds"] if elsewhere else time.time() - start
        cpu = outcome.get("cpu_seconds") if elsewhere else self._cpu_since(cpu0)
        if not skipped:
            self._append_time(name, arm, seconds, cpu, "done", "", extra)
        self.set_status(key, {"state": "done",
                              **({} if skipped else {"seconds": round(seconds, 1)}), **extra})
        cpu_note = f" ({cpu:.0f} s CPU)" if cpu is not None else ""
        self.log(f"[study] {key}: " + ("already complete" if skipped
                                       else f"done in {seconds:.0f} s{cpu_note}"))
        return True

    def skip(self, name: str, arm: str, reason: str) -> None:
        """Record that stage `name` does not apply to `arm` (model name), and why: neither run
        nor failed."""
        self.set_status(f"{name}:{arm}", {"state": "skipped", "reason": reason})
        self.log(f"[study] {name}:{arm}: skipped ({reason})")

    def _cpu_since(self, start: tuple[float, float]) -> float:
        """CPU seconds since `start` (`_cpu_now`): this process's, plus the subprocesses the
        stage reported through `add_child_cpu`, else all children reaped meanwhile."""
        own, children = _cpu_now()
        reported = getattr(self._child_cpu, "seconds", None)
        return own - start[0] + (children - start[1] if reported is None else reported)

    def _append_time(self, stage: str, arm: str | None, seconds: float, cpu: float | None,
                     state: str, error: str = "", extra: dict[str, Any] | None = None) -> None:
        row = {"stage": stage, "arm": arm, "seconds": round(seconds, 1),
               "cpu_seconds": None if cpu is None else round(cpu, 1), "state": state,
               "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "git_revision": git_revision(), **(extra or {})}
        if error:
            row["error"] = error
        with (self.root / "stages.jsonl").open("a") as fh:
            fh.write(json.dumps(row) + "\n")


def _cpu_now() -> tuple[float, float]:
    """(user + sys of this process, of its reaped children) in seconds. The process's figure
    counts every thread, so a stage running while another thread's stage waits on a subprocess
    (local executor, jobs > 1) is charged the little CPU that waiting costs."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def check_same_config(study: Study, arm: str, cfg: RunConfig) -> None:
    """A run folder written with a different resolved config is an error naming the arm and key.
    A config.yaml that is torn or of the wrong shape (hand-edited) is not compared: `pretrain`
    rewrites it on resume and checks the config of the checkpoint it resumes from instead."""
    saved_path = study.run_dir(arm) / "config.yaml"
    if not saved_path.is_file():
        return
    try:
        saved = read_yaml(saved_path, "run config", "")
    except UserError:
        return
    if not isinstance(saved, dict):
        return
    saved = {group: keys for group, keys in saved.items() if isinstance(keys, dict)}
    now = config_to_dict(cfg)
    for group, key in _VOLATILE:
        for config in (saved, now):
            config.get(group, {}).pop(key, None)
    diff = _first_difference(saved, now)
    if diff:
        key, old, new = diff
        raise UserError(f"arm {arm}: {key} is {new!r} in the study file but {old!r} in "
                        f"the run already in {study.run_dir(arm)}; restore it, or rename the arm / "
                        "delete that run to train anew")


def _first_difference(a: Any, b: Any, prefix: str = "") -> tuple[str, Any, Any] | None:
    if isinstance(a, dict) and isinstance(b, dict):
        # a key only in `b` is a config field added to mlsm since the run: its default applies
        for key in sorted(a):
            diff = _first_difference(a.get(key), b.get(key), f"{prefix}.{key}" if prefix else key)
            if diff:
                return diff
        return None
    return None if a == b else (prefix, a, b)


def pretrain_done(study: Study, arm: str) -> bool:
    from mlsm.train.checkpoint import list_checkpoints

    return study.steps(arm) in {s for s, _ in list_checkpoints(study.run_dir(arm))}


def pretrain_arm(study: Study, arm: str, threads: int | None = None) -> str | None:
    """Pre-train one arm unless its final checkpoint exists; resume an interrupted run.
    threads: torch threads for this process (default: the arm config's, executor.threads)."""
    from mlsm.train.loop import pretrain

    cfg = study.arm_config(arm)
    if threads:  # train.threads is volatile: a resume with another count is the same run
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, threads=threads))
    check_same_config(study, arm, cfg)
    if pretrain_done(study, arm):
        return "skipped"
    started = (study.run_dir(arm) / "metrics.jsonl").exists()
    pretrain(cfg, resume="auto" if started else None)
    if not pretrain_done(study, arm):  # `pretrain` returns early only when SIGTERM asked it to stop
        raise KeyboardInterrupt(f"pre-training of {arm} stopped by a signal; run the same "
                                "command to resume")
    return None


def prepare_store(study: Study) -> str | None:
    from mlsm.data.corpus import prepare_corpus
    from mlsm.teacher.teacher import default_teacher_path

    c = study.spec.corpus
    if not c.sources:
        raise UserError("corpus.sources is empty; list the corpus files of the study")
    done = (study.store / "meta.json").is_file()
    prepare_corpus(list(c.sources), c.tokenizer or str(default_teacher_path()), study.store,
                   text_field=c.text_field)
    return "skipped" if done else None


def learn_dictionary_for(study: Study, arm: str) -> str | None:
    from mlsm.data.corpus import TokenStore
    from mlsm.teacher.dictionary import learn_dictionary
    from mlsm.teacher.teacher import load_teacher

    path = study.dictionary_path(arm)
    assert path is not None
    if path.is_file() and path.with_suffix(".json").is_file():
        return "skipped"
    d, ds = study.spec.arms[arm].dictionary, study.spec.dictionary
    teacher = load_teacher(ds.teacher or None, int(d.get("layer", TEACHER_LAYER)))
    check_arm_dictionary(arm, d, ds.n_vectors, default_k(teacher.hidden_size))
    path.parent.mkdir(parents=True, exist_ok=True)
    learn_dictionary(TokenStore.open(study.store), teacher, k=d.get("k") or None,
                     lam=float(d.get("lam", LAM)),
                     n_vectors=ds.n_vectors, max_len=ds.max_len, seed=ds.seed, out=path)
    return None


def build_targets_for(study: Study, arm: str) -> str | None:
    """Build (or resume) the target store of the arm's dictionary over the study's token store:
    the codes of every position, whatever data order a seed draws (`mlsm targets`)."""
    from mlsm.locking import hold
    from mlsm.teacher.targets import build_target_store, check_targets_out
    from mlsm.teacher.teacher import load_teacher

    out, dictionary = study.targets_path(arm), study.dictionary_path(arm)
    assert out is not None and dictionary is not None
    if (out / "meta.json").is_file():
        return "skipped"
    out.parent.mkdir(parents=True, exist_ok=True)
    check_targets_out(out)
    layer = int(study.spec.arms[arm].dictionary.get("layer", TEACHER_LAYER))
    with hold(out, "target store"):
        teacher = load_teacher(study.spec.dictionary.teacher or None, layer)
        max_len = config_from_dict(arm_base(study.spec, arm)).data.max_len
        build_target_store(study.store, dictionary, teacher, max_len, out)
    return None


STAGES = ("store", "dictionary", "pretrain", "probe", "finetune", "blimp", "readout", "report")
"""Every stage of a study, in the order they run."""


OUTPUTS = ("store", "dictionaries", "targets", "runs", "configs", "logs", "slurm", "blimp",
           "comparison", "results.jsonl", "report.md", "summary.json", "status.json",
           "stages.jsonl", "study.json", "errors.log", "pretraining.png", "readiness.png",
           "wilcoxon.png", "blimp_flops.png", ".status.json.lock", RECORD, "readouts",
           "readouts_steps.png", "readouts_flops.png")
"""What a study writes into its folder (a corpus source may not be, hold or lie inside one)."""
_REPORT_OUTPUTS = ("report.md", "summary.json", "pretraining.png", "readiness.png",
                   "wilcoxon.png", "blimp_flops.png", "comparison", "readouts_steps.png",
                   "readouts_flops.png")


def run_study(spec: StudySpec, stages: list[str] | None = None, log: Callable[[str], None] = print,
              arms: list[str] | None = None, in_job: bool = False) -> Path | None:
    """Run every stage of a study that is not complete; returns the report path (None if not
    reached).

    arms: only these arms (what one slurm job or local subprocess of an evaluation stage runs);
    in_job: this is that job, so the stages run in this process whatever the executor.
    """
    spec = _only_arms(spec, arms)
    check_study_inputs(spec, in_job)  # before anything is written
    # one writer per study folder: a second `mlsm study` on it refuses; the stages' own
    # subprocesses and jobs run inside the holder's command (in_job, or the variable it sets)
    mine = in_job or os.environ.get(LOCK_VARIABLE) == str(locking.lock_path(spec.root))
    with locking.hold(spec.root, "study folder", enabled=not mine):
        return _run_study(spec, stages, log, arms, in_job)


LOCK_VARIABLE = "MLSM_STUDY_LOCK_HELD"
"""Set by a study for the `mlsm study --arms` subprocesses it starts: the lock it names is held
by their parent, so they write into its folder without taking it."""


def _run_study(spec: StudySpec, stages: list[str] | None, log: Callable[[str], None],
               arms: list[str] | None, in_job: bool) -> Path | None:
    study = Study(spec, log, in_job)
    if not arms:  # a job restricted to some arms leaves the study's own record alone
        record = {"spec": _plain(spec), "git_revision": git_revision()}
        atomic_write_text(study.root / "study.json", json.dumps(record, indent=2) + "\n")
        # the hypotheses' hash, before any stage can write an evaluation row (once: a later
        # change of the hypotheses is then visible to the report)
        record_preregistration(study.root, spec.hypotheses, git_revision())
    wanted = stages or list(STAGES)
    if "store" in wanted and not study.stage("store", lambda: prepare_store(study)):
        raise UserError(f"the token store could not be built: {_error_of(study, 'store')}")
    failed = _dictionaries(study) if "dictionary" in wanted else set()
    if "pretrain" in wanted:
        from mlsm.study.executors import run_pretraining

        failed |= run_pretraining(study, [a for a in spec.arms if a not in failed])
    _evaluations(study, wanted, [a for a in spec.arms
                                 if a not in failed and pretrain_done(study, a)])
    report = _report(study) if "report" in wanted else None
    if study.failures:  # the others finished; the exit status must still say it
        raise Incomplete(failure_summary(study), report)
    return report


def failure_summary(study: Study) -> str:
    """One line: how many stages failed in this command, which, the first error, and where the
    rest is recorded."""
    keys = [k for k, _ in study.failures]
    shown = ", ".join(keys[:6]) + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")
    first = " ".join(study.failures[0][1].split())
    first = first if len(first) <= 200 else first[:197] + "..."
    return (f"{len(keys)} stage{'s' if len(keys) > 1 else ''} of study {study.root} failed: "
            f"{shown} (first: {first}); the others finished. Errors are in "
            f"{study.root / 'status.json'} (tracebacks in {study.root / 'errors.log'}); fix "
            "them and re-run the same command, which redoes only what is not done")


def _only_arms(spec: StudySpec, arms: list[str] | None) -> StudySpec:
    """The study restricted to `arms` (all when None); an unknown arm is a one-line error."""
    if not arms:
        return spec
    if spec.seeds:  # an arm's name stands for all of its seeds' runs
        declared = {run.rpartition("-s")[0] for run in spec.arms}
        arms = [run for a in arms for run in ([f"{a}-s{s}" for s in spec.seeds]
                                              if a in declared and a not in spec.arms else [a])]
    unknown = [a for a in arms if a not in spec.arms]
    if unknown:
        raise UserError(f"unknown arm {unknown[0]!r}; the study's arms: {', '.join(spec.arms)}")
    return dataclasses.replace(spec, arms={a: spec.arms[a] for a in arms})


def check_study_inputs(spec: StudySpec, in_job: bool = False) -> None:
    """What is refused before a study writes anything: an `out` that is, holds or lies inside a
    corpus source, or that is no study's folder but holds files of a study's names; trackers
    that are not installed; a slurm executor without Slurm."""
    from mlsm.data.corpus import check_apart_from_sources

    # out itself may not be or lie inside a source; it may hold one (the demo keeps its
    # generated corpus in OUT/corpus) but not where the study writes
    fix = "set `out` in the study file (or --out) to a folder apart from the corpus"
    check_apart_from_sources([spec.root], list(spec.corpus.sources), "the study's out", fix,
                             contains=False, missing_ok=True)
    check_apart_from_sources([spec.root / name for name in OUTPUTS], list(spec.corpus.sources),
                             "the study's output", fix, missing_ok=True)
    # a folder that is no study's (no study.json) keeps what it holds: the report's files are
    # rewritten whole, so refuse them (the study's other files are read, and refused, by shape)
    clash = [n for n in _REPORT_OUTPUTS if (spec.root / n).exists()]
    if clash and not (spec.root / "study.json").is_file():
        raise UserError(f"out {spec.root} is not a study folder (no study.json) and holds "
                        f"{', '.join(clash)}, which the study would overwrite; choose an empty "
                        "or new folder (nothing was written)")
    for arm in spec.arms:
        train = arm_base(spec, arm).get("train")
        report_to = (train if isinstance(train, dict) else {}).get("report_to") or []
        tracking.require(list(report_to), f"base.train.report_to of the study file (arm {arm}, "
                                          "with its recipe and overrides)")
    if spec.executor.kind == "slurm" and not in_job:
        from mlsm.study.executors import check_slurm

        check_slurm(spec)


def _error_of(study: Study, key: str) -> str:
    """The recorded error of a failed stage, without the exception's class for a UserError."""
    return study.status()[key].get("error", "").removeprefix("UserError: ")


def _dictionaries(study: Study) -> set[str]:
    """Learn each dictionary once (arms sharing (teacher, layer, k, lam) share it), then each
    target store once (`dictionary.targets`); returns the arms whose dictionary or targets
    failed."""
    failed: set[str] = set()
    seen: dict[Path, bool] = {}
    for arm in study.spec.arms:
        path = study.dictionary_path(arm)
        if path is not None and path not in seen:
            seen[path] = study.stage("dictionary",
                                     lambda a=arm: learn_dictionary_for(study, a), arm)
        targets = study.targets_path(arm) if path is not None and seen[path] else None
        if targets is not None and targets not in seen:
            seen[targets] = study.stage("targets", lambda a=arm: build_targets_for(study, a), arm)
        if path is not None and not seen[path] or targets is not None and not seen[targets]:
            failed.add(arm)
    return failed


def _evaluations(study: Study, wanted: list[str], ok: list[str]) -> None:
    """Probe, fine-tuning and BLiMP of the arms whose pre-training is complete."""
    from mlsm.study.executors import run_evaluation

    no_probe = run_evaluation(study, "probe", ok) if "probe" in wanted else set()
    if "finetune" in wanted:
        run_evaluation(study, "finetune", ok)
    if "blimp" in wanted:  # a latent arm whose probe failed cannot be scored
        run_evaluation(study, "blimp", [a for a in ok if a not in no_probe])
    if "readout" in wanted:  # every arm: one without a probe is read by its linear probes
        run_evaluation(study, "readout", ok)


def _report(study: Study) -> Path:
    """Write the report; a failure is one line (with its cause) rather than a silent exit 0."""
    from mlsm.study.report import write_report

    report: list[Path] = []
    if not study.stage("report", lambda: report.append(write_report(study))):
        error = _error_of(study, "report")
        where = "" if study.status()["report"].get("error", "").startswith("UserError") else \
            f" (traceback in {study.root / 'errors.log'})"
        raise UserError(f"the report could not be written: {error}{where}")
    study.log(f"[study] report: {report[0]}")
    return report[0]


def _plain(spec: StudySpec) -> dict[str, Any]:
    return dataclasses.asdict(spec)
