"""Model arguments that name a run directory: ``RUN``, ``RUN@50%``, ``RUN@step-100``.

A run directory (``train.out`` of `mlsm pretrain` or `mlsm probe`) holds ``checkpoints/step-N``
folders, each complete once its ``checkpoint.json`` exists. Every evaluation verb and its library
loader resolves its model argument here, so the CLI and the Python API accept the same specs:

==================  =======================================================================
``FOLDER``          a checkpoint or any HF model folder (or hub id): used as it is
``RUN``             the run's final checkpoint (step ``train.steps``)
``RUN@50%``         the checkpoint at 50 % readiness: step ``max(1, round(0.5 * train.steps))``,
                    the step at which the training loop saves it
``RUN@step-100``    the checkpoint of step 100
==================  =======================================================================

A spec that does not resolve stops with one line listing the checkpoints the run has.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from mlsm.errors import UserError
from mlsm.inputs import read_json

_SUFFIX = re.compile(r"(?:(?P<pct>\d+(?:\.\d+)?)%|step-(?P<step>\d+))")
SYNTAX = "RUN, RUN@<percent>% (e.g. @50%) or RUN@step-<N> (e.g. @step-100)"


def readiness_step(fraction: float, total_steps: int) -> int:
    """The step at which a run of `total_steps` keeps its readiness-`fraction` checkpoint (the one
    rounding the training loop, `RUN@50%`, `--readiness all` and studies share)."""
    return max(1, round(fraction * total_steps))


def readiness_steps(fractions: list[float] | tuple[float, ...], total_steps: int) -> set[int]:
    """The steps of every readiness checkpoint of a run."""
    return {readiness_step(f, total_steps) for f in fractions}


@dataclass(frozen=True)
class RunCheckpoint:
    """One complete checkpoint of a run."""

    step: int
    path: Path


@dataclass(frozen=True)
class Run:
    """A run directory: its complete checkpoints (oldest first), planned steps and readiness
    list."""

    path: Path
    checkpoints: tuple[RunCheckpoint, ...]
    total_steps: int
    readiness: tuple[float, ...]

    def at_step(self, step: int) -> RunCheckpoint | None:
        return next((c for c in self.checkpoints if c.step == step), None)

    def readiness_step(self, fraction: float) -> int:
        """The step the training loop saves for readiness ``fraction``."""
        return readiness_step(fraction, self.total_steps)

    def describe(self) -> str:
        """``step-20 (10%), step-200 (100%)``: what exists, for error messages."""
        return ", ".join(f"step-{c.step} ({100 * c.step / self.total_steps:g}%)"
                         for c in self.checkpoints) or "none"


def is_run_dir(path: str | Path) -> bool:
    """True for a directory with a ``checkpoints/`` folder.

    That is what `pretrain` writes to ``train.out``.
    """
    return (Path(path) / "checkpoints").is_dir()


# what open_run reads of each checkpoint.json (a hand-edited one is named, not a traceback)
_MARKER_FIELDS = {"step": "int", "readiness": "number?", "config.train.steps": "int?",
                  "config.train.readiness": "numbers?"}
_FIX_MARKER = "restore it from a copy, or delete that checkpoint folder to use the others"


def open_run(path: str | Path) -> Run:
    """Read a run directory's complete checkpoints; UserError when it has none."""
    root = Path(path)
    found, total, readiness = [], 0, (1.0,)
    for folder in sorted((root / "checkpoints").glob("step-*")):
        marker = folder / "checkpoint.json"
        if not marker.is_file():
            continue  # being written, or killed while writing: not a checkpoint
        info = read_json(marker, "checkpoint file", _FIX_MARKER, fields=_MARKER_FIELDS)
        found.append(RunCheckpoint(info["step"], folder))
        train = (info.get("config") or {}).get("train") or {}
        if not train.get("steps") and not info.get("readiness"):
            raise UserError(f"checkpoint file {marker} names neither config.train.steps nor "
                            f"readiness, so the run's length is unknown; {_FIX_MARKER}")
        total = int(train.get("steps") or round(info["step"] / info["readiness"]))
        readiness = tuple(float(r) for r in train.get("readiness") or readiness)
    if not found:
        raise UserError(f"{root}: the run has no complete checkpoint in {root / 'checkpoints'} "
                        "yet; train it (mlsm pretrain) or pass a checkpoint folder")
    return Run(root, tuple(sorted(found, key=lambda c: c.step)), total, readiness)


def split_spec(spec: str | Path) -> tuple[Path, str]:
    """``"runs/x@50%"`` -> (Path("runs/x"), "50%"); a spec that exists as a path has no suffix."""
    text = str(spec)
    if "@" not in text or Path(text).exists():
        return Path(text), ""
    base, _, suffix = text.rpartition("@")
    return Path(base), suffix


def _final(run: Run) -> RunCheckpoint:
    last = run.checkpoints[-1]
    if last.step < run.total_steps:
        raise UserError(f"{run.path}: the run is not finished (newest checkpoint "
                        f"step-{last.step} of {run.total_steps} steps); pass "
                        f"{run.path}@step-{last.step} to use it, or finish "
                        "it with mlsm pretrain --resume auto")
    return last


def resolve_checkpoint(spec: str | Path) -> Path:
    """The checkpoint folder a spec names (see the module doc); other paths come back unchanged."""
    base, suffix = split_spec(spec)
    if not suffix:
        return _final(open_run(base)).path if is_run_dir(base) else base
    if not is_run_dir(base):
        raise UserError(f"{spec}: {base} is not a run directory (no checkpoints/ folder); "
                        f"the @ suffix selects a checkpoint of a run: {SYNTAX}")
    match = _SUFFIX.fullmatch(suffix)
    if match is None:
        raise UserError(f"{spec}: unknown suffix @{suffix}; use {SYNTAX}")
    run = open_run(base)
    if match["step"] is not None:
        step, what = int(match["step"]), f"step {int(match['step'])}"
    else:
        step = run.readiness_step(float(match["pct"]) / 100)
        what = f"{match['pct']}% readiness (step {step})"
    found = run.at_step(step)
    if found is None:
        raise UserError(f"{spec}: the run has no checkpoint at {what}; it has {run.describe()}")
    return found.path


def readiness_checkpoints(spec: str | Path) -> list[Path]:
    """Every readiness checkpoint of a run (``train.readiness``), in step order."""
    base, suffix = split_spec(spec)
    if suffix or not is_run_dir(base):
        raise UserError(f"{spec}: --readiness all needs a run directory without @ suffix (a folder "
                        "with checkpoints/), not a checkpoint")
    run = open_run(base)
    steps = sorted(readiness_steps(run.readiness, run.total_steps))
    missing = [s for s in steps if run.at_step(s) is None]
    if missing:
        raise UserError(f"{base}: readiness checkpoints "
                        f"{', '.join(f'step-{s}' for s in missing)} are "
                        f"missing (unfinished run?); it has {run.describe()}")
    return [run.at_step(s).path for s in steps]  # type: ignore[union-attr]


def expand_models(specs: list[str | Path] | tuple[str | Path, ...],
                  readiness: str = "final") -> list[str]:
    """Model arguments of `finetune` (``[NAME=]SPEC``) after ``--readiness``: ``final`` keeps them,
    ``all`` replaces every run directory by its readiness checkpoints, named ``NAME@<step>``; other
    models (checkpoint folders, ``RUN@...``, public models: reference lines in `mlsm report`)
    stay."""
    if readiness == "final":
        return [str(s) for s in specs]
    if readiness != "all":
        raise UserError(f"--readiness {readiness}: use final (the default) or all")
    out = []
    for spec in map(str, specs):
        name, _, path = (("", "", spec) if "=" not in spec or Path(spec).is_dir()
                         else spec.partition("="))
        base, suffix = split_spec(path)
        if suffix or not is_run_dir(base):
            out.append(spec)
            continue
        for ckpt in readiness_checkpoints(path):
            step = int(ckpt.name.removeprefix("step-"))
            out.append(f"{name}@{step}={ckpt}" if name else str(ckpt))
    return out


def probe_run_of(checkpoint: str | Path) -> Path:
    """Where `mlsm probe CHECKPOINT` puts its run by default: ``<run>/probe-<checkpoint name>``."""
    folder = Path(checkpoint)
    return folder.parent.parent / f"probe-{folder.name}"
