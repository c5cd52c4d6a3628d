"""Text sources -> token store (a flat memmap of token ids plus document offsets).

Sources are local files (`.txt`, `.txt.gz`, `.jsonl`, `.jsonl.gz`), directories and globs of
them, or Hugging Face datasets written `hf:NAME[,CONFIG][@SPLIT]`. A document is a blank-line
separated block of a text file, or one JSON record's text field.

The store is built in a temporary sibling directory and renamed into place only when complete,
so an interrupted run never leaves a store that looks finished; `meta.json` is its completion
marker. Re-running with the same inputs (same file contents in the same order, same tokenizer;
see `sources.fingerprint`) is a no-op. Memory stays bounded: sources stream through the
tokenizer in units (on several processes, `shards`) and ids are appended to disk, so a corpus
larger than RAM works.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from mlsm.artifacts.legacy import tolerated
from mlsm.artifacts.outputs import OutputKind, guard_output, writing
from mlsm.data.shards import Unit, default_num_proc, tokenise_units
from mlsm.data.sources import (
    STORE_VERSION,
    check_max_doc_bytes,
    fingerprint,
    iter_documents,
    iter_units,
    legacy_fingerprint,
    resolve_paths,
)
from mlsm.errors import UserError
from mlsm.fileio import atomic_write_text, building_dir, remove_stale_builds
from mlsm.hf import first_line
from mlsm.hf import load_tokenizer as hf_load_tokenizer
from mlsm.inputs import field_problem, real_path, store_missing
from mlsm.limits import MAX_DOC_BYTES
from mlsm.progress import Progress

STORE_FORMAT = "mlsm-token-store"
__all__ = ["TokenStore", "iter_documents", "load_tokenizer", "prepare_corpus", "tokenizer_hash"]


# --------------------------------------------------------------------------- tokenizers


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """A fast HF tokenizer from a folder or hub id (`mlsm.hf` words the error if it cannot load)."""
    tok = hf_load_tokenizer(name_or_path)
    if not tok.is_fast:
        raise UserError(f"tokenizer {name_or_path!r} is not a fast tokenizer; convert it or train "
                        "one with `mlsm train-tokenizer`")
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


# --------------------------------------------------------------------------- the store


@dataclass
class TokenStore:
    """A prepared corpus.

    `tokens` is a read-only memmap; document j is tokens[offsets[j]:offsets[j+1]].
    """

    path: Path
    meta: dict[str, Any]
    tokens: np.ndarray
    offsets: np.ndarray

    @classmethod
    def open(cls, path: str | Path) -> TokenStore:
        """Open a store, checking that its files agree with meta.json (a one-line error if not)."""
        path = Path(path)
        missing = store_missing(path)
        if missing:
            raise UserError(missing)
        meta = _read_meta(path)
        if meta.get("format") != STORE_FORMAT:
            raise UserError(f"{path} is not an mlsm token store (meta.json has no format "
                            f"{STORE_FORMAT!r}); make one with `mlsm prepare`")
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


def check_token_ids(tokens: np.ndarray, vocab_size: int, store: object, who: str) -> None:
    """Refuse a store holding a token id that `who` (a model with `vocab_size` embeddings) cannot
    embed: a store of another tokenizer or a damaged tokens.bin would otherwise be an index error
    deep inside the first forward pass. One pass over the memmap (~1 s per GB)."""
    top = int(tokens.max()) if len(tokens) else -1
    if top >= vocab_size:
        raise UserError(f"token store {store} holds token id {top} but {who} has only "
                        f"{vocab_size} embeddings; the store was made with another tokenizer or "
                        f"is damaged: rebuild it with `mlsm prepare SOURCES --tokenizer TOK --out "
                        f"{store} --overwrite` using the model's tokenizer")


def _damaged(path: Path, why: str) -> UserError:
    return UserError(f"token store {path} is damaged ({why}); rebuild it with "
                     f"`mlsm prepare SOURCES --tokenizer TOK --out {path} --overwrite`")


def _read_meta(path: Path) -> dict[str, Any]:
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise UserError(f"{path} is not a complete token store (no meta.json); delete it and "
                        f"run `mlsm prepare SOURCES --tokenizer TOK --out {path}`")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise _damaged(path, f"meta.json is unreadable: {first_line(exc)}") from None
    if not isinstance(meta, dict):
        raise _damaged(path, "meta.json is not a JSON object")
    return meta


def recorded_fingerprint(path: str | Path) -> str | None:
    """The fingerprint a token store's meta.json records (what the stages built on it key on),
    or None where no store is yet; a meta.json that cannot be read is one line naming the
    rebuild (`_read_meta`), never taken for "no store"."""
    path = Path(path)
    if not (path / "meta.json").exists():
        return None
    fp = _read_meta(path).get("fingerprint")
    return fp if isinstance(fp, str) else None


def _check_files(path: Path, meta: dict[str, Any]) -> tuple[int, int]:
    """(n_tokens, n_docs) after checking meta's fields and the sizes of tokens.bin/offsets.bin."""
    wrong = field_problem(meta, {"n_tokens": "int", "n_docs": "int", "tokenizer_hash": "text"})
    if wrong:
        raise _damaged(path, f"meta.json: {wrong}")
    n_tokens, n_docs, dtype = meta["n_tokens"], meta["n_docs"], meta.get("dtype")
    if dtype not in ("uint16", "uint32") or n_tokens <= 0 or n_docs <= 0:
        raise _damaged(path, "meta.json lacks a valid dtype, n_tokens or n_docs")
    for name, expected in (("tokens.bin", n_tokens * np.dtype(dtype).itemsize),
                           ("offsets.bin", (n_docs + 1) * 8)):
        file = path / name
        if not file.is_file():
            raise _damaged(path, f"{name} is missing")
        if file.stat().st_size != expected:
            raise _damaged(path, f"{name} has {file.stat().st_size:,} bytes, "
                                 f"meta.json implies {expected:,}")
    if not (path / "tokenizer").is_dir():
        raise _damaged(path, "its tokenizer/ folder is missing")
    return n_tokens, n_docs


def _write_store(tmp: Path, units: Iterator[Unit], tok: PreTrainedTokenizerBase, text_field: str,
                 num_proc: int, max_docs: int | None = None) -> tuple[int, int]:
    """Tokenise `units` (on `num_proc` processes) into tmp/tokens.bin and tmp/offsets.bin; with
    `max_docs`, the first that many documents only (the rest of the corpus is never read)."""
    dtype = "uint16" if len(tok) < 65536 else "uint32"
    n_tokens, n_docs = 0, 0
    # unbuffered: worker parts are appended to it by the kernel (`shards._append_file`)
    with (open(tmp / "tokens.bin", "wb", buffering=0) as ftok,
          open(tmp / "offsets.bin", "wb") as foff):
        parts = tokenise_units(units, tok.backend_tokenizer.to_str(), text_field, dtype, num_proc,
                               ftok, tmp)
        np.zeros(1, dtype=np.int64).tofile(foff)
        bar = Progress(None, "tokenising", "doc")
        with contextlib.closing(parts):  # an error or a signal stops its workers at once
            for n_ids, lengths in parts:  # in document order, one unit at a time
                if max_docs is not None and n_docs + len(lengths) >= max_docs:
                    lengths = lengths[:max_docs - n_docs]
                    n_ids = int(np.sum(lengths))
                (n_tokens + np.cumsum(lengths)).tofile(foff)
                n_tokens += n_ids
                n_docs += len(lengths)
                bar.update(len(lengths))
                bar.set_postfix(tokens=n_tokens)
                if n_docs == max_docs:
                    break
        bar.close()
        if max_docs is not None:  # the last unit's documents past the limit, and any unit a
            ftok.truncate(n_tokens * np.dtype(dtype).itemsize)  # worker appended meanwhile
        os.fsync(ftok.fileno())
        foff.flush()
        os.fsync(foff.fileno())
    return n_tokens, n_docs


def prepare_corpus(
    sources: str | list[str],
    tokenizer: str | PreTrainedTokenizerBase,
    out: str | Path,
    *,
    text_field: str = "text",
    overwrite: bool = False,
    chunk_docs: int = 512,
    num_proc: int | None = None,
    max_doc_bytes: int = MAX_DOC_BYTES,
    max_docs: int | None = None,
) -> TokenStore:
    """Tokenise `sources` with `tokenizer` into a token store at `out` and return it.

    A no-op when `out` already holds a store of the same inputs. `tokenizer` is a fast HF
    tokenizer or a folder / hub id; it must have a mask token (the store feeds masked objectives).
    `num_proc` tokenising processes (default: every CPU this process may use) write the same
    store, byte for byte, as one. A document longer than `max_doc_bytes` is refused. `max_docs`:
    the first that many documents of the sources only, for a first try that must not tokenise a
    whole corpus (part of the store's fingerprint; None, the default, leaves it as it was).
    """
    if isinstance(sources, str | Path):
        sources = [str(sources)]
    if not isinstance(sources, list | tuple) or not all(isinstance(s, str | Path) for s in sources):
        raise UserError(f"sources must be a path or a list of paths (files, directories, globs or "
                        f"hf:NAME), got {sources!r}")
    sources = [str(s) for s in sources]
    if not sources:
        raise UserError("no corpus sources given; pass files, directories, globs or hf:NAME")
    if num_proc is not None and (isinstance(num_proc, bool) or not isinstance(num_proc, int)
                                 or num_proc < 1):
        raise UserError(f"--num-proc must be a positive number of processes, got {num_proc!r}")
    check_max_doc_bytes(max_doc_bytes)
    out = Path(out)
    _guard_out(out, sources)  # fail on a bad path before the (slower) tokenizer load
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    require_mask_token(tok)
    tok_hash = tokenizer_hash(tok)
    fp = fingerprint(sources, tok_hash, text_field)
    if max_docs is not None:  # a prefix is other inputs; stores without a limit keep their fp
        fp = hashlib.sha256(f"{fp} max_docs={max_docs}".encode()).hexdigest()[:16]
    with writing(out, STORE_KIND):
        existing = _existing_store(out, overwrite)
        if existing is not None and not overwrite:
            legacy = lambda: legacy_fingerprint(sources, tok_hash, text_field)  # noqa: E731
            if _same_inputs(existing, fp, legacy):
                return existing
            raise UserError(f"{out} already holds a token store of other inputs; pass --overwrite "
                            "to replace it or choose another --out")
        num_proc = default_num_proc() if num_proc is None else num_proc
        _build_store(out, sources, tok, tok_hash, text_field, fp, (chunk_docs, max_doc_bytes),
                     num_proc, max_docs)
    return TokenStore.open(out)


def _same_inputs(store: TokenStore, fp: str, legacy: Callable[[], str]) -> bool:
    """Whether `store` was built from inputs with content fingerprint `fp`.

    A store written before content fingerprints carries only the (path, size, mtime) one; if
    that matches, the content fingerprint is recorded as `input_fingerprint` so that the store
    survives a re-mount or a move from then on. `fingerprint` itself is left alone: target
    stores name their token store by it.
    """
    meta = store.meta
    if fp in (meta.get("input_fingerprint"), meta.get("fingerprint")):
        return True
    if not tolerated("store-path-fingerprint") or "input_fingerprint" in meta \
            or meta.get("fingerprint") != legacy():
        return False
    meta["input_fingerprint"] = fp
    with contextlib.suppress(OSError):  # a read-only store is still right, just not upgraded
        atomic_write_text(store.path / "meta.json", json.dumps(meta, indent=2))
    return True


_STORE_FILES = {"meta.json", "tokens.bin", "offsets.bin", "tokenizer"}


STORE_KIND = OutputKind("token store", files=_STORE_FILES.__contains__,
                        ours=lambda out: (out / "meta.json").is_file())


def _guard_out(out: Path, sources: list[str]) -> None:
    """Refuse an --out that is a file, holds or is inside a source, or is a folder mlsm did not
    write as a token store."""
    check_apart_from_sources([out], sources, "--out", "write the token store to a folder outside "
                             "the sources")
    guard_output(out, STORE_KIND)


def check_apart_from_sources(outs: list[Path], sources: list[str], name: str, fix: str,
                             contains: bool = True, missing_ok: bool = False) -> None:
    """Refuse an output path that is a corpus source, lies inside one, or (`contains`) holds one
    (a source is a file, a folder or the files of a glob): writing there would mix outputs into
    the corpus, and replacing the output would delete it. `outs`: the output paths, `name` how
    they were given (`--out`, a study's `out`), `fix` what to do instead. missing_ok: skip
    sources that name no files now (a study re-read after its corpus moved)."""
    for source in sources:
        if source.startswith("hf:"):
            continue
        root = real_path(source)
        try:
            files = [real_path(f) for f in resolve_paths(source)]
        except UserError:
            if not missing_ok:
                raise
            files = []
        for out in outs:
            target = real_path(out)
            related = Path(source).is_dir() and (root == target or root in target.parents)
            if related or any(f == target or (contains and target in f.parents) for f in files):
                raise UserError(f"{name} {out} overlaps the corpus source {source}; {fix}")
            if contains and target in root.parents:
                raise UserError(f"{name} {out} contains the corpus source {source}; {fix}")


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
        raise UserError(f"--out {out} holds a meta.json that is not an mlsm token store's; "
                        "choose another --out")
    try:
        return TokenStore.open(out)
    except UserError:
        if overwrite:
            return None
        raise


def _build_store(out: Path, sources: list[str], tok: PreTrainedTokenizerBase, tok_hash: str,
                 text_field: str, fp: str, chunks: tuple[int, int], num_proc: int,
                 max_docs: int | None = None) -> None:
    """Write the store into a hidden sibling and swap it into place when complete (the caller
    holds the store's lock, so a build folder left by a killed run is removed first)."""
    remove_stale_builds(out, "partial")
    try:
        with building_dir(out, "partial") as tmp:
            _fill_store(tmp, sources, tok, tok_hash, text_field, fp, chunks, num_proc, max_docs)
    except OSError as exc:
        raise UserError(f"could not write token store {out} ({exc.strerror or exc}); nothing was "
                        "replaced — free space and re-run") from None


def _fill_store(tmp: Path, sources: list[str], tok: PreTrainedTokenizerBase, tok_hash: str,
                text_field: str, fp: str, chunks: tuple[int, int], num_proc: int,
                max_docs: int | None = None) -> None:
    """Write tokens, offsets, tokenizer and meta.json of a store into the folder `tmp`.
    chunks: (documents per unit, longest document in bytes)."""
    units = iter_units(sources, text_field, *chunks)
    n_tokens, n_docs = _write_store(tmp, units, tok, text_field, num_proc, max_docs)
    if n_tokens == 0:
        raise UserError(f"no text found in {', '.join(sources)}; check the paths and --text-field")
    tok.save_pretrained(tmp / "tokenizer")
    meta = {
        "format": STORE_FORMAT, "version": STORE_VERSION,
        "dtype": "uint16" if len(tok) < 65536 else "uint32",
        "n_tokens": n_tokens, "n_docs": n_docs, "vocab_size": len(tok),
        "tokenizer_hash": tok_hash, "tokenizer": getattr(tok, "name_or_path", ""),
        "sources": sources, "text_field": text_field,
        "fingerprint": fp, "input_fingerprint": fp,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if max_docs is not None:  # a store without the limit keeps its meta.json as it was
        meta["max_docs"] = max_docs
    atomic_write_text(tmp / "meta.json", json.dumps(meta, indent=2))
