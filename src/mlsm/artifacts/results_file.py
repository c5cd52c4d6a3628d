"""The results file (``results.jsonl``): the one module that writes and reads it.

One JSON object per line and per metric of a fine-tuning cell (see ``finetune.run_cell``), also
the rows of readouts and probes: the model, the value, and the cell it belongs to
(``CELL_FIELDS``: task, metric, seed, lr, epochs, batch size, max_len, n_train). Rows are
appended under a lock with fsync; a row torn by a killed writer is skipped with a warning, any
other line that is not a row is one error naming FILE:LINE. Paired statistics over these rows
live in ``mlsm.evaluate.compare.stats``.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from mlsm.artifacts.jsonl import append_jsonl, read_jsonl
from mlsm.errors import UserError
from mlsm.inputs import is_number

CELL_FIELDS = ("task", "metric", "seed", "lr", "epochs", "batch_size", "max_len", "n_train")
"""The columns a model's score is keyed and paired on (`compare`): one fine-tuning run (a cell,
`mlsm.evaluate.finetune.cell_reuse.CELL_KEY`) writes one row per metric."""


def cell_key(row: dict[str, Any], fields: Sequence[str] = CELL_FIELDS) -> tuple[Any, ...]:
    """The one key of a cell (a stored row, or a cell planned) over `fields`, lr as a float (a
    grid's 2e-5 and a row's 0.00002 are one cell)."""
    return tuple(float(row[k]) if k == "lr" else row[k] for k in fields)
TEST_SUFFIX = "_test"  # the metric name of a score on a labelled test split (`--eval-test`)


def is_test_metric(metric: Any) -> bool:
    """A test-set score (reported, never in the paired statistics or averages)."""
    return str(metric).endswith(TEST_SUFFIX)


def append_results(path: str | Path, rows: Iterable[dict[str, Any]],
                   unless: Callable[[list[dict[str, Any]]], bool] | None = None) -> None:
    """Append rows as JSON lines (`append_jsonl`: one locked write + fsync, a torn tail closed
    off first). A row's checkpoint `path` and `run` inside the results file's folder are written
    relative to that folder, so a study folder (or a published copy of its results) names no
    machine's absolute paths. `unless(rows already in the file)`, asked under the lock: True
    writes nothing (two grids on one file that both ran a cell append it once)."""
    path = Path(path)
    append_jsonl(path, [portable_row(r, path.parent) for r in rows],
                 unless=None if unless is None else lambda: unless(read_results(path)))


def portable_row(row: dict[str, Any], folder: Path) -> dict[str, Any]:
    """`row` with its `path` and `run` relative to `folder` where they lie inside it."""
    out = dict(row)
    base = Path(os.path.abspath(folder))
    for key in ("path", "run"):
        value = out.get(key)
        if isinstance(value, str) and value:  # relative ones are relative to the working folder
            inside = Path(os.path.abspath(value))
            if inside == base or base in inside.parents:
                out[key] = inside.relative_to(base).as_posix() or "."
    return out


def read_results(path: str | Path,
                 warn: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """All complete rows of a results file.

    A line torn by a killed writer (the start of a JSON object, broken off) is skipped and named
    to `warn`: `append_results` closes it off with a newline and a resumed grid redoes its cell,
    so such a line may sit anywhere in the file. Any other line that is not a result row is a
    UserError naming FILE:LINE, and so is a file with no row at all among its lines (so
    `finetune --results` never appends to someone else's file)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no results file; run `mlsm finetune ... --results {path}` first")
    fix = "remove or fix that line (results files are JSON lines written by mlsm finetune)"
    tell = None if warn is None else (
        lambda m: warn(f"{m} (a resumed fine-tuning grid redoes its cell)"))
    found = read_jsonl(path, "results file", fix, warn=tell)
    return [_result_row(path, number, row) for number, row in found.rows]


def _result_row(path: Path, number: int, row: Any) -> dict[str, Any]:
    """A parsed line checked to be a result row: the cell's keys present, names as text and the
    cell's settings scalars (they are grouped on)."""
    fix = "remove or fix that line (results files are JSON lines written by mlsm finetune)"
    if not isinstance(row, dict):
        raise UserError(f"{path}:{number} is a JSON {type(row).__name__}, not a result row; {fix}")
    missing = [k for k in ("model", "value", *CELL_FIELDS) if k not in row]
    if missing:
        raise UserError(f"{path}:{number} is not a result row (no {', '.join(missing)}); {fix}")
    for key in ("model", "task", "metric"):
        if not isinstance(row[key], str):
            raise UserError(f"{path}:{number}: {key} must be text, got {row[key]!r}; {fix}")
        if _TABLE_BREAKERS.search(row[key]):  # a line break or "|" splits the Markdown tables
            raise UserError(f"{path}:{number}: {key} {row[key]!r} holds a line break, a control "
                            f"character or '|'; rename it ({fix})")
    for key in CELL_FIELDS:
        if isinstance(row[key], dict | list):
            raise UserError(f"{path}:{number}: {key} must be a single value, got {row[key]!r}; "
                            f"{fix}")
    for key in _NUMERIC_FIELDS:  # grouped on, and read as numbers (lr as a float)
        if row[key] is not None and not is_number(row[key]):
            raise UserError(f"{path}:{number}: {key} must be a number, got {row[key]!r}; {fix}")
    return row


_TABLE_BREAKERS = re.compile(r"[\x00-\x1f\x7f|]")


def check_model_name(name: str, what: str) -> None:
    """Refuse a name that `read_results` would refuse in the results file (a line break, a
    control character or '|'), before it is written there: `finetune` accepted such a model
    name and `compare` refused the file afterwards."""
    if _TABLE_BREAKERS.search(name):
        raise UserError(f"{what} {name!r} holds a line break, a control character or '|', which "
                        "results tables cannot hold; name it with NAME=PATH (nothing was written)")
_NUMERIC_FIELDS = tuple(k for k in CELL_FIELDS if k not in ("task", "metric"))
SCORE_LIMIT = 1e6  # |value| of a score (fractions, or percentages): beyond it, not a score


def read_scores(path: str | Path) -> list[dict[str, Any]]:
    """The rows of `read_results` whose value is a score (a number within ±SCORE_LIMIT); the
    others (NaN, null, text, 1e308) are skipped and counted in one warning on stderr, so a mean
    is never silently NaN or inf; a file with no score at all is a UserError."""
    rows = read_results(path)
    good = [r for r in rows if is_number(r["value"]) and abs(r["value"]) <= SCORE_LIMIT]
    not_a_score = f"not a score (NaN, null, text or beyond ±{SCORE_LIMIT:g})"
    if rows and not good:
        raise UserError(f"{path}: the value of every result row is {not_a_score}; pass the "
                        "results.jsonl written by `mlsm finetune`")
    if len(good) < len(rows):
        print(f"mlsm: warning: {path}: skipped {len(rows) - len(good)} of {len(rows)} result rows "
              f"whose value is {not_a_score}", file=sys.stderr)
    return good
