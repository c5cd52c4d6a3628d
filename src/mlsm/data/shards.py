"""Parallel tokenisation of corpus shards, in document order.

The reader (the main process) cuts each source into *units*: about a megabyte of one file's raw
bytes (cut only where a document may begin) or a batch of ready documents (`hf:` sources). All
the per-token work is `tokenise_unit`'s: decoding, JSON parsing, splitting into documents and
tokenising, either in-process or in worker processes (`_Workers`). A worker writes its unit's ids
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
import multiprocessing.connection
import os
import shutil
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from tokenizers import Tokenizer

from mlsm.errors import UserError
from mlsm.hf import first_line
from mlsm.inputs import loads

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
            record = loads(line)
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
    ends now if that parent is already gone. A worker that outlives the command holds its stdout
    and stderr, so whatever reads them (a test, a pipeline) waits (seen in CI with
    `multiprocessing.Pool`); without this it would end only at its pipe's end of file, after
    the unit it is tokenising."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # no libc prctl: the pipe's end of file still ends it
        return
    if os.getppid() != parent:  # the parent died between the fork and the prctl
        os._exit(0)


def _init_worker(tokenizer_json: str, text_field: str, dtype: str, parent: int) -> None:
    # One thread per process: N workers each running a rayon pool would oversubscribe the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process handles Ctrl-C and stops us
    # A handler inherited from the parent (a training loop's "stop at the next step") would keep
    # a SIGTERM (the parent's teardown, `kill`) from ending the worker.
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

    A corpus of a single unit is tokenised in-process: workers would only add their start-up.
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
    # closed on any exit, so the workers are stopped while an error unwinds, not at interpreter exit
    with contextlib.closing(_worker_map(itertools.chain(head, units), tokenizer_json, text_field,
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


def _worker_map(units: Iterator[Unit], tokenizer_json: str, text_field: str, dtype: str,
              num_proc: int, spool: Path) -> Iterator[tuple[Path, int, np.ndarray]]:
    """(part file, number of ids, document lengths) per unit, in order, with at most
    `2 x num_proc` units read ahead.

    An error while reading is raised only after the units read before it are tokenised, so the
    first error reported is the one a single process would report.
    """
    read_error: BaseException | None = None
    submitted = yielded = 0
    replies: dict[int, tuple] = {}
    with _single_threaded(), _Workers(num_proc, (tokenizer_json, text_field, dtype),
                                      spool) as workers:
        while True:
            while read_error is None and submitted - yielded < 2 * num_proc:
                try:
                    unit = next(units)
                except StopIteration:
                    break
                except UserError as exc:
                    read_error = exc
                    break
                workers.submit(submitted, unit)
                submitted += 1
            if yielded == submitted:
                break
            while yielded not in replies:
                replies.update(workers.replies())
            reply = replies.pop(yielded)
            if isinstance(reply[0], BaseException):
                raise reply[0]
            yield (workers.part(yielded), *reply)
            yielded += 1
        if read_error is not None:
            raise read_error


class _Workers:
    """`num_proc` tokenising processes, each fed through its own pipe, with no helper thread in
    this process: `multiprocessing.Pool` runs three, and a SIGTERM during its teardown could
    leave `terminate()` joining its task thread forever (seen in CI), and a worker killed by the
    OS (out of memory) lost its unit and left `Pool` waiting for it forever. Here a stop kills
    the workers and returns; a dead worker is one clear error.

    Messages stay small so that no send can block on a full pipe: a unit's payload goes through
    a spool file (`in-N.bin`; the page cache, deleted once read), its ids come back through a
    part file (`part-N.bin`), and only (number of ids, document lengths) through the pipe."""

    def __init__(self, num_proc: int, init_args: tuple, spool: Path):
        ctx, self.spool = _context(), spool
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        self.load = [0] * num_proc  # units sent to each worker and not answered yet
        for _ in range(num_proc):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(theirs, *init_args, os.getpid()),
                               daemon=True)
            proc.start()
            theirs.close()
            self.conns.append(ours)
            self.procs.append(proc)

    def __enter__(self) -> _Workers:
        return self

    def __exit__(self, kind: Any, *_: Any) -> None:
        if kind is None:  # finished: let the workers end on their own
            for conn in self.conns:
                with contextlib.suppress(OSError):
                    conn.send(None)
        for proc in self.procs:
            proc.join(timeout=5 if kind is None else 0)
            if proc.is_alive():
                proc.kill()  # holds nothing of ours: its files are in the spool
                proc.join()
        for conn in self.conns:
            conn.close()

    def part(self, seq: int) -> Path:
        return self.spool / f"part-{seq:09d}.bin"

    def submit(self, seq: int, unit: Unit) -> None:
        """Send unit number `seq` to the least loaded worker."""
        kind, label, line, payload = unit
        data = payload if kind != "docs" else json.dumps(payload).encode("utf-8")
        path = self.spool / f"in-{seq:09d}.bin"
        path.write_bytes(data)
        w = min(range(len(self.load)), key=self.load.__getitem__)
        try:
            self.conns[w].send((seq, kind, label, line, str(path), str(self.part(seq))))
        except OSError:
            raise self._died(w) from None
        self.load[w] += 1

    def replies(self) -> dict[int, tuple]:
        """Wait for at least one worker's answer: {unit number: (number of ids, lengths) or
        (exception,)}."""
        out = {}
        for conn in mp.connection.wait(self.conns):
            w = self.conns.index(conn)
            try:
                seq, *reply = conn.recv()
            except (EOFError, OSError):
                raise self._died(w) from None
            self.load[w] -= 1
            out[seq] = tuple(reply)
        return out

    def _died(self, w: int) -> UserError:
        proc = self.procs[w]
        proc.join(timeout=1)
        return UserError(f"a tokenising process (pid {proc.pid}) ended with exit code "
                         f"{proc.exitcode} (-9: killed, often for lack of memory); re-run the "
                         "same command, with --num-proc 1 to use the least memory")


def _worker_main(conn: Any, tokenizer_json: str, text_field: str, dtype: str,
                 parent: int) -> None:
    """A worker's life: tokenise each (unit number, kind, label, line, payload file, part file)
    it is sent, answering (unit number, number of ids, lengths) or (unit number, exception),
    until it is sent None or the pipe closes."""
    try:
        _init_worker(tokenizer_json, text_field, dtype, parent)
        failed: BaseException | None = None
    except Exception as exc:  # noqa: BLE001 - sent back, raised in the parent at the first unit
        failed = exc
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        seq, kind, label, line, payload, part = task
        try:
            if failed is not None:
                raise failed
            data = Path(payload).read_bytes()
            os.unlink(payload)
            body = loads(data) if kind == "docs" else data
            ids, lengths = tokenise_unit((kind, label, line, body))
            ids.tofile(part)
            conn.send((seq, len(ids), lengths))
        except Exception as exc:  # noqa: BLE001 - the parent raises it in unit order
            conn.send((seq, _sendable(exc)))


def _sendable(exc: BaseException) -> BaseException:
    """`exc` itself if it is a UserError (bad input: its one line is the message), else a
    RuntimeError with its type and text: an arbitrary exception may not survive the pipe (one
    whose __init__ takes other arguments than its args fails to unpickle in the parent)."""
    if type(exc) is UserError:
        return exc
    return RuntimeError(f"tokenising failed in a worker: {type(exc).__name__}: {exc}")
