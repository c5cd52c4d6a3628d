"""When a fine-tuning cell already in a results file may stand for a fresh run.

A cell is (model, task, seed, lr, epochs, batch_size, max_len, n_train): the columns `compare`
pairs on. Its rows record a fingerprint of everything else that decides its scores:

- ``model``: the model folder's content (`folder_fingerprint`: each file's name and bytes), so
  another model under the same name, or a folder retrained in place, is not the stored one;
- ``data``: the task folder's files (`content_digest` of each, recursively, links to files
  and folders followed); tasks read from HF
  ``datasets`` are named, not hashed;
- ``settings``: every `FinetuneConfig` setting marked ``decides`` that the task reads (also
  written beside it in clear, so a refusal can name them).

A stored cell is reused only when its last rows' fingerprint equals the current one. Otherwise —
another fingerprint, or none (rows written before fingerprints) — the grid refuses in one line
naming what differs, before anything is trained; with ``recompute`` the cell is trained again
and its fresh rows (``supersedes``: the old fingerprint) are appended after the old ones, which
`compare` and `report` then ignore (a cell keeps its last value).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlsm.artifacts.fingerprint import (
    differences,
    folder_fingerprint,
    path_fingerprint,
    require_same,
    settings_fingerprint,
)
from mlsm.artifacts.results_file import CELL_FIELDS, cell_key
from mlsm.errors import UserError
from mlsm.evaluate.finetune.tasks import TaskSpec, task_folder

CELL_KEY = ("model", *(k for k in CELL_FIELDS if k != "metric"))
"""A fine-tuning cell: one run, whose rows (one per metric) share these columns."""
FIX = ("pass --recompute (Python: recompute=True) to train it again, the fresh rows superseding "
       "the old, or write to a new --results file; nothing was trained")


def data_fingerprint(spec: TaskSpec, data_dir: str | Path | None) -> str:
    """The content of the task's folder under `data_dir` (every file below it, by relative name);
    ``hf:<task>`` for HF datasets, which are named, not hashed."""
    if not data_dir:
        return f"hf:{spec.name}"
    return path_fingerprint(task_folder(spec, data_dir))  # links followed: their targets' bytes


@dataclass(frozen=True)
class CellInputs:
    """What decides the cells of one (model, task) under one config."""

    model: str  # folder_fingerprint of the model folder
    data: str  # data_fingerprint of the task
    settings: dict[str, Any]  # FinetuneConfig.decisive(...)

    def fingerprint(self) -> dict[str, str]:
        return {"model": self.model, "data": self.data,
                "settings": settings_fingerprint(self.settings)}

    def record(self) -> dict[str, Any]:
        """The fields every row of such a cell carries: the settings in clear, the fingerprint."""
        return {**self.settings, "fingerprint": self.fingerprint()}

    def in_clear(self, row: dict[str, Any] | None = None) -> dict[str, Any]:
        """{model files, task data, each setting} as `row` recorded them (None: as now)."""
        fp = self.fingerprint() if row is None else (row.get("fingerprint") or {})
        src = self.settings if row is None else row
        return {"model files": fp.get("model"), "task data": fp.get("data"),
                **{k: src.get(k) for k in self.settings}}


def group_cells(rows: Sequence[dict[str, Any]]) -> dict[tuple[Any, ...], list[dict[str, Any]]]:
    """cell key -> its rows, in file order."""
    out: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        out.setdefault(cell_key(row, CELL_KEY), []).append(row)
    return out


def reuse(stored: Sequence[dict[str, Any]], inputs: CellInputs, recompute: bool,
          where: str) -> tuple[str, Any]:
    """("new" | "reuse" | "recompute", the fingerprint a recomputed cell supersedes). `stored`:
    the cell's rows in file order. A mismatch without `recompute` is one UserError."""
    if not stored:
        return "new", None
    held = stored[-1].get("fingerprint")
    if held == inputs.fingerprint():
        return "reuse", None
    if recompute:
        return "recompute", held
    if not held:
        raise UserError(f"{where} was written before results recorded fingerprints, so what "
                        f"produced it cannot be checked; {FIX}")
    recorded, current = inputs.in_clear(stored[-1]), inputs.in_clear()
    if not differences(recorded, current):  # what differs is not kept in clear
        recorded, current = held, inputs.fingerprint()
    require_same(recorded, current, where, FIX)
    raise AssertionError("unreachable: the fingerprints differ")


def stored_exactly(key: tuple[Any, ...], fingerprint: dict[str, str]
                   ) -> Callable[[list[dict[str, Any]]], bool]:
    """A test for `append_results(..., unless=)`: the cell's rows with this fingerprint are
    there already (another grid on the same file finished it meanwhile)."""
    return lambda rows: any(r.get("fingerprint") == fingerprint and cell_key(r, CELL_KEY) == key
                            for r in rows)


def model_fingerprints(paths: dict[str, str]) -> dict[str, str]:
    """name -> folder_fingerprint of each model folder (read once per grid)."""
    return {name: folder_fingerprint(path) for name, path in paths.items()}
