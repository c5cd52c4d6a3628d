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
they are gigabytes, and the report does not read them. Only rows made from the study's current
inputs and settings are copied (`reuse.is_current`), so every row of a publication was current
when it was published.

A study longer than one machine's life (a fresh machine per session, nothing kept but what was
committed) is run a piece at a time, each piece published to its own folder; `report_pieces`
(`mlsm study report STUDY.yaml --from DIR [DIR ...] --to DEST`) lays the pieces' rows back into
the study-folder layout (`assemble`, the inverse of `evidence`) and writes the one report over
all of them, the pre-registered tests paired across every seed the pieces hold.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from mlsm.artifacts.jsonl import read_jsonl
from mlsm.artifacts.outputs import report_kind, writing
from mlsm.artifacts.probe_record import has_probe_record, record_path
from mlsm.artifacts.rundir import RUN_MARKER
from mlsm.errors import UserError
from mlsm.fileio import atomic_write, fsync_path
from mlsm.inputs import read_json, real_path
from mlsm.study.folder import REPORT_OUTPUTS, Study
from mlsm.study.hypotheses import RECORD
from mlsm.study.reuse import is_current, stale_finetuning
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
    """(file in the study folder, its name in the published copy) for every file of rows the
    report reads that exists now (BLiMP and readout files: see `_current_copy`)."""
    root = study.root
    for name in ("results.jsonl", "stages.jsonl", RECORD):
        if (root / name).is_file():
            yield root / name, name
    for folder, pattern in (("blimp", "*.json"), ("readouts", "*.jsonl")):
        for path in sorted((root / folder).glob(pattern)):
            yield path, f"{folder}/{path.name}"
    for arm in study.spec.arms:
        run = study.run_dir(arm)
        for name, published in (("metrics.jsonl", f"{arm}.jsonl"), (RUN_MARKER, f"{arm}.run.json")):
            if (run / name).is_file():  # run.json: each segment's revision, precision, threads
                yield run / name, f"metrics/{published}"
        for frac in study.spec.readiness:
            probe = study.probe_dir(arm, frac)
            if has_probe_record(probe):
                yield record_path(probe), f"probes/{arm}@{_label(frac)}.json"


def _label(frac: float) -> str:
    """A readiness point as a file name writes it: "100pct"."""
    return readiness_label(frac).replace("%", "pct")


def _current_copy(study: Study, source: Path, name: str) -> Callable[[str], None] | None:
    """How `source` is copied into the publication: whole, or (a readout file holding rows of
    other inputs or settings) only its current rows; None: not at all (a BLiMP file of other
    inputs or settings). The study's own report leaves such rows out (`reuse.current_rows`), so
    a publication holds exactly the rows the report counted."""
    whole = lambda tmp: shutil.copyfile(source, tmp)  # noqa: E731
    if name == "stages.jsonl":  # a piece of some arms (`--arms`) counts the cost of those only
        lines = source.read_text(encoding="utf-8").splitlines(keepends=True)
        kept = [line for line in lines if _stage_of_arms(study, line)]
        return whole if len(kept) == len(lines) else \
            (lambda tmp: Path(tmp).write_text("".join(kept), encoding="utf-8"))
    if name.startswith("blimp/"):
        row = read_json(source, "BLiMP result", "delete it and run the study with --stages blimp")
        return whole if is_current(study, "blimp", row) else None
    if not name.startswith("readouts/"):
        return whole
    rows = [r for _, r in read_jsonl(source, "readout file", f"delete {source} and run the "
                                     "study with --stages readout again").rows]
    kept = [r for r in rows if is_current(study, "readout", r)]
    if len(kept) == len(rows):
        return whole
    text = "".join(json.dumps(r) + "\n" for r in kept)
    return (lambda tmp: Path(tmp).write_text(text, encoding="utf-8")) if kept else None


def _stage_of_arms(study: Study, line: str) -> bool:
    """Whether a stages.jsonl line is of a stage of the study's arms or of none (the store); a
    torn line is left out, as every reader skips it."""
    try:
        arm = json.loads(line).get("arm")
    except (json.JSONDecodeError, AttributeError):
        return False
    return study.owns(None if arm is None else str(arm))


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
            copy = _current_copy(study, source, name)
            if copy is not None:
                target = stage / name
                target.parent.mkdir(parents=True, exist_ok=True)
                atomic_write(target, copy)
        write_report(study, stage)
        _swap_in(stage, dest)
        return dest / "report.md"


def report_pieces(spec: StudySpec, pieces: Sequence[str | os.PathLike], dest: str | os.PathLike,
                  log: Callable[[str], None] = print) -> Path:
    """Write the report of `spec`'s study over its published pieces (folders `publish_report`
    wrote, e.g. one per seed or per session) into `dest`; returns the report's path. The pieces
    are only read; their rows are taken as published (each was current then), laid back into a
    scratch study folder (`assemble`) that holds no checkpoint (`Study.pieces`)."""
    dest, folders = Path(dest), [Path(p) for p in pieces]
    for piece in folders:
        _check_piece(spec, piece, dest)
    from mlsm.study.report import write_report

    with tempfile.TemporaryDirectory(prefix="mlsm-pieces-") as tmp:
        study = Study(dataclasses.replace(spec, out=str(Path(tmp) / spec.root.name)), log)
        study.pieces = tuple(p.name for p in folders)
        assemble(study, folders)
        with writing(dest, KIND, flag="--to"):
            dest.mkdir(parents=True, exist_ok=True)
            stage = dest / STAGING
            shutil.rmtree(stage, ignore_errors=True)
            stage.mkdir()
            write_report(study, stage)
            _swap_in(stage, dest)
    return dest / "report.md"


def _check_piece(spec: StudySpec, piece: Path, dest: Path) -> None:
    """One line for a --from folder that is not a published report of this study, or that the
    report into `dest` would overwrite."""
    if not piece.is_dir() or not KIND.ours(piece):
        raise UserError(f"--from {piece} is not a published study report (no report.md that "
                        "`mlsm study report STUDY.yaml --to DIR` wrote); pass the folders the "
                        "pieces were published to")
    first = (piece / "report.md").read_text(encoding="utf-8").partition("\n")[0]
    if first.strip() != f"# Study `{spec.name}`":
        raise UserError(f"--from {piece} is the report of another study ({first.strip()!r}); "
                        f"pass the pieces of `{spec.name}` only")
    if real_path(dest) == real_path(piece) or real_path(dest).is_relative_to(real_path(piece)) \
            or real_path(piece).is_relative_to(real_path(dest)):
        raise UserError(f"--to {dest} would overwrite the piece {piece} it reads; pass another "
                        "folder for the report over the pieces")


def assemble(study: Study, pieces: list[Path]) -> None:
    """Lay the rows of the published `pieces` back into `study`'s folder where the study wrote
    them (`evidence` in reverse); results.jsonl and stages.jsonl are joined. A file two pieces
    both hold must be the same bytes: a run's rows come from the one piece that ran it."""
    came_from: dict[str, Path] = {}
    for piece in pieces:
        for path in sorted(p for p in piece.rglob("*") if p.is_file()):
            name = path.relative_to(piece).as_posix()
            target = _unpublished(study, name)
            if target is None:
                if name.partition("/")[0] in {"blimp", "readouts", "metrics", "probes"}:
                    study.log(f"[study] warning: {piece.name}/{name} is no file of this "
                              "study's arms and readiness points; left out")
                continue
            out = study.root / target
            out.parent.mkdir(parents=True, exist_ok=True)
            if name in ("results.jsonl", "stages.jsonl"):
                data = path.read_bytes()
                with open(out, "ab") as fh:
                    fh.write(data if data.endswith(b"\n") or not data else data + b"\n")
            elif out.exists() and out.read_bytes() != path.read_bytes():
                raise UserError(f"{name} differs between the published pieces "
                                f"{came_from[target].name} and {piece.name}: a run's rows come "
                                "from the one piece that ran it; delete the copy of the other "
                                "(an earlier, lost run), then report again")
            elif not out.exists():
                shutil.copyfile(path, out)
                came_from[target] = piece


def _unpublished(study: Study, name: str) -> str | None:
    """Where the file `name` of a publication lies in the study folder (relative); None for
    the report's own files and for rows of arms or points the study does not have."""
    head, _, rest = name.partition("/")
    if name in ("results.jsonl", "stages.jsonl", RECORD):
        return name
    if head in ("blimp", "readouts") and rest and "/" not in rest:
        return name
    if head == "metrics":
        for suffix, file in ((".run.json", RUN_MARKER), (".jsonl", "metrics.jsonl")):
            arm = rest.removesuffix(suffix)
            if rest.endswith(suffix) and arm in study.spec.arms:
                return f"runs/{arm}/{file}"
    if head == "probes" and rest.endswith(".json"):
        arm, _, label = rest.removesuffix(".json").rpartition("@")
        frac = next((f for f in study.spec.readiness if _label(f) == label), None)
        if arm in study.spec.arms and frac is not None:
            return record_path(study.probe_dir(arm, frac)).relative_to(study.root).as_posix()
    return None


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
