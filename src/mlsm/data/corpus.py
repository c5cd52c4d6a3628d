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
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from mlsm.errors import UserError
from mlsm.fileio import replace_dir
from mlsm.hf import first_line
from mlsm.hf import load_tokenizer as hf_load_tokenizer

STORE_FORMAT = "mlsm-token-store"
STORE_VERSION = 1
_TEXT_SUFFIXES = (".txt", ".txt.gz", ".jsonl", ".jsonl.gz", ".json", ".json.gz")


# --------------------------------------------------------------------------- tokenizers


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """Load a fast HF tokenizer from a folder or hub id, with a readable error."""
    try:
        tok = hf_load_tokenizer(name_or_path)
    except Exception as exc:  # HF raises many types; the user needs one line
        raise UserError(
            f"cannot load tokenizer {name_or_path!r} ({first_line(exc)}); pass a local "
            "tokenizer folder, or train one with `mlsm train-tokenizer`"
        ) from None
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


def _open_text(path: Path) -> io.TextIOBase:
    """Open a (possibly gzipped) UTF-8 file, refusing binaries up front."""
    raw = gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")  # noqa: SIM115
    head = raw.peek(8192)[:8192] if hasattr(raw, "peek") else b""
    if b"\x00" in head:
        raw.close()
        raise UserError(f"{path} looks binary (NUL bytes); pass UTF-8 text or .jsonl files only")
    return io.TextIOWrapper(raw, encoding="utf-8", errors="strict")


def _text_docs(path: Path) -> Iterator[str]:
    with _open_text(path) as fh:
        block: list[str] = []
        for line in fh:
            if line.strip():
                block.append(line.rstrip("\n"))
            elif block:
                yield "\n".join(block)
                block = []
        if block:
            yield "\n".join(block)


def _jsonl_docs(path: Path, text_field: str) -> Iterator[str]:
    with _open_text(path) as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise UserError(f"{path}:{lineno} is not valid JSON; fix the line or use a .txt file") from None
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
            except UnicodeDecodeError as exc:
                raise UserError(
                    f"{path} is not UTF-8 text (bad byte at offset {exc.start}); convert it "
                    "(e.g. iconv -t utf-8) or leave it out"
                ) from None
            except (OSError, EOFError) as exc:
                raise UserError(f"cannot read {path} ({exc}); check the file is intact") from None


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
        path = Path(path)
        meta_path = path / "meta.json"
        if not meta_path.is_file():
            raise UserError(f"{path} is not a complete token store (no meta.json); run `mlsm prepare` first")
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != STORE_FORMAT:
            raise UserError(f"{path} is not an mlsm token store; run `mlsm prepare` to make one")
        tokens = np.memmap(path / "tokens.bin", dtype=meta["dtype"], mode="r", shape=(meta["n_tokens"],))
        offsets = np.fromfile(path / "offsets.bin", dtype=np.int64)
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
    for source in sources:  # fail on a bad path before the (slower) tokenizer load
        if not source.startswith("hf:"):
            _resolve_paths(source)
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    require_mask_token(tok)
    tok_hash = tokenizer_hash(tok)
    fingerprint = _fingerprint(sources, tok_hash, text_field)
    out = Path(out)
    if (out / "meta.json").is_file():
        existing = TokenStore.open(out)
        if existing.meta.get("fingerprint") == fingerprint and not overwrite:
            return existing
        if not overwrite:
            raise UserError(f"{out} already holds a token store of other inputs; pass --overwrite or choose another --out")
    elif out.exists() and any(out.iterdir()) and not overwrite:
        raise UserError(f"{out} exists and is not a token store; choose another --out or pass --overwrite")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; a store is meant to be shared
    try:
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
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return TokenStore.open(out)

