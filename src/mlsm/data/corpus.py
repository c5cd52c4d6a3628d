"""Text sources -> token store (a flat memmap of token ids plus document offsets).

Sources are local files (`.txt`, `.txt.gz`, `.jsonl`, `.jsonl.gz`), directories and globs of
them, or Hugging Face datasets written `hf:NAME[,CONFIG][@SPLIT]`. A document is a blank-line
separated block of a text file, or one JSON record's text field.

The store is built in a temporary sibling directory and renamed into place only when complete,
so an interrupted run never leaves a store that looks finished; `meta.json` is its completion
marker. Re-running with the same inputs (same files, sizes, mtimes, tokenizer) is a no-op.
Memory stays bounded: documents stream through the tokenizer in chunks and ids are appended to
disk, so a corpus larger than RAM works.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import json
import os
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from mlsm import locking
from mlsm.errors import UserError
from mlsm.fileio import atomic_write_text, building_dir
from mlsm.hf import first_line
from mlsm.hf import load_tokenizer as hf_load_tokenizer

STORE_FORMAT = "mlsm-token-store"
STORE_VERSION = 1
_TEXT_SUFFIXES = (".txt", ".txt.gz", ".jsonl", ".jsonl.gz", ".json", ".json.gz")


# --------------------------------------------------------------------------- tokenizers


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """A fast HF tokenizer from a folder or hub id (`mlsm.hf` words the error if it cannot load)."""
    tok = hf_load_tokenizer(name_or_path)
    if not tok.is_fast:
        raise UserError(f"tokenizer {name_or_path!r} is not a fast tokenizer; convert it or train one with `mlsm train-tokenizer`")
    return tok


def require_mask_token(tok: PreTrainedTokenizerBase, where: str = "tokenizer") -> None:
    if tok.mask_token_id is None:
        raise UserError(
            f"{where} has no mask token; add one (tokenizer.add_special_tokens({{'mask_token': "
            "'[MASK]'}) then save_pretrained) or train one with `mlsm train-tokenizer`"
        )


def tokenizer_hash(tok: PreTrainedTokenizerBase) -> str:
    """Hash of what decides tokenisation: vocabulary, normaliser, pre-tokeniser, model type.

    Two tokenizers with the same hash split text into the same ids; the hash ignores padding and
    truncation settings, which vary between saved copies of one tokenizer.
    """
    spec = json.loads(tok.backend_tokenizer.to_str())
    payload = {
        "vocab": sorted(tok.get_vocab().items(), key=lambda kv: kv[1]),
        "normalizer": spec.get("normalizer"),
        "pre_tokenizer": spec.get("pre_tokenizer"),
        "model": (spec.get("model") or {}).get("type"),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def require_same_tokenizer(teacher_tok: PreTrainedTokenizerBase, store_hash: str,
                           store: str) -> None:
    """Refuse a teacher whose tokenisation differs from a token store's (`tokenizer_hash`, the
    store's own definition): its states would describe other tokens than the student sees.

    store_hash: `TokenStore.tokenizer_hash` (or the hash of the store's tokenizer); store: the
    store's path as the user named it (data.store, --store), for the message.
    """
    if tokenizer_hash(teacher_tok) == store_hash:
        return
    teacher = getattr(teacher_tok, "name_or_path", "") or "TEACHER"
    raise UserError(
        f"teacher {teacher} tokenises differently from token store {store or '(data.store)'} "
        "(another tokenizer); prepare a store with the teacher's tokenizer: "
        f"mlsm prepare SOURCES --tokenizer {teacher} --out NEW_STORE"
    )


# --------------------------------------------------------------------------- sources


def _resolve_paths(source: str) -> list[Path]:
    p = Path(source)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith(_TEXT_SUFFIXES))
        if not files:
            raise UserError(f"directory {p} holds no .txt/.txt.gz/.jsonl/.jsonl.gz files; point at text files")
        return files
    if p.is_file():
        return [p]
    if any(ch in source for ch in "*?["):
        files = sorted(Path(f) for f in glob.glob(source, recursive=True) if Path(f).is_file())
        if not files:
            raise UserError(f"glob {source!r} matches no files; check the pattern")
        return files
    raise UserError(f"corpus source {source!r} not found; pass an existing file, directory, glob or hf:NAME")


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


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text without the newline) of a UTF-8 file; a bad byte names its line."""
    with _open_bytes(path) as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                yield lineno, raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as exc:
                raise UserError(
                    f"{path}:{lineno} is not UTF-8 text (bad byte at column {exc.start + 1}); convert "
                    "the file (e.g. iconv -t utf-8) or leave it out"
                ) from None


def _text_docs(path: Path) -> Iterator[str]:
    block: list[str] = []
    for _, line in _lines(path):
        if line.strip():
            block.append(line)
        elif block:
            yield "\n".join(block)
            block = []
    if block:
        yield "\n".join(block)


def _jsonl_docs(path: Path, text_field: str) -> Iterator[str]:
    for lineno, line in _lines(path):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise UserError(f"{path}:{lineno} is not valid JSON ({first_line(exc)}); "
                            "fix the line or use a .txt file") from None
        text = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise UserError(f"{path}:{lineno} has no string field {text_field!r}; pass --text-field NAME")
        if text.strip():
            yield text


def _hf_docs(spec: str, text_field: str) -> Iterator[str]:
    name, _, split = spec[3:].partition("@")
    name, _, config = name.partition(",")
    try:
        import datasets

        ds = datasets.load_dataset(name, config or None, split=split or "train", streaming=True)
    except Exception as exc:
        raise UserError(f"cannot load HF dataset {spec!r} ({first_line(exc)}); check the name or use local files") from None
    for record in ds:
        text = record.get(text_field)
        if isinstance(text, str) and text.strip():
            yield text


def iter_documents(sources: list[str], text_field: str = "text") -> Iterator[str]:
    """Yield documents from every source in order; decoding errors name the file and the fix."""
    for source in sources:
        if source.startswith("hf:"):
            yield from _hf_docs(source, text_field)
            continue
        for path in _resolve_paths(source):
            is_json = ".json" in path.name
            docs = _jsonl_docs(path, text_field) if is_json else _text_docs(path)
            try:
                yield from docs
            except (OSError, EOFError, zlib.error) as exc:  # gzip: BadGzipFile, EOFError, zlib.error
                reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise UserError(f"cannot read {path} ({reason}); the file is damaged or truncated — restore it or leave it out") from None


def _fingerprint(sources: list[str], tok_hash: str, text_field: str) -> str:
    items: list[Any] = []
    for source in sources:
        if source.startswith("hf:"):
            items.append(source)
            continue
        for path in _resolve_paths(source):
            st = path.stat()
            items.append([str(path.resolve()), st.st_size, st.st_mtime_ns])
    payload = {"sources": items, "tokenizer": tok_hash, "text_field": text_field, "v": STORE_VERSION}
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- the store


@dataclass
class TokenStore:
    """A prepared corpus. `tokens` is a read-only memmap; document j is tokens[offsets[j]:offsets[j+1]]."""

    path: Path
    meta: dict[str, Any]
    tokens: np.ndarray
    offsets: np.ndarray

    @classmethod
    def open(cls, path: str | Path) -> TokenStore:
        """Open a store, checking that its files agree with meta.json (a one-line error if not)."""
        path = Path(path)
        if not path.is_dir():
            raise UserError(f"token store {path} not found (or not a folder); make one with `mlsm prepare SOURCES --tokenizer TOK --out {path}`")
        meta = _read_meta(path)
        if meta.get("format") != STORE_FORMAT:
            raise UserError(f"{path} is not an mlsm token store (meta.json has no format {STORE_FORMAT!r}); make one with `mlsm prepare`")
        n_tokens, n_docs = _check_files(path, meta)
        tokens = np.memmap(path / "tokens.bin", dtype=meta["dtype"], mode="r", shape=(n_tokens,))
        offsets = np.fromfile(path / "offsets.bin", dtype=np.int64)
        if offsets[0] != 0 or offsets[-1] != n_tokens or (np.diff(offsets) < 0).any():
            raise _damaged(path, "offsets.bin does not match tokens.bin")
        return cls(path=path, meta=meta, tokens=tokens, offsets=offsets)

    @property
    def n_tokens(self) -> int:
        return int(self.meta["n_tokens"])

    @property
    def n_docs(self) -> int:
        return int(self.meta["n_docs"])

    @property
    def tokenizer_hash(self) -> str:
        return str(self.meta["tokenizer_hash"])

    def load_tokenizer(self) -> PreTrainedTokenizerBase:
        return hf_load_tokenizer(self.path / "tokenizer")

    def document(self, j: int) -> np.ndarray:
        return np.asarray(self.tokens[self.offsets[j] : self.offsets[j + 1]])


def _damaged(path: Path, why: str) -> UserError:
    return UserError(f"token store {path} is damaged ({why}); rebuild it with `mlsm prepare SOURCES --tokenizer TOK --out {path} --overwrite`")


def _read_meta(path: Path) -> dict[str, Any]:
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise UserError(f"{path} is not a complete token store (no meta.json); run `mlsm prepare ... --out {path}` first")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise _damaged(path, f"meta.json is unreadable: {first_line(exc)}") from None
    if not isinstance(meta, dict):
        raise _damaged(path, "meta.json is not a JSON object")
    return meta


def _check_files(path: Path, meta: dict[str, Any]) -> tuple[int, int]:
    """(n_tokens, n_docs) after checking meta's fields and the sizes of tokens.bin/offsets.bin."""
    n_tokens, n_docs, dtype = meta.get("n_tokens"), meta.get("n_docs"), meta.get("dtype")
    if dtype not in ("uint16", "uint32") or not all(isinstance(n, int) and n > 0 for n in (n_tokens, n_docs)):
        raise _damaged(path, "meta.json lacks a valid dtype, n_tokens or n_docs")
    for name, expected in (("tokens.bin", n_tokens * np.dtype(dtype).itemsize), ("offsets.bin", (n_docs + 1) * 8)):
        file = path / name
        if not file.is_file():
            raise _damaged(path, f"{name} is missing")
        if file.stat().st_size != expected:
            raise _damaged(path, f"{name} has {file.stat().st_size:,} bytes, meta.json implies {expected:,}")
    if not (path / "tokenizer").is_dir():
        raise _damaged(path, "its tokenizer/ folder is missing")
    return n_tokens, n_docs


def _write_store(tmp: Path, docs: Iterator[str], tok: PreTrainedTokenizerBase, chunk_docs: int) -> tuple[int, int]:
    """Stream documents through the tokenizer into tmp/tokens.bin and tmp/offsets.bin."""
    dtype = np.uint16 if len(tok) < 65536 else np.uint32
    # A copy without the saved truncation/padding settings (MiniLM's truncates at 128).
    backend = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    backend.no_truncation()
    backend.no_padding()
    n_tokens, n_docs = 0, 0
    with open(tmp / "tokens.bin", "wb") as ftok, open(tmp / "offsets.bin", "wb") as foff:
        np.zeros(1, dtype=np.int64).tofile(foff)
        bar = tqdm(desc="tokenising", unit="doc", disable=None)
        for batch in _chunks(docs, chunk_docs):  # bounded memory: one chunk at a time
            encodings = backend.encode_batch(batch, add_special_tokens=False)
            lengths = np.fromiter((len(e.ids) for e in encodings), dtype=np.int64, count=len(encodings))
            if lengths.sum():
                np.concatenate([np.asarray(e.ids, dtype=dtype) for e in encodings]).tofile(ftok)
            (n_tokens + np.cumsum(lengths)).tofile(foff)
            n_tokens += int(lengths.sum())
            n_docs += len(batch)
            bar.update(len(batch))
            bar.set_postfix(tokens=n_tokens)
        bar.close()
        ftok.flush()
        os.fsync(ftok.fileno())
        foff.flush()
        os.fsync(foff.fileno())
    return n_tokens, n_docs


def _chunks(docs: Iterator[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for doc in docs:
        batch.append(doc)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def prepare_corpus(
    sources: str | list[str],
    tokenizer: str | PreTrainedTokenizerBase,
    out: str | Path,
    *,
    text_field: str = "text",
    overwrite: bool = False,
    chunk_docs: int = 512,
) -> TokenStore:
    """Tokenise `sources` with `tokenizer` into a token store at `out` and return it.

    A no-op when `out` already holds a store of the same inputs. `tokenizer` is a fast HF
    tokenizer or a folder / hub id; it must have a mask token (the store feeds masked objectives).
    """
    sources = [sources] if isinstance(sources, str) else list(sources)
    if not sources:
        raise UserError("no corpus sources given; pass files, directories, globs or hf:NAME")
    out = Path(out)
    _guard_out(out, sources)  # fail on a bad path before the (slower) tokenizer load
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    require_mask_token(tok)
    tok_hash = tokenizer_hash(tok)
    fingerprint = _fingerprint(sources, tok_hash, text_field)
    with locking.hold(out, "token store"):
        existing = _existing_store(out, overwrite)
        if existing is not None and not overwrite:
            if existing.meta.get("fingerprint") == fingerprint:
                return existing
            raise UserError(f"{out} already holds a token store of other inputs; pass --overwrite to replace it or choose another --out")
        _build_store(out, sources, tok, tok_hash, text_field, fingerprint, chunk_docs)
    return TokenStore.open(out)


_STORE_FILES = {"meta.json", "tokens.bin", "offsets.bin", "tokenizer"}


def _guard_out(out: Path, sources: list[str]) -> None:
    """Refuse an --out that is a file, holds or is inside a source, or is a folder mlsm did not write."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; pass a folder path for the token store")
    target = out.resolve()
    for source in sources:
        if source.startswith("hf:"):
            continue
        root = Path(source).resolve()
        related = Path(source).is_dir() and (root == target or root in target.parents)
        if related or any(target in f.resolve().parents or f.resolve() == target for f in _resolve_paths(source)):
            raise UserError(f"--out {out} overlaps the corpus source {source}; write the token store to a folder outside the sources")
        if target in root.parents:
            raise UserError(f"--out {out} contains the corpus source {source}; write the token store to a folder outside the sources")
    if not out.is_dir() or not any(out.iterdir()):
        return
    foreign = sorted(e.name for e in out.iterdir() if e.name not in _STORE_FILES)
    if not (out / "meta.json").is_file():
        raise UserError(f"--out {out} exists and is not a token store; choose another --out (mlsm only replaces folders it wrote)")
    if foreign:
        raise UserError(f"--out {out} holds files that are not part of a token store ({', '.join(foreign[:3])}); move them or choose another --out")


def _existing_store(out: Path, overwrite: bool) -> TokenStore | None:
    """The store at `out` (None if empty or missing). A damaged one is returned as None only
    with --overwrite; a meta.json of another format is never replaced."""
    if not (out / "meta.json").is_file():
        return None
    try:
        meta = json.loads((out / "meta.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        meta = {"format": STORE_FORMAT}  # torn: only store files are there (checked), so it is ours
    if not isinstance(meta, dict) or meta.get("format") != STORE_FORMAT:
        raise UserError(f"--out {out} holds a meta.json that is not an mlsm token store's; choose another --out")
    try:
        return TokenStore.open(out)
    except UserError:
        if overwrite:
            return None
        raise


def _build_store(out: Path, sources: list[str], tok: PreTrainedTokenizerBase, tok_hash: str,
                 text_field: str, fingerprint: str, chunk_docs: int) -> None:
    """Write the store into a hidden sibling and swap it into place when complete."""
    try:
        with building_dir(out, "partial") as tmp:
            _fill_store(tmp, sources, tok, tok_hash, text_field, fingerprint, chunk_docs)
    except OSError as exc:
        raise UserError(f"could not write token store {out} ({exc.strerror or exc}); nothing was replaced — free space and re-run") from None


def _fill_store(tmp: Path, sources: list[str], tok: PreTrainedTokenizerBase, tok_hash: str,
                text_field: str, fingerprint: str, chunk_docs: int) -> None:
    """Write tokens, offsets, tokenizer and meta.json of a store into the folder `tmp`."""
    n_tokens, n_docs = _write_store(tmp, iter_documents(sources, text_field), tok, chunk_docs)
    if n_tokens == 0:
        raise UserError(f"no text found in {', '.join(sources)}; check the paths and --text-field")
    tok.save_pretrained(tmp / "tokenizer")
    meta = {
        "format": STORE_FORMAT, "version": STORE_VERSION,
        "dtype": "uint16" if len(tok) < 65536 else "uint32",
        "n_tokens": n_tokens, "n_docs": n_docs, "vocab_size": len(tok),
        "tokenizer_hash": tok_hash, "tokenizer": getattr(tok, "name_or_path", ""),
        "sources": sources, "text_field": text_field, "fingerprint": fingerprint,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    atomic_write_text(tmp / "meta.json", json.dumps(meta, indent=2))
