"""The probe record, PROBE_RUN/probe.json: which checkpoint holds a trained k -> |V| probe and how
good it is on held-out masked tokens beside the unigram distribution.

Written by the plateau fit (`mlsm.evaluate.probe.probe_fit`) and by a study's paper-recipe probe;
read by
`mlsm probe`'s summary line, a study's BLiMP and readout stages (which refuse a probe no better
than the unigram) and run-spec resolution (a probe run resolves to the checkpoint it names), and
fingerprinted by the study's reuse check. This module is its only door:
nothing else names the file or parses it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from mlsm.fileio import atomic_write_text
from mlsm.inputs import read_json

RECORD = "probe.json"
FIELDS = {"better_than_unigram": "bool", "checkpoint": "text", "heldout_loss": "number",
          "unigram_loss": "number", "input": "text?", "heldout_top1": "number?", "steps": "int?"}
"""The shape every reader relies on (`mlsm.inputs.field_problem`)."""


def record_path(folder: str | os.PathLike) -> Path:
    """Where the probe record of the probe run `folder` lies."""
    return Path(folder) / RECORD


def has_probe_record(folder: str | os.PathLike) -> bool:
    return record_path(folder).is_file()


def write_probe_record(folder: str | os.PathLike, info: dict[str, Any]) -> Path:
    """Write `info` as the record of the probe run `folder` (atomically; the folder is made)."""
    path = record_path(folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(info, indent=2) + "\n")
    return path


def drop_probe_record(folder: str | os.PathLike) -> None:
    """Remove the record of the probe run `folder`, before a new fit replaces its checkpoint: the
    record is the manifest of the run, so a kill while the new step-N is written over the one it
    names leaves no record (the run is fitted again) rather than old figures over new weights."""
    record_path(folder).unlink(missing_ok=True)


def read_probe_record(folder: str | os.PathLike,
                      fix: str = "delete it and train the probe again") -> dict[str, Any]:
    """The record of the probe run `folder`, its fields checked; a missing, torn or misshapen one
    is one line naming the file and `fix`."""
    return read_json(record_path(folder), "probe record", fix, fields=FIELDS)


def recorded_checkpoint_name(folder: str | os.PathLike) -> str | None:
    """The folder name (`step-N`) of the checkpoint the record of probe run `folder` names; None
    when the folder has no record (it is not a fitted probe run)."""
    if not has_probe_record(folder):
        return None
    return Path(read_probe_record(folder)["checkpoint"]).name
