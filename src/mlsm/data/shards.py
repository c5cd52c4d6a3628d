"""Parallel tokenisation of corpus shards, in document order.

The reader (the main process) cuts each source into *units*: about a megabyte of one file's raw
bytes (cut only where a document may begin) or a batch of ready documents (`hf:` sources). All
the per-token work is `tokenise_unit`'s: decoding, JSON parsing, splitting into documents and
tokenising, either in-process or in a pool of worker processes. A worker writes its unit's ids
to a part file and sends back only the document lengths; the main process appends the parts to
tokens.bin in submission order with a kernel-side copy, so the store is byte-identical whatever
the number of processes and the main process stays nearly idle: what it does alone (gunzip,
finding cut points, copying parts) caps the speed-up. At most `2 x workers` units are in flight:
memory stays bounded.

Workers are forked on Linux (see `_context`) and run only this module's code.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import multiprocessing as mp
import os
import shutil
import signal
import sys
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from tokenizers import Tokenizer

from mlsm.errors import UserError
from mlsm.hf import first_line

# (kind, file label for messages, number of the first line, payload):
#   kind "text": whole raw lines of a blank-line separated text file (bytes)
#   kind "jsonl": whole raw lines of a JSON-lines file, one record each (bytes)
#   kind "docs": decoded documents (a list of strings), e.g. from an HF dataset
Unit = tuple[str, str, int, Any]
# Documents are tokenised in batches of about this many characters: the batch's encodings
# (~100 bytes a token) then stay in the CPU caches instead of filling ~100 MB per unit.
ENCODE_CHARS = 1 << 16

_WORKER: dict[str, Any] = {}


def default_num_proc() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def _decoded(unit: Unit) -> list[str]:
    """Lines of a raw unit as text without the newline; a bad byte names FILE:LINE."""
    _, label, first, payload = unit
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError as exc:
        line_start = payload.rfind(b"\n", 0, exc.start) + 1
        lineno = first + payload.count(b"\n", 0, exc.start)
        raise UserError(
            f"{label}:{lineno} is not UTF-8 text (bad byte at column {exc.start - line_start + 1});"
            " convert the file (e.g. iconv -t utf-8) or leave it out"
        ) from None
    lines = text.split("\n")  # UTF-8 never uses the byte 0x0A inside a character
    if lines[-1] == "":
        lines.pop()  # the newline that ends the unit's last line
    return [line.rstrip("\r") for line in lines]


def _text_blocks(unit: Unit) -> Iterator[str]:
    block: list[str] = []
    for line in _decoded(unit):
        if line.strip():
            block.append(line)
        elif block:
            yield "\n".join(block)
            block = []
    if block:  # the reader cuts units only at blank lines, so this is the file's last block
        yield "\n".join(block)


def _jsonl_texts(unit: Unit, text_field: str) -> Iterator[str]:
    label, first = unit[1], unit[2]
    for lineno, line in enumerate(_decoded(unit), first):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise UserError(f"{label}:{lineno} is not valid JSON ({first_line(exc)}); "
                            "fix the line or use a .txt file") from None
        text = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise UserError(
                f"{label}:{lineno} has no string field {text_field!r}; pass --text-field NAME")
        if text.strip():
            yield text


def unit_documents(unit: Unit, text_field: str) -> Iterator[str]:
    """The documents of one unit, in file order."""
    if unit[0] == "text":
        return _text_blocks(unit)
    if unit[0] == "jsonl":
        return _jsonl_texts(unit, text_field)
    return iter(unit[3])


def _die_with_parent(parent: int) -> None:
    """Linux: this worker gets SIGTERM when the thread that forked it ends (PR_SET_PDEATHSIG), and
    ends now if that parent is already gone. A worker the pool forked while it was being torn down
    outlived the command, blocked on the pool's queue and holding its stdout and stderr, so
    whatever read them (a test, a pipeline) waited forever (seen in CI)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # no libc prctl: the pool's own teardown still applies
        return
    if os.getppid() != parent:  # the parent died between the fork and the prctl
        os._exit(0)


def _init_worker(tokenizer_json: str, text_field: str, dtype: str, parent: int) -> None:
    # One thread per process: N workers each running a rayon pool would oversubscribe the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process handles Ctrl-C and stops us
    # A handler inherited from the parent (a training loop's "stop at the next step") would keep
    # Pool.terminate()'s SIGTERM from ending the worker.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _die_with_parent(parent)
    _init_worker_state(tokenizer_json, text_field, dtype)


def tokenise_unit(unit: Unit) -> tuple[np.ndarray, np.ndarray]:
    """(token ids of the unit's documents concatenated, (n_docs,) int64 document lengths)."""
    docs = list(unit_documents(unit, _WORKER["text_field"]))
    tokenizer, dtype = _WORKER["tokenizer"], _WORKER["dtype"]
    ids: list[np.ndarray] = []
    start = 0
    while start < len(docs):
        stop, size = start, 0
        while stop < len(docs) and size < ENCODE_CHARS:
            size += len(docs[stop])
            stop += 1
        # offsets are not needed: the fast variant skips them (same ids)
        encodings = tokenizer.encode_batch_fast(docs[start:stop], add_special_tokens=False)
        ids += [np.asarray(e.ids, dtype=dtype) for e in encodings]
        start = stop
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    return (np.concatenate(ids) if ids else np.zeros(0, dtype=dtype)), lengths


def _tokenise_to_part(unit: Unit, part: str) -> tuple[int, np.ndarray]:
    """`tokenise_unit` in a worker: the ids go to the file `part` rather than back through the
    pipe; (number of ids, document lengths) is what returns."""
    ids, lengths = tokenise_unit(unit)
    ids.tofile(part)
    return len(ids), lengths


def _append_file(part: Path, out: BinaryIO) -> None:
    """Append the file `part` to the unbuffered file `out`, then delete it."""
    with open(part, "rb", buffering=0) as src:
        left = os.fstat(src.fileno()).st_size
        copy = getattr(os, "copy_file_range", None)  # Linux: the kernel copies, no user buffer
        while left and copy is not None:
            try:
                copied = copy(src.fileno(), out.fileno(), left)
            except OSError:  # a file system without it: copy the rest below
                break
            if copied == 0:
                break
            left -= copied
        if left:
            shutil.copyfileobj(src, out)
    part.unlink()


@contextlib.contextmanager
def _single_threaded() -> Iterator[None]:
    """TOKENIZERS_PARALLELISM=false for the duration (read by `tokenizers` at each batch call)."""
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def tokenise_units(units: Iterator[Unit], tokenizer_json: str, text_field: str, dtype: str,
                   num_proc: int, out: BinaryIO, spool: Path) -> Iterator[tuple[int, np.ndarray]]:
    """`tokenise_unit` over `units` on `num_proc` processes (1: in this process), appending the
    ids to `out` (a file opened unbuffered) in unit order; yields (number of ids, document
    lengths) per unit once its ids are in `out`. Workers write part files in `spool`.

    A corpus of a single unit is tokenised in-process: a pool would only add its start-up time.
    """
    units = iter(units)
    head = list(_take(units, 2))
    if num_proc <= 1 or len(head) < 2:
        saved = dict(_WORKER)
        with _single_threaded():
            _init_worker_state(tokenizer_json, text_field, dtype)
            try:
                for unit in itertools.chain(head, units):
                    ids, lengths = tokenise_unit(unit)
                    ids.tofile(out)
                    yield len(ids), lengths
            finally:
                _WORKER.clear()
                _WORKER.update(saved)
        return
    # closed on any exit, so the pool is torn down while an error unwinds, not at interpreter exit
    with contextlib.closing(_pool_map(itertools.chain(head, units), tokenizer_json, text_field,
                                      dtype, num_proc, spool)) as parts:
        for part, n_ids, lengths in parts:
            _append_file(part, out)
            yield n_ids, lengths


def _init_worker_state(tokenizer_json: str, text_field: str, dtype: str) -> None:
    # A copy without the saved truncation/padding settings (MiniLM's truncates at 128).
    backend = Tokenizer.from_str(tokenizer_json)
    backend.no_truncation()
    backend.no_padding()
    _WORKER.update(tokenizer=backend, text_field=text_field, dtype=np.dtype(dtype))


def _take(it: Iterator[Unit], n: int) -> Iterator[Unit]:
    for _ in range(n):
        try:
            yield next(it)
        except StopIteration:
            return


def _context() -> mp.context.BaseContext:
    """fork where the OS has it: "spawn" (and "forkserver") re-run a user's script that calls
    `prepare_corpus` without an `if __name__ == "__main__"` guard. Forking is safe here although
    the parent may hold torch/OpenMP or rayon threads: a worker runs only `tokenizers` with its
    parallelism off (set before the fork, so `tokenizers` does not warn) and numpy."""
    if sys.platform.startswith("linux"):
        return mp.get_context("fork")
    return mp.get_context("spawn")  # macOS system libraries are not fork-safe; Windows has none


def _pool_map(units: Iterator[Unit], tokenizer_json: str, text_field: str, dtype: str,
              num_proc: int, spool: Path) -> Iterator[tuple[Path, int, np.ndarray]]:
    """(part file, number of ids, document lengths) per unit, in order, with a bounded window
    (Pool.imap would read the whole corpus ahead).

    An error while reading is raised only after the units read before it are tokenised, so the
    first error reported is the one a single process would report.
    """
    pending: deque = deque()
    with _single_threaded(), _context().Pool(num_proc, _init_worker,
                                             (tokenizer_json, text_field, dtype,
                                              os.getpid())) as pool:
        read_error: BaseException | None = None
        submitted = 0
        while True:
            while read_error is None and len(pending) < 2 * num_proc:
                try:
                    unit = next(units)
                except StopIteration:
                    break
                except UserError as exc:
                    read_error = exc
                    break
                part = spool / f"part-{submitted:09d}.bin"
                submitted += 1
                pending.append((part, pool.apply_async(_tokenise_to_part, (unit, str(part)))))
            if not pending:
                break
            part, result = pending.popleft()
            yield (part, *result.get())
        if read_error is not None:
            raise read_error
