"""Target store: MLSM's sparse codes for every token of a token store, computed once.

The teacher reads *unmasked* text (Berend 2023, §3), so the code of a position depends only on the
tokens of its packed chunk — not on which positions a run masks, nor on the step or the objective.
`build_target_store` therefore runs teacher + sparse coding once over every packed chunk
(`BatchSource.chunk_tokens`, chunk c = the c-th max_len window of the store) and keeps, for each
body position t = 1 .. max_len − 2, the top-`nnz` entries of the code. Training with
`objective.targets=DIR` then reads the selected positions' codes from disk and never loads the
teacher.

Layout of DIR:
  indices.bin   (n_chunks, max_len − 2, nnz) int16 (k ≤ 32767) or int32, atom ids, padding = 0
  values.bin    (n_chunks, max_len − 2, nnz) float16 code values, sorted descending, padding = 0
  build.json    what is being built (written first; a resumed build must match it)
  progress.json chunks written so far (the build proceeds chunk-range by chunk-range)
  meta.json     written last, atomically = the completion marker (build.json + statistics)
A killed build resumes from progress.json. Codes with more than nnz non-zeros lose their
smallest entries (counted in meta["truncated"]); the target is renormalised over what is kept.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from mlsm import locking
from mlsm.errors import UserError
from mlsm.fileio import atomic_write_json
from mlsm.teacher.dictionary import Dictionary, load_dictionary
from mlsm.teacher.sparse_coding import sparse_encode, top_nnz
from mlsm.teacher.teacher import Teacher

TARGETS_FORMAT = "mlsm-targets"


def dictionary_hash(dictionary: Dictionary) -> str:
    """Content hash of the atoms (float32 bytes), so a renamed copy still matches."""
    data = dictionary.atoms.detach().cpu().float().contiguous().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


_FILES = {"build.json", "progress.json", "meta.json", "indices.bin", "values.bin"}


def _read_json(path: Path) -> Any:
    """A JSON file's content, or None if it is missing or unreadable (torn)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def _nbytes(spec: dict[str, Any], name: str, n_chunks: int) -> int:
    """Bytes of `n_chunks` chunks in data file `name`."""
    dtype = spec["index_dtype"] if name == "indices.bin" else "float16"
    return n_chunks * (spec["max_len"] - 2) * spec["nnz"] * np.dtype(dtype).itemsize


@dataclass
class TargetStore:
    """A complete target store opened read-only: per-chunk, per-position top-nnz codes."""

    path: Path
    meta: dict[str, Any]
    indices: np.ndarray  # (n_chunks, max_len - 2, nnz) memmap
    values: np.ndarray  # (n_chunks, max_len - 2, nnz) memmap, float16

    @classmethod
    def open(cls, path: str | Path) -> TargetStore:
        """Open a complete store, checking meta.json and the data files' sizes (one line if not)."""
        path = Path(path)
        if not (path / "meta.json").is_file():
            raise UserError(f"{path} is not a complete target store (no meta.json); build or resume it with `mlsm targets --out {path}`")
        damaged = f"target store {path} is damaged ({{}}); re-run the `mlsm targets` command that built it (same --out) to repair it"
        meta = _read_json(path / "meta.json")
        if not isinstance(meta, dict):
            raise UserError(damaged.format("meta.json is unreadable"))
        if meta.get("format") != TARGETS_FORMAT:
            raise UserError(f"{path} is not an mlsm target store; build one with `mlsm targets`")
        try:
            shape = (int(meta["n_chunks"]), int(meta["max_len"]) - 2, int(meta["nnz"]))
            sizes = {name: _nbytes(meta, name, shape[0]) for name in ("indices.bin", "values.bin")}
        except (KeyError, TypeError, ValueError):
            raise UserError(damaged.format("meta.json lacks its shape")) from None
        for name, size in sizes.items():
            have = (path / name).stat().st_size if (path / name).is_file() else None
            if have != size:
                raise UserError(damaged.format(f"{name} is missing" if have is None else f"{name} has {have:,} bytes, expected {size:,}"))
        indices = np.memmap(path / "indices.bin", dtype=meta["index_dtype"], mode="r", shape=shape)
        values = np.memmap(path / "values.bin", dtype=np.float16, mode="r", shape=shape)
        return cls(path, meta, indices, values)

    @property
    def k(self) -> int:
        return int(self.meta["k"])

    def dense(self, chunks: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        """Dense float32 codes (N, k) of sequence positions (1 .. max_len − 2) of packed chunks."""
        idx = torch.from_numpy(self.indices[chunks, positions - 1].astype(np.int64))  # (N, nnz)
        val = torch.from_numpy(self.values[chunks, positions - 1].astype(np.float32))  # (N, nnz)
        return val.new_zeros(len(chunks), self.k).scatter_add_(1, idx, val)


def _spec(store: Any, dictionary: Dictionary, teacher: Teacher, max_len: int, nnz: int, lam: float,
          n_chunks: int) -> dict[str, Any]:
    from mlsm.data.corpus import tokenizer_hash  # corpus pulls in the tokenizers stack

    return {
        "format": TARGETS_FORMAT, "version": 1,
        "store": str(Path(store.path).resolve()), "store_fingerprint": store.meta.get("fingerprint"),
        "store_n_tokens": store.n_tokens, "tokenizer_hash": tokenizer_hash(teacher.tokenizer),
        "dictionary_hash": dictionary_hash(dictionary), "dictionary_meta": dictionary.meta,
        "teacher": teacher.name, "layer": teacher.layer, "lam": lam, "k": dictionary.k,
        "max_len": max_len, "nnz": nnz, "n_chunks": n_chunks,
        "index_dtype": "int16" if dictionary.k <= np.iinfo(np.int16).max else "int32",
    }


def _open_arrays(out: Path, spec: dict[str, Any], done: int) -> tuple[np.memmap, np.memmap, int]:
    """Open indices.bin and values.bin for writing; returns them and how many leading chunks
    can be trusted: `done`, or 0 when a file was deleted or truncated since (then every chunk
    is recomputed, which also keeps meta["truncated"] exact)."""
    n = spec["n_chunks"]
    arrays = []
    for name, dtype in (("indices.bin", spec["index_dtype"]), ("values.bin", "float16")):
        path, size = out / name, _nbytes(spec, name, n)
        have = path.stat().st_size if path.is_file() else 0
        if have != size:
            done = 0
            with open(path, "ab") as fh:
                fh.truncate(size)  # grow (zero-filled) or cut to the full size
        arrays.append(np.memmap(path, dtype=dtype, mode="r+", shape=(n, spec["max_len"] - 2, spec["nnz"])))
    return arrays[0], arrays[1], done


def check_targets_out(out: str | Path) -> None:
    """Refuse an --out that is a file or a folder that is not (the start of) a target store."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; pass a folder path for the target store")
    names = {e.name for e in out.iterdir()} if out.is_dir() else set()
    foreign = sorted(names - _FILES)
    if names and "build.json" not in names:
        raise UserError(f"--out {out} exists and is not a target store; choose another --out (mlsm only writes into folders it created)")
    if foreign:
        raise UserError(f"--out {out} holds files that are not part of a target store ({', '.join(foreign[:3])}); move them or choose another --out")


def _start(out: Path, spec: dict[str, Any]) -> tuple[int, int]:
    """Create or re-open a build folder; return (chunks written per progress.json, truncated)."""
    check_targets_out(out)
    out.mkdir(parents=True, exist_ok=True)
    build, expected = out / "build.json", json.loads(json.dumps(spec))
    old = _read_json(build) if build.is_file() else None
    if isinstance(old, dict) and old != expected:
        diff = [k for k in spec if old.get(k) != expected[k]]
        raise UserError(f"{out} holds a target store built with other settings ({', '.join(diff)}); choose another --out")
    if not isinstance(old, dict):  # new, or torn: only our files are there, so start over
        for name in ("meta.json", "progress.json"):
            (out / name).unlink(missing_ok=True)
        atomic_write_json(build, spec)
    progress = _read_json(out / "progress.json")
    if not isinstance(progress, dict) or not isinstance(progress.get("done"), int) or not 0 <= progress["done"] <= spec["n_chunks"]:
        return 0, 0
    return progress["done"], int(progress.get("truncated", 0))


@torch.no_grad()
def _encode_chunks(ids: np.ndarray, teacher: Teacher, atoms: torch.Tensor, gram: torch.Tensor,
                   lam: float) -> torch.Tensor:
    """Codes (B·(T−2), k) of the body positions of chunks (B, T), as the online MLSM computes them."""
    x = torch.from_numpy(ids).to(teacher.device)
    h = teacher.hidden_states(x, torch.ones_like(x))[:, 1:-1]  # (B, T-2, d), unmasked input
    h = F.normalize(h.reshape(-1, h.shape[-1]).float(), dim=-1)  # (B·(T-2), d)
    return sparse_encode(h, atoms, lam, gram=gram)


def build_target_store(store_path: str | Path, dictionary: Dictionary | str | Path, teacher: Teacher,
                       max_len: int, out: str | Path, nnz: int = 32, batch_size: int = 64,
                       lam: float | None = None) -> Path:
    """Compute the codes of every body position of every packed chunk of a token store.

    Resumable (re-run with the same arguments after a kill); returns `out`. batch_size = chunks
    per teacher forward and per progress record.
    """
    from mlsm.config import DataConfig
    from mlsm.data.batches import BatchSource
    from mlsm.data.corpus import TokenStore, tokenizer_hash

    store = TokenStore.open(store_path)
    if not isinstance(dictionary, Dictionary):
        dictionary = load_dictionary(dictionary)
    dictionary.check_teacher(teacher)
    if tokenizer_hash(teacher.tokenizer) != store.tokenizer_hash:
        raise UserError("the teacher tokenises differently from the token store; prepare the corpus with the teacher's tokenizer (mlsm prepare --tokenizer TEACHER)")
    if not 1 <= nnz <= dictionary.k:
        raise UserError(f"--nnz must be between 1 and k={dictionary.k} (got {nnz}); 32 keeps almost every code whole")
    source = BatchSource(store, DataConfig(store=str(store.path), max_len=max_len), store.load_tokenizer())
    lam = float(lam or dictionary.lam)
    spec = _spec(store, dictionary, teacher, max_len, nnz, lam, source.n_sequences)
    out = Path(out)
    with locking.hold(out, "target store"):
        return _build(out, spec, source, teacher, dictionary, lam, batch_size)


def _build(out: Path, spec: dict[str, Any], source: Any, teacher: Teacher, dictionary: Dictionary,
           lam: float, batch_size: int) -> Path:
    """Resume (or start) the build at `out`, under its lock; returns `out`."""
    try:
        return _resume(out, spec, source, teacher, dictionary, lam, batch_size)
    except OSError as exc:
        raise UserError(f"could not write target store {out} ({exc.strerror or exc}); free space and re-run the same command to resume") from None


def _resume(out: Path, spec: dict[str, Any], source: Any, teacher: Teacher, dictionary: Dictionary,
            lam: float, batch_size: int) -> Path:
    done, truncated = _start(out, spec)  # raises if `out` was built with other settings
    if (out / "meta.json").is_file():
        try:
            TargetStore.open(out)
            return out
        except UserError:  # complete but damaged since: recompute what is missing below
            (out / "meta.json").unlink()
    indices, values, verified = _open_arrays(out, spec, done)
    if verified < done:
        print(f"mlsm: a data file of {out} is missing or truncated; recomputing its {done} chunks", file=sys.stderr, flush=True)
        done, truncated = 0, 0
    nnz, max_len = spec["nnz"], spec["max_len"]
    atoms = dictionary.atoms.to(teacher.device).float()  # (d, k)
    gram = atoms.T @ atoms  # (k, k)
    bar = tqdm(total=spec["n_chunks"], initial=done, desc="targets", unit="chunk", disable=None)
    for start in range(done, spec["n_chunks"], batch_size):
        stop = min(start + batch_size, spec["n_chunks"])
        codes = _encode_chunks(source.chunk_tokens(np.arange(start, stop)), teacher, atoms, gram, lam)
        truncated += int(((codes > 0).sum(1) > nnz).sum())
        top = top_nnz(codes, nnz)  # (n, nnz) each, sorted descending
        shape = (stop - start, max_len - 2, nnz)
        indices[start:stop] = top.indices.cpu().numpy().astype(indices.dtype).reshape(shape)
        values[start:stop] = top.values.cpu().numpy().astype(np.float16).reshape(shape)
        indices.flush()
        values.flush()
        atomic_write_json(out / "progress.json", {"done": stop, "truncated": truncated})
        bar.update(stop - start)
    bar.close()
    atomic_write_json(out / "meta.json", {**spec, "truncated": truncated, "n_positions": spec["n_chunks"] * (max_len - 2)})
    return out


class StoredTargets:
    """MLSM target provider reading a target store: same `codes(batch)` as the online TargetCoder.

    cfg: the MLSM config (targets, dictionary, layer, lam); the teacher is never loaded.
    """

    def __init__(self, cfg: Any, ctx: Any):
        from mlsm.data.corpus import TokenStore, tokenizer_hash

        self.store = TargetStore.open(cfg.targets)
        meta = self.store.meta
        if not ctx.store_path:
            raise UserError("objective.targets needs data.store to be set (the targets belong to one token store)")
        tokens = TokenStore.open(ctx.store_path)
        if (tokens.meta.get("fingerprint"), tokens.n_tokens) != (meta["store_fingerprint"], meta["store_n_tokens"]):
            raise UserError(f"target store {cfg.targets} was built from another token store ({meta['store']}); rebuild it with `mlsm targets --store {ctx.store_path}`")
        if tokenizer_hash(ctx.tokenizer) != meta["tokenizer_hash"]:
            raise UserError(f"target store {cfg.targets} was built with another tokenizer; rebuild it for this token store")
        if int(ctx.max_len) != int(meta["max_len"]):
            raise UserError(f"target store {cfg.targets} was built for max_len={meta['max_len']} but data.max_len={ctx.max_len}; rebuild it with --max-len {ctx.max_len}")
        if cfg.dictionary and dictionary_hash(load_dictionary(cfg.dictionary)) != meta["dictionary_hash"]:
            raise UserError(f"target store {cfg.targets} was built with another dictionary than {cfg.dictionary}; rebuild it or drop objective.dictionary")
        if cfg.layer >= 0 and cfg.layer != int(meta["layer"]):
            raise UserError(f"target store {cfg.targets} holds layer-{meta['layer']} codes but objective.layer={cfg.layer}; rebuild it with --layer {cfg.layer}")
        if cfg.lam and abs(cfg.lam - float(meta["lam"])) > 1e-12:
            raise UserError(f"target store {cfg.targets} was coded with λ={meta['lam']} but objective.lam={cfg.lam}; drop objective.lam or rebuild")
        self.k = self.store.k
        self.device = ctx.device

    @torch.no_grad()
    def codes(self, batch: Any) -> torch.Tensor:
        """Codes (N, k) of the selected positions, rows in row-major order of batch.selected."""
        rows, cols = batch.selected.cpu().nonzero(as_tuple=True)  # (N,), (N,)
        chunks = batch.chunks.cpu()[rows].numpy()
        return self.store.dense(chunks, cols.numpy()).to(batch.input_ids.device)
