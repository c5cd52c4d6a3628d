"""The folder of one study: its paths, the resolved config of each arm, and the record of its
stages (status.json: each stage's latest outcome; stages.jsonl: every run of a stage, with its
wall and CPU time). Every stage reads and writes the folder through `Study`; what runs the stages
(`mlsm.study.runner`, `executors`) sits above it, what each stage does beside it (`preparation`,
`stages`), and what decides whether a recorded stage may be reused in `mlsm.study.reuse`.
"""

from __future__ import annotations

import copy
import dataclasses
import fcntl
import json
import os
import resource
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlsm import locking
from mlsm.artifacts.jsonl import append_jsonl, read_jsonl
from mlsm.artifacts.run_spec import readiness_step
from mlsm.artifacts.rundir import RunDir
from mlsm.config import config_to_dict, merge
from mlsm.errors import UserError
from mlsm.fileio import atomic_write_text
from mlsm.inputs import field_problem, loads, read_json
from mlsm.progress import owned_by
from mlsm.provenance import git_revision
from mlsm.run_config import RunConfig, config_from_dict
from mlsm.study.hypotheses import RECORD
from mlsm.study.sameness import fingerprint_of, record_matches
from mlsm.study.spec import StudySpec, arm_base, arm_dictionary, readiness_label

_STAGE_RUN = {"stage": "text", "arm": "text?", "seconds": "number", "cpu_seconds": "number?"}
"""The fields of a stages.jsonl row that readers use."""

class Study:
    """Paths and bookkeeping of one study folder."""

    def __init__(self, spec: StudySpec, log: Callable[[str], None] = print,
                 in_job: bool = False, create: bool = True):
        """create: make the study folder (False: only resolve paths and configs, as
        `mlsm study --print` does, which writes nothing)."""
        self.spec = spec
        self.in_job = in_job  # inside a slurm job of the study: stages run here, never as jobs
        self.root = spec.root
        self._log, self._log_lock = log, threading.Lock()
        if create:
            self.root.mkdir(parents=True, exist_ok=True)
        self._child_cpu = threading.local()
        self.failures: list[tuple[str, str]] = []  # (stage key, error) failed in this command
        self.points: tuple[float, ...] | None = None  # readiness points evaluated here; None: all
        self.heads: tuple[str, ...] | None = None  # probe heads fitted here (`at`); None: all
        self.pieces: tuple[str, ...] = ()
        """The published pieces this folder was assembled from (`publish.report_pieces`): no
        checkpoint is here, and every row was current when its piece was published."""

    def at(self, point: float | None, head: str | None = None) -> Study:
        """This study with its evaluation stages restricted to one readiness point (what one
        evaluation chain of an arm runs, `runner._chains`); None: every point. `head`: the probe
        stage fits that probe head only (latent, or a readout control; None: every head). The
        view shares the folder, the log and the failures of this command."""
        view = copy.copy(self)
        view.points = None if point is None else (point,)
        view.heads = None if head is None else (head,)
        return view

    def evaluated(self, fracs: list[float]) -> list[float]:
        """The readiness points of `fracs` that this study's evaluation stages run (`at`)."""
        return [f for f in fracs if self.points is None or f in self.points]

    def log(self, line: str) -> None:
        """One line to the study's log. The arms' stages log from threads at once, and `print`
        writes a line and its newline separately, so two lines could share one (`start[study]`)."""
        with self._log_lock:
            self._log(line)

    # --- paths ---------------------------------------------------------------------------
    @property
    def store(self) -> Path:
        return self.root / "store"

    @property
    def results(self) -> Path:
        return self.root / "results.jsonl"

    def result_rows(self, warn: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
        """The fine-tuning rows of results.jsonl (`read_results`: a line torn by a killed job is
        skipped and named to `warn`); none before the first row is written."""
        from mlsm.artifacts.results_file import read_results

        if not self.results.is_file() or not self.results.read_bytes().strip():
            return []
        return read_results(self.results, warn=warn)

    def run_dir(self, arm: str) -> Path:
        return self.root / "runs" / arm

    def owns(self, label: str | None) -> bool:
        """Whether a record named `label` (an arm as records write it: ARM, ARM@P% or
        ARM@P%/HEAD; None for the study's own, such as the store) is of this study's arms or of
        none: a piece restricted to some arms (`only_arms`) reads their records only."""
        return label is None or label.partition("@")[0].partition("/")[0] in self.spec.arms

    def dictionary_path(self, arm: str) -> Path | None:
        d = self.spec.arms[arm].dictionary
        if d is None:
            return None
        teacher = (self.spec.dictionary.teacher or "minilm").rstrip("/").replace("/", "_")
        c = arm_dictionary(self.spec, arm)  # the arm's k, lam and controls, else the study's
        name = f"{teacher}_l{d.layer}_k{c.k or 0}_lam{c.lam:g}"
        # the controls, each its own dictionary (a learned one keeps its name of before)
        name += "" if c.atoms == "learned" else f"_atoms-{c.atoms}"
        name += "" if c.teacher_init == "pretrained" else \
            f"_teacher-{c.teacher_init}-s{c.teacher_seed}"
        return self.root / "dictionaries" / f"{name}.safetensors"

    def targets_path(self, arm: str) -> Path | None:
        """The target store of the arm's dictionary (`dictionary.targets: true`), one per
        (dictionary, max_len): shared by every arm and seed using it; None = online targets."""
        path = self.dictionary_path(arm)
        d = self.spec.arms[arm].dictionary
        if path is None or d is None or not d.targets:
            return None
        max_len = config_from_dict(arm_base(self.spec, arm)).data.max_len
        return self.root / "targets" / f"{path.stem}_len{max_len}"

    def steps(self, arm: str) -> int:
        return self.arm_config(arm).train.steps

    def checkpoint(self, arm: str, frac: float) -> Path:
        step = readiness_step(frac, self.steps(arm))
        return RunDir(self.run_dir(arm)).checkpoint_folder(step)

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
        a, base = self.spec.arms[arm], arm_base(self.spec, arm)
        given = a.objective  # what the arm sets itself wins over the study's dictionary
        objective: dict[str, Any] = {}
        path = self.dictionary_path(arm)
        if path is not None and a.dictionary is not None:
            targets = self.targets_path(arm)
            study_set = {"dictionary": str(path), "layer": a.dictionary.layer,
                         "teacher": self.spec.dictionary.teacher,
                         "targets": str(targets) if targets else "", **self._teacher_init(arm)}
            objective = {k: v for k, v in study_set.items()  # "" = the recipe's
                         if k not in given and (v or k not in ("teacher", "targets"))}
        elif self.spec.dictionary.teacher and "teacher" not in given and \
                _reads_states(base["objective"].get("name")):
            # a dense control (feature_kd) reads the same teacher's states as the MLSM arms
            objective = {"teacher": self.spec.dictionary.teacher}
        fixed = {"data": {"store": str(self.store)},
                 "train": {"out": str(self.run_dir(arm)), "readiness": list(self.spec.readiness)}}
        if self.spec.executor.threads:
            fixed["train"]["threads"] = self.spec.executor.threads
        return config_from_dict(merge(base, {**fixed, "objective": objective}))

    def _teacher_init(self, arm: str) -> dict[str, Any]:
        """objective.teacher_init / teacher_seed of an arm whose dictionary is of the random
        teacher; {} for the pre-trained one (the objective's default: configs stay as they were)."""
        c = arm_dictionary(self.spec, arm)
        if c.teacher_init == "pretrained":
            return {}
        return {"teacher_init": "random", "teacher_seed": c.teacher_seed}

    # --- bookkeeping ---------------------------------------------------------------------
    def stage_runs(self) -> list[dict[str, Any]]:
        """Every run of a stage, oldest first, as stages.jsonl keeps them (`_append_time`):
        stage, arm (None for the study's own), state, wall `seconds`, `cpu_seconds` (None in rows
        written before it was kept), ... A line torn by a killed writer is skipped with a
        warning; a row of another shape is one line naming the file and line. Only the rows
        of the study's arms or of none (`owns`)."""
        path = self.root / "stages.jsonl"
        found = read_jsonl(path, "study log", "remove or fix that line",
                           warn=lambda text: self.log(f"[study] warning: {text}"))
        for number, row in found.rows:
            wrong = field_problem(row, _STAGE_RUN)
            if wrong:
                raise UserError(f"{path}:{number} is not a row the study wrote ({wrong}); "
                                "remove or fix that line")
        return [row for _, row in found.rows if self.owns(row["arm"])]

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

    def owned_status(self) -> dict[str, Any]:
        """status.json's records of this study's arms or of none (`owns`; keys STAGE:LABEL)."""
        return {k: v for k, v in self.status().items() if self.owns(k.partition(":")[2] or None)}

    def set_status(self, key: str, value: dict[str, Any]) -> None:
        """Record one stage's outcome. A locked read-modify-write: local jobs (threads) and slurm
        jobs (processes, maybe on other nodes of a shared file system) update the same file,
        and an unlocked update would drop the records another writer added meanwhile."""
        path = self.root / "status.json"
        with locking.exclusive(self.root / ".status.json.lock"):
            status = self.status()
            status[key] = value
            atomic_write_text(path, json.dumps(status, indent=2) + "\n")

    def drop_status(self, key: str) -> None:
        """Forget one stage's record (under the lock of `set_status`), e.g. one that newer
        records of the same work replace."""
        with locking.exclusive(self.root / ".status.json.lock"):
            status = self.status()
            if status.pop(key, None) is not None:
                atomic_write_text(self.root / "status.json", json.dumps(status, indent=2) + "\n")

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
        self._child_cpu.inputs = None  # what the stage notes of its inputs (`note_inputs`)
        self.log(f"[study] {key}: start")
        try:
            with owned_by(key):  # its progress lines name the stage and model
                outcome = fn()
        except Exception as exc:  # one arm's failure must not stop the others
            extra.update(self._fingerprint_record())
            seconds = time.time() - start
            message = f"{type(exc).__name__}: {exc}"
            self.set_status(key, {"state": "failed", "error": message,
                                  "seconds": round(seconds, 1), **extra})
            self._append_time(name, arm, seconds, self._cpu_since(cpu0), "failed", message, extra)
            self.log(f"[study] {key}: FAILED ({message})")
            self.failures.append((key, message))
            if not isinstance(exc, UserError):
                self._log_traceback(key)
            return False
        extra.update(self._fingerprint_record())
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

    # --- reuse ---------------------------------------------------------------------------
    def note_inputs(self, inputs: dict[str, Any]) -> None:
        """What decides the running stage's result (`mlsm.study.reuse`): recorded with its
        outcome in status.json and stages.jsonl as `inputs` and their `fingerprint`."""
        self._child_cpu.inputs = inputs

    def _fingerprint_record(self) -> dict[str, Any]:
        inputs = getattr(self._child_cpu, "inputs", None)
        return {} if inputs is None else {"fingerprint": fingerprint_of(inputs), "inputs": inputs}

    def reusable(self, key: str, inputs: dict[str, Any], outputs: list[Path],
                 moved: list[Path] | None = None,
                 supersede: Callable[[], None] | None = None) -> bool:
        """Whether stage `key` (STAGE:MODEL) is done for these `inputs`: its record says done
        with their fingerprint and every one of its `outputs` exists. If not, what it made from
        other inputs (or under a record without a fingerprint, written before mlsm kept them) is
        moved to STUDY/superseded/: `moved` (default: the outputs; e.g. the whole folder whose
        record file is the output), and `supersede` does it for what is not a whole file (rows
        of results.jsonl) and a `started` record with the fingerprint is written, so that an
        interrupted run of the same inputs resumes instead of starting over."""
        self.note_inputs(inputs)
        if self.is_done(key, inputs, outputs):
            return True
        record = self.status().get(key, {})
        if not record_matches(record, inputs):
            self.supersede([p for p in (outputs if moved is None else moved) if p.exists()])
            if supersede is not None:
                supersede()
        self.set_status(key, {"state": "started", **self._fingerprint_record()})
        return False

    def is_done(self, key: str, inputs: dict[str, Any], outputs: list[Path]) -> bool:
        """Whether stage `key`'s record says done with the fingerprint of `inputs` and their
        data (`sameness.same_data`), and every one of its `outputs` exists."""
        record = self.status().get(key, {})
        return record.get("state") == "done" and all(p.exists() for p in outputs) and \
            record_matches(record, inputs)

    def supersede_rows(self, arm: str) -> int:
        """Move the fine-tuning rows of the arm's models (ARM@READINESS) from results.jsonl to
        STUDY/superseded/results.jsonl; returns how many. Under the lock every writer of
        results.jsonl takes (`append_results`), rewritten in place (a writer waiting for the lock
        holds the file open and appends to it, so the file is not replaced); the rows are copied
        out before the file is cut, so a kill loses none of them."""
        if not self.results.is_file():
            return 0
        with open(self.results, "r+", encoding="utf-8") as fh:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)  # released when the file closes
            lines = fh.read().splitlines(keepends=True)
            mine = [line for line in lines if _model_arm(line) == arm]
            if not mine:
                return 0
            old = self.root / "superseded" / "results.jsonl"
            old.parent.mkdir(parents=True, exist_ok=True)
            with old.open("a", encoding="utf-8") as out:
                out.write("".join(line if line.endswith("\n") else line + "\n" for line in mine))
                out.flush()
                os.fsync(out.fileno())
            fh.seek(0)
            fh.truncate()
            fh.write("".join(line for line in lines if _model_arm(line) != arm))
            fh.flush()
            os.fsync(fh.fileno())
        self.log(f"[study] results.jsonl: {len(mine)} fine-tuning rows of {arm} were made from "
                 "other inputs or settings, moved to superseded/results.jsonl")
        return len(mine)

    def supersede(self, paths: list[Path]) -> Path | None:
        """Move `paths` (inside the study folder) to STUDY/superseded/<UTC time>/<same path>: they
        were made from other inputs or settings, so the report must not read them, and what took
        time to make is kept rather than deleted. Returns that folder (None: nothing moved). A
        path superseded again within the same second goes to <UTC time>-2 (-3, ...): what an
        earlier move kept is never replaced."""
        if not paths:
            return None
        stamp, n = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()), 1
        folder = self.root / "superseded" / stamp
        while any((folder / p.relative_to(self.root)).exists() for p in paths):
            n += 1
            folder = self.root / "superseded" / f"{stamp}-{n}"
        for path in paths:
            target = folder / path.relative_to(self.root)
            target.parent.mkdir(parents=True, exist_ok=True)
            path.replace(target)
            self.log(f"[study] {path.relative_to(self.root)}: made from other inputs or "
                     f"settings, moved to {target.relative_to(self.root)}")
        return folder

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

    def _log_traceback(self, key: str) -> None:
        """Append the failed stage's traceback to errors.log; a full disk here must not hide the
        failure itself, which status.json and the console already carry."""
        try:
            with (self.root / "errors.log").open("a", encoding="utf-8") as fh:
                fh.write(f"--- {key}\n{traceback.format_exc()}\n")
        except OSError as exc:
            self.log(f"[study] {key}: its traceback was not written to errors.log ({exc})")

    def _append_time(self, stage: str, arm: str | None, seconds: float, cpu: float | None,
                     state: str, error: str = "", extra: dict[str, Any] | None = None) -> None:
        row = {"stage": stage, "arm": arm, "seconds": round(seconds, 1),
               "cpu_seconds": None if cpu is None else round(cpu, 1), "state": state,
               "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "git_revision": git_revision(), **(extra or {})}
        if error:
            row["error"] = error
        append_jsonl(self.root / "stages.jsonl", [row])


def _cpu_now() -> tuple[float, float]:
    """(user + sys of this process, of its reaped children) in seconds. The process's figure
    counts every thread, so a stage running while another thread's stage waits on a subprocess
    (local executor, jobs > 1) is charged the little CPU that waiting costs."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def _model_arm(line: str) -> str | None:
    """The arm of a results.jsonl row's model (ARM@READINESS), None for a line that is not one."""
    try:
        row = loads(line)
    except json.JSONDecodeError:
        return None
    model = row.get("model") if isinstance(row, dict) else None
    return model.rpartition("@")[0] if isinstance(model, str) and "@" in model else None


def _reads_states(objective: Any) -> bool:
    """The objective reads the study teacher's hidden states (it declares `uses_teacher` and
    `predicts_latent`: MLSM's family and feature_kd; not logit KD, whose teacher is a masked LM
    of its own)."""
    from mlsm.objectives import objective_class

    cls = objective_class(objective)
    return bool(cls and cls.uses_teacher and cls.predicts_latent)


def pretrain_done(study: Study, arm: str) -> bool:
    """The arm's last checkpoint is there (in a folder of published pieces, which holds none:
    its metrics reached the last step)."""
    from mlsm.artifacts.checkpoint import list_checkpoints

    if study.pieces:
        rows = RunDir(study.run_dir(arm)).metric_rows(warn=lambda m: None)
        return bool(rows) and rows[-1].get("step") == study.steps(arm)
    return study.steps(arm) in {s for s, _ in list_checkpoints(study.run_dir(arm))}


OUTPUTS = ("store", "dictionaries", "targets", "runs", "configs", "logs", "slurm", "blimp",
           "comparison", "results.jsonl", "report.md", "summary.json", "status.json",
           "stages.jsonl", "study.json", "errors.log", "pretraining.png", "readiness.png",
           "wilcoxon.png", "blimp_flops.png", ".status.json.lock", RECORD, "readouts",
           "readouts_steps.png", "readouts_flops.png", "superseded", "retrieval_cache")
"""What a study writes into its folder (a corpus source may not be, hold or lie inside one)."""
REPORT_OUTPUTS = ("report.md", "summary.json", "pretraining.png", "readiness.png",
                   "wilcoxon.png", "blimp_flops.png", "comparison", "readouts_steps.png",
                   "readouts_flops.png")


def only_arms(spec: StudySpec, arms: list[str] | None) -> StudySpec:
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
