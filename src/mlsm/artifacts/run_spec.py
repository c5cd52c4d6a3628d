"""Run specs: the grammar of the names a user gives one checkpoint of a run (``RUN``, ``RUN@50%``,
``RUN@step-N``) and the choice among a run's saved checkpoints, as functions of a snapshot.

Reading that snapshot (the checkpoint.json files) is `mlsm.artifacts.checkpoint`'s alone, which
resolves a spec by reading the run and handing the snapshot here; this module opens no file, so
the rules (which step ``@50%`` means, what an unfinished run answers) read in one place and are
shared with the training loop, which saves the checkpoints they name.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from mlsm.errors import UserError

_SUFFIX = re.compile(r"(?:(?P<pct>\d+(?:\.\d+)?)%|step-(?P<step>\d+))")
SYNTAX = "RUN, RUN@<percent>% (e.g. @50%) or RUN@step-<N> (e.g. @step-100)"


def readiness_step(fraction: float, total_steps: int) -> int:
    """The step at which a run of `total_steps` keeps its readiness-`fraction` checkpoint (the one
    rounding the training loop, `RUN@50%`, `--readiness all` and studies share)."""
    return max(1, round(fraction * total_steps))


def readiness_steps(fractions: list[float] | tuple[float, ...], total_steps: int) -> set[int]:
    """The steps of every readiness checkpoint of a run."""
    return {readiness_step(f, total_steps) for f in fractions}


def split_spec(spec: str | os.PathLike) -> tuple[Path, str]:
    """``"runs/x@50%"`` -> (Path("runs/x"), "50%"); a spec that exists as a path has no suffix."""
    text = str(spec)
    if "@" not in text or Path(text).exists():
        return Path(text), ""
    base, _, suffix = text.rpartition("@")
    return Path(base), suffix


def resume_command(run: Path) -> str:
    """The command that finishes the run in `run` as printed: its own resolved config (a probe
    run's too: it is a run of the probe objective) and its folder wherever it is now (config.yaml
    names the train.out it was started in); a bare `--resume auto` would start from the defaults,
    which name no token store."""
    return (f"mlsm pretrain --config {shlex.quote(str(run / 'config.yaml'))} --resume auto "
            f"{shlex.quote(f'train.out={run}')}")


@dataclass(frozen=True)
class Saved:
    """One complete checkpoint of a run."""

    step: int
    path: Path


@dataclass(frozen=True)
class RunCheckpoints:
    """What a run spec is resolved against: a run folder's complete checkpoints (oldest first),
    planned steps and readiness list. Not a second type of run folder (that is
    `mlsm.artifacts.rundir.RunDir`): a snapshot read from its checkpoint.json files."""

    path: Path
    checkpoints: tuple[Saved, ...]
    total_steps: int
    readiness: tuple[float, ...]

    def at_step(self, step: int) -> Saved | None:
        return next((c for c in self.checkpoints if c.step == step), None)

    def describe(self) -> str:
        """``step-20 (10%), step-200 (100%)``: what exists, for error messages."""
        return ", ".join(f"step-{c.step} ({100 * c.step / self.total_steps:g}%)"
                         for c in self.checkpoints) or "none"

    def final(self) -> Saved:
        """The last checkpoint of a finished run; an unfinished one is refused, naming both the
        newest checkpoint and the command that finishes the run."""
        last = self.checkpoints[-1]
        if last.step < self.total_steps:
            raise UserError(f"{self.path}: the run is not finished (newest checkpoint "
                            f"step-{last.step} of {self.total_steps} steps); pass "
                            f"{self.path}@step-{last.step} to use it, or finish "
                            f"it with {resume_command(self.path)}")
        return last

    def pick(self, spec: str | os.PathLike, suffix: str) -> Path:
        """The checkpoint a suffix (``50%``, ``step-100``) of `spec` selects."""
        match = _SUFFIX.fullmatch(suffix)
        if match is None:
            raise UserError(f"{spec}: unknown suffix @{suffix}; use {SYNTAX}")
        if match["step"] is not None:
            step, what = int(match["step"]), f"step {int(match['step'])}"
        else:
            step = readiness_step(float(match["pct"]) / 100, self.total_steps)
            what = f"{match['pct']}% readiness (step {step})"
        found = self.at_step(step)
        if found is None:
            raise UserError(f"{spec}: the run has no checkpoint at {what}; it has "
                            f"{self.describe()}")
        return found.path

    def readiness_folders(self) -> list[Path]:
        """Every readiness checkpoint (``train.readiness``), in step order; refused in one line
        when one is missing."""
        steps = sorted(readiness_steps(self.readiness, self.total_steps))
        missing = [s for s in steps if self.at_step(s) is None]
        if missing:
            raise UserError(f"{self.path}: readiness checkpoints "
                            f"{', '.join(f'step-{s}' for s in missing)} are "
                            f"missing (unfinished run?); it has {self.describe()}")
        return [self.at_step(s).path for s in steps]  # type: ignore[union-attr]
