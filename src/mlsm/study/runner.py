"""The stages of a study, each skipped when its output is complete and its record's fingerprint
equals the current one (`mlsm.study.reuse`): the orchestrator, the only module that imports the
stages (`preparation`, `stages`), their executors and the report; the study folder is `folder`.

store -> dictionaries (one per (teacher, layer, k, lam), shared by arms) -> pre-training per arm ->
probes (latent arms, at the BLiMP readiness points) -> fine-tuning of readiness checkpoints ->
BLiMP -> readouts -> report (a local study whose evaluation runs in subprocesses runs each arm's
pre-training, then its evaluation as one chain per readiness point, side by side: `_chains`).
A failing arm is recorded in STUDY_OUT/status.json and the other arms go on; every stage's wall
time and CPU time (user + sys of this process and of the subprocesses it ran) is appended to
STUDY_OUT/stages.jsonl, so the report can state what each cost, also on a loaded machine where
wall time says little.
Re-running the same command resumes: finished stages are skipped, an interrupted run continues
from its last checkpoint (batches depend only on (data.seed, step)).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mlsm import locking
from mlsm.errors import Incomplete, UserError
from mlsm.fileio import atomic_write_text
from mlsm.provenance import git_revision
from mlsm.study.executors import (
    chained,
    eval_jobs,
    evaluation_subprocess,
    job_spec_file,
    pretrain_subprocess,
    run_chains,
    run_evaluation,
    run_pretraining,
)
from mlsm.study.folder import (
    OUTPUTS,
    REPORT_OUTPUTS,
    Study,
    only_arms,
    pretrain_done,
)
from mlsm.study.gates import FairGate, through
from mlsm.study.hypotheses import record_preregistration
from mlsm.study.preparation import build_targets_for, learn_dictionary_for, prepare_store
from mlsm.study.sameness import check_same_config
from mlsm.study.slurm import check_slurm
from mlsm.study.spec import StudySpec, arm_base, spec_record
from mlsm.study.stages import EVALUATIONS, probe_heads
from mlsm.train import tracking

__all__ = ["OUTPUTS", "STAGES", "Study", "check_same_config", "check_study_inputs",
           "run_study"]
_only_arms = only_arms  # the name tests and older callers use

STAGES = ("store", "dictionary", "pretrain", "probe", "finetune", "blimp", "readout", "report")
"""Every stage of a study, in the order they run."""


def run_study(spec: StudySpec, stages: list[str] | None = None, log: Callable[[str], None] = print,
              arms: list[str] | None = None, in_job: bool = False) -> Path | None:
    """Run every stage of a study that is not complete; returns the report path (None if not
    reached).

    arms: only these arms (what one slurm job or local subprocess of an evaluation stage runs);
    in_job: this is that job, so the stages run in this process whatever the executor.
    """
    whole, spec = spec, only_arms(spec, arms)
    check_study_inputs(spec, in_job)  # before anything is written
    # one writer per study folder: a second `mlsm study` on it refuses; the stages' own
    # subprocesses and jobs (in_job, `mlsm.study.job`) run inside the holder's command
    with locking.hold(spec.root, "study folder", enabled=not in_job, fix=_ONE_DRIVER):
        if not in_job:  # a job leaves the study's own record alone
            _record_study(whole)
        return _run_study(spec, stages, log, in_job)


_ONE_DRIVER = ("wait for it to finish, or stop it (Ctrl-C or SIGTERM: every stage resumes) and "
               "run the arms of both in one command (--arms A B ...), which runs them side by "
               "side up to the study's jobs")


def _record_study(spec: StudySpec) -> None:
    """STUDY_OUT/study.json (the whole study as loaded, also when `--arms` runs some of it: a
    piece run alone on a fresh machine is still that study's) and the hypotheses' hash, before
    any stage can write an evaluation row (once: a later change of the hypotheses is then
    visible to the report)."""
    spec.root.mkdir(parents=True, exist_ok=True)
    record = {"spec": spec_record(spec), "git_revision": git_revision()}
    atomic_write_text(spec.root / "study.json", json.dumps(record, indent=2) + "\n")
    record_preregistration(spec.root, spec.hypotheses, git_revision())


def _run_study(spec: StudySpec, stages: list[str] | None, log: Callable[[str], None],
               in_job: bool) -> Path | None:
    study = Study(spec, log, in_job)
    wanted = stages or list(STAGES)
    if "store" in wanted and not study.stage("store", lambda: prepare_store(study)):
        raise UserError(f"the token store could not be built: {_error_of(study, 'store')}")
    failed = _dictionaries(study) if "dictionary" in wanted else set()
    ready = [a for a in spec.arms if a not in failed]
    if chained(study, ready):
        _chains(study, wanted, ready)
    else:
        if "pretrain" in wanted:
            failed |= run_pretraining(study, ready)
        _evaluations(study, wanted, [a for a in ready
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
    clash = [n for n in REPORT_OUTPUTS if (spec.root / n).exists()]
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


def _evaluations(study: Study, wanted: list[str], ok: list[str],
                 run: Callable[[Study, str, list[str]], set[str]] = run_evaluation) -> None:
    """Probe, fine-tuning, BLiMP and readouts of the arms whose pre-training is complete; run:
    how one stage runs for those arms, returning the arms it failed."""
    no_probe = run(study, "probe", ok) if "probe" in wanted else set()
    if "finetune" in wanted:
        run(study, "finetune", ok)
    if "blimp" in wanted:  # a latent arm whose probe failed cannot be scored
        run(study, "blimp", [a for a in ok if a not in no_probe])
    if "readout" in wanted:  # every arm: one without a probe is read by its linear probes
        run(study, "readout", ok)


def _chains(study: Study, wanted: list[str], arms: list[str]) -> None:
    """Each arm's pre-training, then its evaluations as chains of their own, side by side: one
    per readiness point (probe, BLiMP and readout of that checkpoint: the later stages read its
    probe) and one for the fine-tuning grid. At most `jobs` pre-training and `eval_jobs`
    evaluation subprocesses run at once, and max(jobs, eval_jobs) of both together, each let
    through in the order it asked (`FairGate`). One chain per arm left a core idle for the last
    49 % of v2's seed pair while the MLSM arm's probes, BLiMP and readouts ran in a row. A point's
    probe heads (a latent arm's own and each readout control) are subprocesses of their own,
    side by side, and its BLiMP waits for all of them: in a row, v3's three probes of a latent
    arm were its longest stretch on one core."""
    train, evaluate = FairGate(study.spec.executor.jobs), FairGate(eval_jobs(study))
    slots = FairGate(max(study.spec.executor.jobs, eval_jobs(study)))  # the cores' share
    spec_file = job_spec_file(study) if set(wanted) & set(EVALUATIONS) else None

    def one(s: Study, stage: str, arms: list[str]) -> set[str]:
        assert spec_file is not None  # only stages in `wanted` run
        if stage == "probe" and s.points:  # each probe head in a subprocess of its own, at once
            views = [(s.at(s.points[0], h), a) for a in arms for h in probe_heads(s, a)]
        else:
            views = [(s, a) for a in arms]
        with ThreadPoolExecutor(max_workers=max(1, len(views))) as pool:
            return set().union(*pool.map(lambda v: evaluation_subprocess(
                v[0], stage, v[1], spec_file, through(evaluate, slots)), views))

    def chain(arm: str) -> None:
        if "pretrain" in wanted and not pretrain_subprocess(study, arm, through(train, slots)):
            return
        if not pretrain_done(study, arm):
            return
        at_points = [w for w in wanted if w != "finetune"]
        # the latest point first: its probe trains longest, so its chain is the longest
        branches = [lambda p=p: _evaluations(study.at(p), at_points, [arm], one)
                    for p in sorted(study.spec.readiness, reverse=True)]
        if "finetune" in wanted:
            branches.append(lambda: _evaluations(study, ["finetune"], [arm], one))
        with ThreadPoolExecutor(max_workers=len(branches)) as pool:
            list(pool.map(lambda branch: branch(), branches))  # re-raises what one raised

    def stop() -> None:  # a stopping study starts no further subprocess
        for gate in (train, evaluate, slots):
            gate.close()

    run_chains(arms, chain, stop)


def _report(study: Study) -> Path:
    """Write the report; a failure is one line (with its cause) rather than a silent exit 0."""
    from mlsm.study.report import write_report  # matplotlib: only when a report is written

    report: list[Path] = []
    if not study.stage("report", lambda: report.append(write_report(study))):
        error = _error_of(study, "report")
        where = "" if study.status()["report"].get("error", "").startswith("UserError") else \
            f" (traceback in {study.root / 'errors.log'})"
        raise UserError(f"the report could not be written: {error}{where}")
    study.log(f"[study] report: {report[0]}")
    return report[0]
