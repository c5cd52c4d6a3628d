"""What marks a folder as an mlsm export: its mlsm.json names the format `EXPORT_FORMAT`.

Kept apart from `mlsm.export` (which imports torch) so that `mlsm export` refuses an --out
holding something else in one line before the heavy imports, and so any reader can recognise an
export without loading a model.
"""

from __future__ import annotations

from pathlib import Path

from mlsm.artifacts.outputs import OutputKind
from mlsm.errors import UserError
from mlsm.inputs import read_json

EXPORT_FORMAT = "mlsm-export"
"""The `format` field of an export's mlsm.json."""


def is_export(out: Path) -> bool:
    """Whether `out` holds an export mlsm wrote (its mlsm.json names `EXPORT_FORMAT`)."""
    try:
        return read_json(out / "mlsm.json", "export marker", "").get("format") == EXPORT_FORMAT
    except UserError:  # missing, torn or foreign: not an export of ours
        return False


EXPORT_KIND = OutputKind("mlsm export", ours=is_export)
"""The output kind of `mlsm export --out`: an earlier export there is replaced, nothing else."""
