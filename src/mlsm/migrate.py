"""`mlsm migrate`: write once into a checkpoint or export of mlsm 0.1.0 the facts its readers need.

mlsm 0.1.0 wrote checkpoint.json (and an export's mlsm.json) without `latent_head` (the heads.json
name of the latent head) and `pll_refusal` (why PLL cannot score the folder, or null). Readers
(`mlsm.artifacts.checkpoint.Checkpoint`) refuse such a folder in one line naming this verb instead
of guessing. Here, above the objectives, the facts are computed as a save computes them today
(`mlsm.objectives.checkpoint_facts`, from the objective, step and run length the marker records)
and written into the marker atomically (`mlsm.fileio.atomic_write_text`: a reader sees the old
file or the new one, never half of one), under the lock of the run or export. A marker that
records them already is left byte for byte unchanged, so a second migration changes nothing.

The marker's bytes change, so the folder's content fingerprint changes too
(`mlsm.artifacts.fingerprint.folder_fingerprint`): study stages on it run again, a fine-tuning grid
asks for `--recompute`, and a run that recorded it as an input (teacher, init_from, a probe's
checkpoint) refuses `--resume`. Migrate before starting anything on an old checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlsm.artifacts.checkpoint import (
    COMPLETE,
    EXPORT_MARKER,
    FACTS,
    Checkpoint,
    is_run_dir,
    list_checkpoints,
    migration_target,
    recorded_facts,
    write_marker,
)
from mlsm.artifacts.legacy import tolerated
from mlsm.errors import UserError
from mlsm.locking import hold
from mlsm.objectives import (
    INTERNAL,
    Objective,
    checkpoint_facts,
    objective_class,
    user_objectives,
)

_PASS = "pass a run directory, a <run>/checkpoints/step-* folder or an mlsm export folder"


@dataclass(frozen=True)
class Migrated:
    """One folder `migrate` looked at: its marker and the facts it now records."""

    folder: Path
    marker: Path
    facts: dict[str, Any]
    """{"latent_head": str, "pll_refusal": str | None}, as the marker records them now."""
    written: bool
    """True: written now; False: the marker recorded them already and was left unchanged."""

    def line(self) -> str:
        """One line for the terminal."""
        if not self.written:
            return f"unchanged {self.marker}: it records its facts already"
        refusal = self.facts["pll_refusal"]
        scoring = f"refused by PLL ({refusal})" if refusal else "scored by PLL"
        return f"migrated {self.marker}: latent head {self.facts['latent_head']!r}, {scoring}"


def migrate(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Migrated]:
    """Write the facts into every checkpoint or export `paths` name: a checkpoint folder, an
    `mlsm export` folder, or a run directory (each of its checkpoints, then those of the probe runs
    inside it). Every path is checked before anything is written; probe checkpoints go last, since
    a probe's refusal is read from the checkpoint it probed. One record per folder, in order."""
    if not tolerated("checkpoint-facts-unrecorded"):
        raise UserError("this version no longer migrates checkpoints of mlsm 0.1; run `mlsm "
                        "migrate` with mlsm 0.2, or train the model again")
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not items:
        raise UserError(f"nothing to migrate; {_PASS}")
    folders = list(dict.fromkeys(f for p in items for f in _folders(Path(p))))
    folders.sort(key=lambda f: Checkpoint.at(f).objective == "probe")  # stable: order kept
    return [migrate_folder(f) for f in folders]


def _folders(path: Path) -> list[Path]:
    """The checkpoint or export folders `path` names (a run: its own and its probe runs')."""
    if (path / COMPLETE).is_file() or (path / EXPORT_MARKER).is_file():
        return [path]
    if is_run_dir(path):
        runs = [path, *sorted(p for p in path.iterdir() if p.is_dir() and is_run_dir(p))]
        return [folder for run in runs for _, folder in list_checkpoints(run)]
    if not path.exists():
        raise UserError(f"{path} does not exist; {_PASS}")
    raise UserError(f"{path} holds no checkpoint.json, mlsm.json or checkpoints/ folder; {_PASS}")


def migrate_folder(folder: str | os.PathLike) -> Migrated:
    """Write the facts into one checkpoint's checkpoint.json or one export's mlsm.json, unless it
    records them already (then nothing is written)."""
    folder = Path(folder)
    with hold(*_owner(folder)):  # a run being trained or an export being written refuses
        ck = Checkpoint.at(folder)
        if ck.kind == "hf":
            raise UserError(f"{folder} holds no checkpoint.json or mlsm.json, so it is not mlsm's "
                            f"and has nothing to migrate; {_PASS}")
        marker = folder / (COMPLETE if ck.is_checkpoint else EXPORT_MARKER)
        held = recorded_facts(ck.info)
        if held is not None:
            return Migrated(folder, marker, dict(zip(FACTS, held, strict=True)), written=False)
        facts = facts_for(ck, marker)
        write_marker(folder, {**ck.info, **facts}, marker.name)
        return Migrated(folder, marker, facts, written=True)


def _owner(folder: Path) -> tuple[Path, str]:
    """The output whose lock covers `folder` (its run, else itself) and what to call it."""
    target = migration_target(folder)
    if target != folder:
        return target, "run directory"
    return folder, "checkpoint folder" if (folder / COMPLETE).is_file() else "mlsm export"


def facts_for(ck: Checkpoint, marker: Path) -> dict[str, Any]:
    """The facts a checkpoint (or export) saved today would record, from the objective, step and
    run length its marker names: the latent head of the objective whose heads it holds (a shipped
    probe's, for an export), the refusal of the objective that trained it."""
    head_of, refusal_of, objective_cfg, total = ck.facts_of
    head = _known(head_of, marker).latent_head
    _known(refusal_of, marker)
    refusal = checkpoint_facts(refusal_of, objective_cfg, ck.step, total)["pll_refusal"]
    return {"latent_head": head, "pll_refusal": refusal}


def _known(name: object, marker: Path) -> type[Objective]:
    """The objective class `name` names; an unknown name is one line (no default stands in)."""
    cls = objective_class(name)
    if cls is None:
        known = ", ".join([*user_objectives(), *INTERNAL])
        raise UserError(f"{marker} names objective {name!r}, which mlsm does not know ({known}); "
                        "restore the file from a copy of the checkpoint, then rerun mlsm migrate")
    return cls
