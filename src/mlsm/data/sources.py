"""Corpus sources: files, directories, globs and `hf:` datasets, read as units of raw bytes.

Also the inputs' fingerprint, which decides whether an existing token store can be reused. It
covers what decides the tokens — each file's bytes, how it is parsed, the source order, the
tokenizer and the text field — and nothing else: not the absolute path, not the mtime. A
re-mounted or moved corpus with the same bytes is the same input.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import json
import re
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from mlsm.artifacts.fingerprint import content_digest
from mlsm.data.shards import Unit, unit_documents
from mlsm.errors import UserError
from mlsm.inputs import real_path
from mlsm.limits import MAX_DOC_BYTES

STORE_VERSION = 1
TEXT_SUFFIXES = (".txt", ".txt.gz", ".jsonl", ".jsonl.gz", ".json", ".json.gz")
UNIT_BYTES = 1 << 20  # a unit ends after this many raw bytes (or `chunk_docs` lines)
READ_BYTES = 1 << 20  # bytes read (after gunzip) at a time
# A line holding only ASCII whitespace (what bytes.strip() removes), complete: "\n" both sides.
_BLANK_LINE = re.compile(rb"\n[ \t\r\x0b\x0c]*\n")


def resolve_paths(source: str) -> list[Path]:
    """The files a (non-hf) source names, sorted; a one-line error if there are none."""
    p = Path(source)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith(TEXT_SUFFIXES))
        if not files:
            raise UserError(f"directory {p} holds no .txt/.txt.gz/.jsonl/.jsonl.gz files; "
                            "point at text files")
        return files
    if p.is_file():
        return [p]
    if any(ch in source for ch in "*?["):
        files = sorted(Path(f) for f in glob.glob(source, recursive=True) if Path(f).is_file())
        if not files:
            raise UserError(f"glob {source!r} matches no files; check the pattern")
        return files
    raise UserError(f"corpus source {source!r} not found; pass an existing file, directory, "
                    "glob or hf:NAME")


def _open_bytes(path: Path) -> io.BufferedIOBase:
    """Open a (possibly gzipped) file for binary line reading, refusing binaries up front."""
    raw = gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")  # noqa: SIM115
    try:
        head = raw.peek(8192)[:8192]
    except BaseException:
        raw.close()
        raise
    if b"\x00" in head:
        raw.close()
        raise UserError(f"{path} looks binary (NUL bytes); pass UTF-8 text or .jsonl files only")
    return raw


def _kind(path: Path) -> str:
    return "jsonl" if ".json" in path.name else "text"


def _unit_end(buf: bytearray, kind: str, chunk_lines: int, scan_from: int) -> int | None:
    """Where the unit at the start of `buf` ends: the first line start, at or after
    `chunk_lines` lines or `UNIT_BYTES` bytes, where a document may begin (any line of a
    JSON-lines file; an ASCII-blank line of a text file). None while `buf` holds no such point;
    `scan_from` skips the part of `buf` already searched in vain."""
    threshold = 0
    for _ in range(max(1, chunk_lines)):
        newline = buf.find(b"\n", threshold, UNIT_BYTES)
        if newline < 0:
            if len(buf) < UNIT_BYTES:
                return None
            threshold = UNIT_BYTES
            break
        threshold = newline + 1
    start = max(threshold - 1, scan_from)
    if kind == "jsonl":
        newline = buf.find(b"\n", start)
        return None if newline < 0 else newline + 1
    blank = _BLANK_LINE.search(buf, start)
    return None if blank is None else blank.start() + 1


def _too_long(path: Path, line: int, limit: int, what: str) -> UserError:
    return UserError(f"{path}:{line}: {what} is longer than {limit:,} bytes (--max-doc-bytes); "
                     "split it into documents, or raise --max-doc-bytes if it is meant to be one")


def _line_lengths(block: bytes, pending: int) -> tuple[np.ndarray, int]:
    """The lengths (bytes, without the newline) of the lines `block` ends, the first one
    continuing a line of `pending` bytes; and the length of the line it leaves unfinished."""
    ends = np.flatnonzero(np.frombuffer(block, dtype=np.uint8) == 10)  # (n,) "\n" positions
    if not len(ends):
        return ends, pending + len(block)
    lengths = np.diff(ends, prepend=-1) - 1
    lengths[0] += pending
    return lengths, len(block) - int(ends[-1]) - 1


def _file_units(path: Path, chunk_lines: int,
                max_doc_bytes: int = MAX_DOC_BYTES) -> Iterator[Unit]:
    """One file's raw bytes in units of whole lines; a text unit ends only before an
    (ASCII-)blank line, so a document never spans two units. Only bytes are handled here: the
    workers decode, parse and tokenise (see `shards`). A line, or a text document, longer than
    `max_doc_bytes` is refused here, before the buffer or the tokeniser holds it."""
    kind, label = _kind(path), str(path)
    buf, first, scan_from = bytearray(), 1, 0
    lines, pending = 0, 0  # complete lines read, bytes of the line being read
    with _open_bytes(path) as fh:
        for block in iter(lambda: fh.read(READ_BYTES), b""):
            lengths, pending = _line_lengths(block, pending)
            if len(lengths) and int(lengths.max()) > max_doc_bytes:
                raise _too_long(path, lines + 1 + int(np.argmax(lengths > max_doc_bytes)),
                                max_doc_bytes, "a line")
            lines += len(lengths)
            if pending > max_doc_bytes:
                raise _too_long(path, lines + 1, max_doc_bytes, "a line")
            if len(buf) > UNIT_BYTES + max_doc_bytes:  # no document boundary for that long
                raise _too_long(path, first, max_doc_bytes, "a document (no blank line)")
            # a boundary not found yet needs a line ending in `block`: search from the last
            # "\n" before it (found from where the previous search began: linear, not quadratic)
            scan_from = max(scan_from, buf.rfind(b"\n", scan_from))
            buf += block
            while (end := _unit_end(buf, kind, chunk_lines, scan_from)) is not None:
                payload = bytes(buf[:end])
                del buf[:end]
                scan_from = 0
                yield kind, label, first, payload
                first += payload.count(b"\n")
    if buf:
        yield kind, label, first, bytes(buf)


def _hf_units(spec: str, text_field: str, chunk_docs: int,
              max_doc_bytes: int = MAX_DOC_BYTES) -> Iterator[Unit]:
    from mlsm.hf import first_line

    name, _, split = spec[3:].partition("@")
    name, _, config = name.partition(",")
    try:
        import datasets

        # streaming: records are fetched as they are read, never materialised on disk or in RAM
        ds = datasets.load_dataset(name, config or None, split=split or "train", streaming=True)
    except Exception as exc:
        raise UserError(f"cannot load HF dataset {spec!r} ({first_line(exc)}); check the name "
                        "or use local files") from None
    docs: list[str] = []
    for record in ds:
        text = record.get(text_field)
        if isinstance(text, str) and text.strip():
            if len(text) > max_doc_bytes // 4 and len(text.encode()) > max_doc_bytes:
                raise UserError(f"{spec}: a record's {text_field!r} is longer than "
                                f"{max_doc_bytes:,} bytes (--max-doc-bytes); raise "
                                "--max-doc-bytes if it is meant to be one document")
            docs.append(text)
        if len(docs) == chunk_docs:
            yield "docs", spec, 0, docs
            docs = []
    if docs:
        yield "docs", spec, 0, docs


def iter_units(sources: list[str], text_field: str = "text", chunk_docs: int = 512,
               max_doc_bytes: int = MAX_DOC_BYTES) -> Iterator[Unit]:
    """Every source's units in order; a damaged file, or a document longer than
    `max_doc_bytes`, is one line naming it."""
    check_max_doc_bytes(max_doc_bytes)
    for source in sources:
        if source.startswith("hf:"):
            yield from _hf_units(source, text_field, chunk_docs, max_doc_bytes)
            continue
        for path in resolve_paths(source):
            try:
                yield from _file_units(path, chunk_docs, max_doc_bytes)
            except (OSError, EOFError, zlib.error) as exc:  # gzip: BadGzipFile, EOFError, zlib
                reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise UserError(f"cannot read {path} ({reason}); the file is damaged or truncated "
                                "— restore it or leave it out") from None


def check_max_doc_bytes(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"--max-doc-bytes must be a positive number of bytes, got {value!r}")


def iter_documents(sources: list[str], text_field: str = "text",
                   max_doc_bytes: int = MAX_DOC_BYTES) -> Iterator[str]:
    """Yield documents from every source in order; decoding errors name the file and the fix."""
    for unit in iter_units(sources, text_field, max_doc_bytes=max_doc_bytes):
        yield from unit_documents(unit, text_field)


# --------------------------------------------------------------------------- fingerprints


def _per_file(sources: list[str], describe: Callable[[Path], list[Any]]) -> list[Any]:
    """`describe(path)` of every file of the sources, in order; `hf:` sources by name."""
    items: list[Any] = []
    for source in sources:
        if source.startswith("hf:"):
            items.append(source)
            continue
        items += [describe(path) for path in resolve_paths(source)]
    return items


def fingerprint(sources: list[str], tok_hash: str, text_field: str) -> str:
    """Content fingerprint of the inputs: per file (in source order) how it is parsed, its size
    and `content_digest`; `hf:` sources by name."""
    items = _per_file(sources, lambda path: [_kind(path), path.name.endswith(".gz"),
                                             path.stat().st_size, content_digest(path)])
    payload = {"sources": items, "tokenizer": tok_hash, "text_field": text_field,
               "v": STORE_VERSION, "scheme": "content"}
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:16]


def legacy_fingerprint(sources: list[str], tok_hash: str, text_field: str) -> str:
    """The fingerprint stores written before the content scheme carry: (absolute path, size,
    mtime) per file. Kept only to recognise those stores, never to write new ones."""
    items = _per_file(sources, lambda path: [str(real_path(path)), path.stat().st_size,
                                             path.stat().st_mtime_ns])
    payload = {"sources": items, "tokenizer": tok_hash, "text_field": text_field,
               "v": STORE_VERSION}
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:16]
