"""JSON-lines files mlsm appends to (results.jsonl, readouts.jsonl, metrics.jsonl, stages.jsonl):
the one reader and the one appender, so the torn-line rule is stated once.

The rule: a process killed mid-append leaves the start of a JSON object broken off. The appender
closes such a tail off with a newline before it writes, so a torn line may sit anywhere in the
file, not only last; the reader skips it (and says so through `warn`). Any other line that is not
JSON is a one-line error naming FILE:LINE: it was not written by mlsm, and dropping it silently
would lose someone's data.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlsm.artifacts.outputs import article
from mlsm.errors import UserError
from mlsm.fileio import name_the_file
from mlsm.inputs import bounded_byte_lines, loads
from mlsm.limits import MAX_ROW_BYTES

try:
    import fcntl
except ImportError:  # not POSIX: appends are still single writes, only not mutually excluded
    fcntl = None  # type: ignore[assignment]


@dataclass
class JsonLines:
    """What `read_jsonl` found: `rows` as (line number, parsed value); `torn` line numbers."""

    rows: list[tuple[int, Any]] = field(default_factory=list)
    torn: list[int] = field(default_factory=list)


def is_torn(line: str, exc: json.JSONDecodeError) -> bool:
    """Whether a line that failed to parse is the start of a JSON object broken off by a kill
    (not a complete value followed by more text, which is "Extra data": that is not ours)."""
    return line.lstrip().startswith("{") and exc.msg != "Extra data"


def read_jsonl(path: str | os.PathLike, what: str, fix: str,
               warn: Callable[[str], None] | None = None, torn_only_ok: bool = False) -> JsonLines:
    """The complete lines of the JSON-lines file `path` (missing: none). Torn lines are skipped
    and named to `warn`; a line that is not UTF-8 or not JSON (and not torn) is a UserError
    "PATH:LINE is not JSON (...); FIX", and so is a file none of whose lines parse ("PATH is not
    a WHAT"), so mlsm never appends to someone else's file; `torn_only_ok`: a file of torn lines
    alone is ours (a run killed while logging its first line). A line longer than MAX_ROW_BYTES
    is a UserError naming FILE:LINE and the bound, read that far only (mlsm writes rows of a few
    KB: a giant line is not a torn one, and it was read whole)."""
    path = Path(path)
    found, bad = JsonLines(), None
    lines = bounded_byte_lines(path, f"a line of {article(what)} {what}", MAX_ROW_BYTES,
                               "mlsm.limits.MAX_ROW_BYTES") if path.is_file() else ()
    for number, raw in lines:
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UserError(f"{path}:{number} is not UTF-8 text (byte {exc.start + 1} of the "
                            f"line); {fix}") from None
        if not line.strip():
            continue
        try:
            found.rows.append((number, loads(line)))
        except json.JSONDecodeError as exc:
            if is_torn(line, exc):
                found.torn.append(number)
            elif bad is None:
                bad = (number, exc)
        except RecursionError:  # "[[[[...": not a row mlsm wrote
            bad = bad or (number, json.JSONDecodeError("nested too deeply", line, 0))
    if (found.torn and not torn_only_ok or bad) and not found.rows:
        raise UserError(f"{path} is not {article(what)} {what} (no line is a JSON row); pass "
                        "one that mlsm wrote, or a new file")
    if bad:
        number, exc = bad
        raise UserError(f"{path}:{number} is not JSON ({exc.msg}, column {exc.colno}); {fix}")
    if found.torn and warn is not None:
        warn(f"{path}: skipped line {', '.join(map(str, found.torn))}, torn by a killed writer")
    return found


def append_jsonl(path: str | os.PathLike, rows: Iterable[Any],
                 unless: Callable[[], bool] | None = None) -> None:
    """Append `rows` as JSON lines in one locked `write` + fsync, so a crash or a concurrent
    writer never interleaves or half-writes them; a torn tail left by a killed writer is closed
    off with a newline first (the reader skips it). `unless()`, asked under the lock (it may read
    the file): True writes nothing."""
    path = Path(path)
    text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)
    if not text:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        size = os.fstat(fd).st_size
        if unless is not None and size and unless():
            return
        if size and os.pread(fd, 1, size - 1) != b"\n":
            text = "\n" + text
        _write_all_or_none(fd, text.encode("utf-8"), size)
    except OSError as exc:  # disk full: earlier rows stay, these are redone by a re-run
        raise name_the_file(exc, path) from exc
    finally:
        os.close(fd)  # closing releases the lock


def _write_all_or_none(fd: int, data: bytes, size: int) -> None:
    """Write `data` at the end of `fd` and fsync it, or leave the file at `size`: a nearly full
    disk takes part of a write and says so only in the count (the rest of the cell's rows were
    silently lost, the first kept as a whole cell), and a kill between two writes of one batch
    would leave part of it."""
    view = memoryview(data)
    try:
        while view:  # a short count is not an error: the next write raises ENOSPC
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.ftruncate(fd, size)
        raise

