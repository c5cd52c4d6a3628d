"""A publishable copy of a study's results: `mlsm study report STUDY.yaml --to DIR`.

A study runs for hours (docs/results/cpu_replication_v2: about 2.8 h per seed pair on 2 CPUs) and
holds its folder's lock the whole time, so `mlsm study report` on the folder itself waits for the
end. Each finished piece should be readable, and committable, at once. This writes the report of
what is done *now* into another folder, with the evidence it was computed from, and changes
nothing in the study folder, so it needs no lock on it and can run beside the study:

- report.md, summary.json and the plots (`mlsm.study.report.write_report` into DIR);
- the rows the report reads: blimp/*.json, readouts/*.jsonl, results.jsonl, stages.jsonl,
  preregistration.json, and of every run its metrics.jsonl (metrics/ARM.jsonl) and probe records
  (probes/ARM@P%.json, the % written as "pct").

The publication lands whole: it is built in DIR/.mlsm-publish-staging and then renamed over
the earlier one under a marker (`_swap_in`), so a kill leaves the earlier publication, or a
folder the rerun recognises and repairs. Everything it copies is written whole (atomic
replace) or appended row by row under a lock by the study, so a copy taken while the study
runs is the study at some moment, never a torn file (a row torn by a killed writer is skipped
by every reader). The model checkpoints, token store and target store stay where they are:
they are gigabytes, and the report does not read them.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from mlsm.artifacts.outputs import report_kind, writing
from mlsm.artifacts.probe_record import has_probe_record, record_path
from mlsm.errors import UserError
from mlsm.fileio import atomic_write, fsync_path
from mlsm.inputs import real_path
from mlsm.study.folder import REPORT_OUTPUTS, Study
from mlsm.study.hypotheses import RECORD
from mlsm.study.reuse import stale_finetuning
from mlsm.study.spec import StudySpec, readiness_label

_COPIED = ("blimp", "readouts", "metrics", "probes", "results.jsonl", "stages.jsonl", RECORD)
STAGING = ".mlsm-publish-staging"  # the next publication, built whole inside DIR (hidden)
SWAPPING = ".mlsm-publish-swapping"  # present while the old entries are swapped for the new
_HEADED = report_kind("published study report", {*REPORT_OUTPUTS, *_COPIED}.__contains__,
                      {"report.md": "# Study `"})
KIND = dataclasses.replace(_HEADED, ours=lambda folder: (folder / SWAPPING).exists()
                           or bool(_HEADED.ours and _HEADED.ours(folder)))
"""What DIR may hold: the report's files and the copied evidence (a user's .git is left alone);
a folder a kill left half swapped (its SWAPPING marker) is ours too, so a rerun repairs it."""


def evidence(study: Study) -> Iterator[tuple[Path, str]]:
    """(file in the study folder, its name in the published copy) for every row the report
    reads that exists now."""
    root = study.root
    for name in ("results.jsonl", "stages.jsonl", RECORD):
        if (root / name).is_file():
            yield root / name, name
    for folder, pattern in (("blimp", "*.json"), ("readouts", "*.jsonl")):
        for path in sorted((root / folder).glob(pattern)):
            yield path, f"{folder}/{path.name}"
    for arm in study.spec.arms:
        metrics = study.run_dir(arm) / "metrics.jsonl"
        if metrics.is_file():
            yield metrics, f"metrics/{arm}.jsonl"
        for frac in study.spec.readiness:
            probe = study.probe_dir(arm, frac)
            if has_probe_record(probe):
                label = readiness_label(frac).replace("%", "pct")
                yield record_path(probe), f"probes/{arm}@{label}.json"


def publish_report(spec: StudySpec, dest: str | os.PathLike,
                   log: Callable[[str], None] = print) -> Path:
    """Write the report of what `spec`'s study has done into `dest` with its evidence (see the
    module docstring); returns the report's path. The study folder is only read."""
    if not (spec.root / "study.json").is_file():
        raise UserError(f"{spec.root} holds no study yet (no study.json); run `mlsm study "
                        "STUDY.yaml` first, then report it")
    dest = Path(dest)
    inside = real_path(dest).is_relative_to(real_path(spec.root))
    if inside or real_path(spec.root).is_relative_to(real_path(dest)):
        raise UserError(f"--to {dest} is {'inside' if inside else 'a folder above'} the study "
                        f"folder {spec.root}; pass a folder outside it (or leave --to out to "
                        "write the report into the study folder)")
    study = Study(spec, log)
    stale = stale_finetuning(study)
    if stale:  # only the study's own report may move rows aside (it holds the study's lock)
        raise UserError(f"the fine-tuning rows of {', '.join(stale)} are from older settings; "
                        "run `mlsm study report STUDY.yaml` without --to once the study is idle "
                        "(it moves them to superseded/), then publish")
    from mlsm.study.report import write_report  # matplotlib: only when a report is written

    with writing(dest, KIND, flag="--to"):
        dest.mkdir(parents=True, exist_ok=True)
        stage = dest / STAGING
        shutil.rmtree(stage, ignore_errors=True)  # what a killed publication left
        stage.mkdir()
        for source, name in evidence(study):
            target = stage / name
            target.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(target, lambda tmp, source=source: shutil.copyfile(source, tmp))
        write_report(study, stage)
        _swap_in(stage, dest)
        return dest / "report.md"


def _swap_in(stage: Path, dest: Path) -> None:
    """Replace the earlier publication in `dest` by the finished one in `stage`. Only renames
    (fast), under the SWAPPING marker: after a kill here, the marker makes the half-swapped
    folder recognisably ours and the rerun publishes it whole again."""
    atomic_write(dest / SWAPPING, lambda tmp: Path(tmp).write_text("publishing\n"))
    _clear(dest)  # an earlier copy's rows or plots the study no longer has must not stay
    for entry in sorted(stage.iterdir(), key=lambda e: e.name == "report.md"):  # it last
        entry.rename(dest / entry.name)
    stage.rmdir()
    fsync_path(dest)
    (dest / SWAPPING).unlink()
    fsync_path(dest)


def _clear(dest: Path) -> None:
    """Remove what an earlier publication wrote into `dest` (the guard has checked that `dest`
    holds nothing else but hidden entries, which stay)."""
    for entry in dest.iterdir():
        if KIND.files(entry.name):
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
