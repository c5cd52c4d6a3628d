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

from pathlib import Path

from mlsm.artifacts.checkpoint import (
    SYNTAX,
    Run,
    RunCheckpoint,
    is_run_dir,
    open_run,
    probe_run_of,
    readiness_step,
    readiness_steps,
    resolve_checkpoint,
    split_spec,
)
from mlsm.errors import UserError

# the resolution itself lives with the checkpoint folder it names (`mlsm.artifacts.checkpoint`)
__all__ = ["SYNTAX", "Run", "RunCheckpoint", "expand_models", "is_run_dir", "open_run",
           "probe_run_of", "readiness_checkpoints", "readiness_step", "readiness_steps",
           "resolve_checkpoint", "split_spec"]


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
    ``all`` replaces every run directory by its readiness checkpoints, named ``NAME@step-<N>``
    (the run-spec syntax: ``@50`` read as a percent); other
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
            out.append(f"{name}@step-{step}={ckpt}" if name else str(ckpt))
    return out
