"""Target store: MLSM's sparse codes for every token of a token store, computed once.

The teacher reads *unmasked* text (MLSM, Berend 2023), so the code of a position depends only on the
tokens of its packed chunk — not on which positions a run masks, nor on the step or the objective.
`build_target_store` therefore runs teacher + sparse coding once over every packed chunk
(`BatchSource.chunk_tokens`, chunk c = the c-th max_len window of the store) and keeps the code of
each body position t = 1 .. max_len − 2. Training with `objective.targets=DIR` then reads the
selected positions' codes from disk and never loads the teacher.

Codes are stored whole by default (variable-length rows, like a CSR matrix): a position keeps
every non-zero of its code, so stored and online targets have the same support and differ only by
fp16 rounding of the values. `nnz=N` caps each row at its N largest entries instead (smaller
files); the share of codes that lose entries is printed and recorded in meta["truncated"].

Layout of DIR (P = max_len − 2 body positions per chunk):
  counts.bin    (n_chunks, P) uint16, non-zeros kept per position
  chunk_ptr.bin (n_chunks + 1,) int64, offset of each chunk's first entry in the two files below
  indices.bin   (n_entries,) int16 (k ≤ 32767) or int32, atom ids; per position, largest value first
  values.bin    (n_entries,) float16 code values
  build.json    what is being built (written first; a resumed build must match it)
  progress.json chunks and entries written so far (the build proceeds chunk-range by chunk-range)
  meta.json     written last, atomically = the completion marker (build.json + statistics)
A killed build resumes from progress.json, after checking the files hold what it says.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from mlsm.artifacts.legacy import tolerated
from mlsm.artifacts.outputs import OutputKind, guard_output, writing
from mlsm.errors import UserError
from mlsm.fileio import atomic_write_json
from mlsm.inputs import field_problem, real_path
from mlsm.progress import Progress
from mlsm.teacher.dictionary import Dictionary, load_dictionary
from mlsm.teacher.sparse_coding import sparse_encode, top_nnz
from mlsm.teacher.teacher import Teacher

TARGETS_FORMAT = "mlsm-targets"
TARGETS_VERSION = 2  # 1: fixed top-nnz rows (lossy); 2: variable-length rows


def dictionary_hash(dictionary: Dictionary) -> str:
    """Content hash of the atoms (float32 bytes), so a renamed copy still matches."""
    data = dictionary.atoms.detach().cpu().float().contiguous().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


_FILES = {"build.json", "progress.json", "meta.json", "counts.bin", "chunk_ptr.bin", "indices.bin",
          "values.bin"}


@dataclass
class TargetStore:
    """A complete target store opened read-only: the code of every body position of every chunk."""

    path: Path
    meta: dict[str, Any]
    counts: np.ndarray  # (n_chunks, max_len - 2) uint16 memmap
    chunk_ptr: np.ndarray  # (n_chunks + 1,) int64 memmap
    indices: np.ndarray  # (n_entries,) memmap
    values: np.ndarray  # (n_entries,) float16 memmap

    @classmethod
    def open(cls, path: str | Path) -> TargetStore:
        path = Path(path)
        if not (path / "meta.json").is_file():
            raise UserError(f"{path} is not a complete target store (no meta.json); build or "
                            "resume it with `mlsm targets --store STORE --dictionary DICT --out "
                            f"{path}`")
        meta = _read_json(path / "meta.json")
        if meta.get("format") != TARGETS_FORMAT:
            raise UserError(f"{path} is not an mlsm target store; build one with `mlsm targets`")
        if meta.get("version") != TARGETS_VERSION:
            raise UserError(f"{path} was built by another version of mlsm (format "
                            f"{meta.get('version')}, need {TARGETS_VERSION}); rebuild it with "
                            "`mlsm targets` into a new --out")
        wrong = field_problem(meta, _META_FIELDS)
        if wrong:
            raise UserError(f"target store {path} is damaged (meta.json: {wrong}); rebuild it "
                            "with `mlsm targets` into a new --out")
        arrays = _arrays(path, meta, mode="r")
        if arrays is None or int(arrays[1][-1]) != int(meta["n_entries"]):
            raise UserError(f"target store {path} is damaged (a data file is missing or has the "
                            "wrong size); rebuild it with `mlsm targets` into a new --out")
        n = int(meta["n_entries"])
        bad = _bad_entries(arrays[2][:n], arrays[3][:n], int(meta["k"]))
        if bad:
            raise UserError(f"target store {path} is damaged ({bad}); rebuild it with "
                            "`mlsm targets` into a new --out")
        return cls(path, meta, *arrays)

    @property
    def k(self) -> int:
        return int(self.meta["k"])

    def dense(self, chunks: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        """Dense float32 codes (N, k) of sequence positions (1 .. max_len − 2) of packed chunks."""
        rows = np.arange(len(chunks))
        counts = self.counts[chunks].astype(np.int64)  # (N, P)
        n = counts[rows, positions - 1]  # (N,) entries of each requested code
        # entries of earlier positions in the chunk
        before = counts.cumsum(1)[rows, positions - 1] - n
        start = self.chunk_ptr[chunks] + before  # (N,) offset of each code's first entry
        # flat offsets of all entries: start_r, start_r + 1, ..., start_r + n_r - 1 for each row r
        first = np.repeat(start - (np.cumsum(n) - n), n)
        flat = first + np.arange(int(n.sum()))
        idx = torch.from_numpy(self.indices[flat].astype(np.int64))
        val = torch.from_numpy(self.values[flat].astype(np.float32))
        dense = torch.zeros(len(chunks), self.k)
        dense[torch.from_numpy(np.repeat(rows, n)), idx] = val  # atom ids are unique within a code
        return dense


# what opening and checking a finished store reads of its meta.json (`_spec`, then the counts)
_META_FIELDS = {"store": "text", "store_fingerprint": "text?", "store_n_tokens": "int",
                "tokenizer_hash": "text", "dictionary_hash": "text", "layer": "int",
                "lam": "number", "k": "int", "max_len": "int", "nnz": "int?", "n_chunks": "int",
                "index_dtype": "text", "n_entries": "int", "n_positions": "int",
                "mean_support": "number", "truncated": "int"}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {path} ({exc}); re-run the `mlsm targets` command that built "
                        "it (same --out) to repair it") from exc
    if not isinstance(payload, dict):
        raise UserError(f"{path} is not a JSON object; re-run the `mlsm targets` command that "
                        "built it (same --out) to repair it")
    return payload


def _read_json_or_none(path: Path) -> dict[str, Any] | None:
    """A build's own bookkeeping file, or None if missing or torn (then that part is redone)."""
    try:
        return _read_json(path) if path.is_file() else None
    except UserError:
        return None


TARGETS_KIND = OutputKind("target store", files=_FILES.__contains__,
                          ours=lambda out: (out / "build.json").exists())


def recorded_inputs(out: str | Path) -> dict[str, Any] | None:
    """What the target store at `out` was built from (its meta.json) or, unfinished, is being
    built from (its build.json: store_fingerprint, dictionary_hash, layer, lam, ...); None when
    it has neither, or they are torn."""
    out = Path(out)
    return _read_json_or_none(out / "meta.json") or _read_json_or_none(out / "build.json")


def check_targets_out(out: str | Path) -> None:
    """Refuse an --out that is a file or a folder that is not (the start of) a target store."""
    guard_output(out, TARGETS_KIND)


def _spec(store: Any, dictionary: Dictionary, teacher: Teacher, max_len: int, nnz: int | None,
          lam: float, n_chunks: int) -> dict[str, Any]:
    from mlsm.data.corpus import tokenizer_hash  # corpus pulls in the tokenizers stack

    return {
        "format": TARGETS_FORMAT, "version": TARGETS_VERSION,
        "store": str(real_path(store.path)),
        "store_fingerprint": store.meta.get("fingerprint"), "store_n_tokens": store.n_tokens,
        "tokenizer_hash": tokenizer_hash(teacher.tokenizer),
        "dictionary_hash": dictionary_hash(dictionary), "dictionary_meta": dictionary.meta,
        # the weights, not the name: codes of a teacher re-trained in place are not these
        "teacher": teacher.name, "teacher_weights": teacher.weights_fingerprint(),
        # the random-teacher control says so (a pre-trained teacher's spec stays as it was)
        **({"teacher_init": "random", "teacher_seed": teacher.seed}
           if teacher.init == "random" else {}),
        "layer": teacher.layer, "lam": lam, "k": dictionary.k,
        "max_len": max_len, "nnz": nnz, "n_chunks": n_chunks,
        "index_dtype": "int16" if dictionary.k <= np.iinfo(np.int16).max else "int32",
    }


_Arrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _bad_entries(indices: np.ndarray, values: np.ndarray, k: int, blocks: int = 64,
                 block: int = 1 << 14) -> str:
    """What is wrong with a sample of a store's code entries (`blocks` evenly spaced runs of
    `block` entries: a few MB read, where an even stride would touch every page of a GB file):
    values that are NaN, inf or negative, or all zero (the codes were dropped as "no target" and
    the run learnt nothing), atom ids outside 0..k-1; "" when the sample is sound. Sizes alone
    do not show a file overwritten in place."""
    starts = np.unique(np.linspace(0, max(0, len(values) - block), blocks).astype(np.int64))
    vals = np.concatenate([values[s : s + block] for s in starts]).astype(np.float32)
    if not np.all(np.isfinite(vals) & (vals >= 0)):  # a tiny code may round to 0 in float16
        return "values.bin holds NaN, inf or negative code values"
    if vals.size and not vals.any():
        return "values.bin holds no positive code value"
    ids = np.concatenate([indices[s : s + block] for s in starts])
    if ids.size and int(ids.max()) >= k:
        return f"indices.bin holds atom ids beyond the dictionary's {k} atoms"
    return ""


def _arrays(out: Path, spec: dict[str, Any], mode: str) -> _Arrays | None:
    """(counts, chunk_ptr, indices, values) memmaps; None if a file is missing or of the wrong size.

    mode "r": open a finished store; "r+": open a build, creating the fixed-size files if needed.
    """
    n, p = spec["n_chunks"], spec["max_len"] - 2
    fixed = (("counts.bin", np.uint16, (n, p)), ("chunk_ptr.bin", np.int64, (n + 1,)))
    arrays: list[np.ndarray] = []
    for name, dtype, shape in fixed:
        path = out / name
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        ok = path.is_file() and path.stat().st_size == nbytes
        if not ok and mode == "r":
            return None
        arrays.append(np.memmap(path, dtype=dtype, mode=mode if ok else "w+", shape=shape))
    for name, dtype in (("indices.bin", spec["index_dtype"]), ("values.bin", np.float16)):
        path = out / name
        if not path.is_file():
            if mode == "r":
                return None
            path.touch()
        size = path.stat().st_size // np.dtype(dtype).itemsize
        # np.memmap cannot map an empty file
        arrays.append(np.memmap(path, dtype=dtype, mode="r", shape=(size,)) if size
                      else np.empty(0, dtype))
    if mode == "r" and any(len(a) < int(arrays[1][-1]) for a in arrays[2:]):
        return None
    return arrays[0], arrays[1], arrays[2], arrays[3]


def _verified_prefix(arrays: _Arrays, done: int) -> int:
    """How many of the first `done` chunks the files really hold (a deleted or truncated file, or
    a kill between writing data and progress, shortens the prefix; the rest is recomputed)."""
    counts, ptr, indices, values = arrays
    per_chunk = counts[:done].astype(np.int64).sum(1)  # (done,)
    n_max = min(len(indices), len(values))
    ok = (ptr[1 : done + 1] == ptr[:done] + per_chunk) & (ptr[1 : done + 1] <= n_max)
    if done == 0 or ptr[0] != 0:
        return 0
    bad = np.flatnonzero(~ok)
    return int(bad[0]) if len(bad) else done


def _start(out: Path, spec: dict[str, Any]) -> int:
    """Create or re-open a build folder; return how many chunks are already written and intact."""
    check_targets_out(out)
    out.mkdir(parents=True, exist_ok=True)
    build, expected = out / "build.json", json.loads(json.dumps(spec))
    old = _read_json_or_none(build)
    if old is not None and "teacher_weights" not in old \
            and tolerated("targets-teacher-unrecorded"):  # a build begun before weights were
        # recorded: its teacher cannot be checked; it continues (as an older run resumes), and
        # the weights are recorded from now on
        print(f"mlsm: note: {out} was begun before target stores recorded their teacher's "
              "weights; continuing without checking them", file=sys.stderr)
        old = {**old, "teacher_weights": expected["teacher_weights"]}
        atomic_write_json(build, old)
    if old is not None and old != expected:
        diff = [k for k in spec if old.get(k) != expected[k]]
        raise UserError(f"{out} holds a target store built with other settings or inputs "
                        f"({', '.join(diff)}); choose another --out")
    if old is None:  # new, or torn: only our files are there, so start over
        for name in ("meta.json", "progress.json"):
            (out / name).unlink(missing_ok=True)
        atomic_write_json(build, spec)
    progress = _read_json_or_none(out / "progress.json") or {}
    claimed = progress.get("done", 0)
    claimed = claimed if isinstance(claimed, int) and 0 <= claimed <= spec["n_chunks"] else 0
    arrays = _arrays(out, spec, mode="r+")
    done = _verified_prefix(arrays, claimed) if arrays else 0
    if done < claimed and spec["nnz"] is not None:
        done = 0  # the truncation count covers all `claimed` chunks: recount it from the start
    if done < claimed:
        print(f"mlsm targets: {out} holds {done} of the {claimed} chunks progress.json records; "
              "recomputing the rest", file=sys.stderr)
    return done


@torch.no_grad()
def _encode_chunks(ids: np.ndarray, teacher: Teacher, atoms: torch.Tensor, gram: torch.Tensor,
                   lam: float) -> torch.Tensor:
    """Codes (B·(T−2), k) of the body positions of chunks (B, T), as the online MLSM computes
    them."""
    x = torch.from_numpy(ids).to(teacher.device)
    h = teacher.hidden_states(x, torch.ones_like(x))[:, 1:-1]  # (B, T-2, d), unmasked input
    h = F.normalize(h.reshape(-1, h.shape[-1]).float(), dim=-1)  # (B·(T-2), d)
    return sparse_encode(h, atoms, lam, gram=gram)


def _append(path: Path, offset: int, data: np.ndarray) -> None:
    """Write `data` at element `offset` of a flat file, cut what follows, and make it durable."""
    with open(path, "r+b") as fh:
        fh.seek(offset * data.itemsize)
        fh.write(data.tobytes())
        fh.truncate()
        fh.flush()
        os.fsync(fh.fileno())


def _write_codes(out: Path, spec: dict[str, Any], start: int, codes: torch.Tensor) -> int:
    """Store the codes (n·P, k) of chunks start .. start + n − 1; returns how many lost entries."""
    cap = spec["nnz"]
    support = (codes > 0).sum(1)  # (n·P,)
    top = top_nnz(codes, cap)  # (n·P, w), largest first, zero padding after the support
    keep = top.values > 0
    counts, ptr, _, _ = _arrays(out, spec, mode="r+")
    n_new = len(codes) // (spec["max_len"] - 2)
    counts[start : start + n_new] = keep.sum(1).reshape(n_new, -1).numpy().astype(np.uint16)
    offset = int(ptr[start])
    _append(out / "indices.bin", offset, top.indices[keep].numpy().astype(spec["index_dtype"]))
    _append(out / "values.bin", offset, top.values[keep].numpy().astype(np.float16))
    new_counts = counts[start : start + n_new].astype(np.int64).sum(1)
    ptr[start + 1 : start + n_new + 1] = offset + np.cumsum(new_counts)
    counts.flush()
    ptr.flush()
    return int((support > keep.sum(1)).sum())


def build_target_store(store_path: str | Path, dictionary: Dictionary | str | Path,
                       teacher: Teacher, max_len: int, out: str | Path, nnz: int | None = None,
                       batch_size: int = 64, lam: float | None = None) -> Path:
    """Compute the codes of every body position of every packed chunk of a token store.

    nnz: None keeps every code whole (default); N keeps each code's N largest entries.
    Resumable (re-run with the same arguments after a kill); returns `out`. batch_size = chunks
    per teacher forward and per progress record.
    """
    from mlsm.config import DataConfig
    from mlsm.data.batches import BatchSource
    from mlsm.data.corpus import TokenStore, check_token_ids, require_same_tokenizer

    store = TokenStore.open(store_path)
    if not isinstance(dictionary, Dictionary):
        dictionary = load_dictionary(dictionary)
    require_same_tokenizer(teacher.tokenizer, store.tokenizer_hash, str(store_path))
    dictionary.check_teacher(teacher)  # after the store's check, which `mlsm dictionary` shares
    teacher.check_length(max_len, "--max-len")
    check_token_ids(store.tokens, teacher.vocab_size, store_path,
                    f"teacher {teacher.name or ''}".strip())
    if nnz is not None and not 1 <= nnz <= dictionary.k:
        raise UserError(f"--nnz must be between 1 and k={dictionary.k} (got {nnz}); omit it to "
                        "keep every code whole")
    source = BatchSource(store, DataConfig(store=str(store.path), max_len=max_len),
                         store.load_tokenizer())
    lam = float(lam or dictionary.lam)
    spec = _spec(store, dictionary, teacher, max_len, nnz, lam, source.n_sequences)
    out = Path(out)
    with writing(out, TARGETS_KIND):
        try:
            return _build(out, spec, source, teacher, dictionary, lam, batch_size)
        except OSError as exc:
            raise UserError(f"could not write target store {out} ({exc.strerror or exc}); free "
                            "space and re-run the same command to resume") from None


def _build(out: Path, spec: dict[str, Any], source: Any, teacher: Teacher, dictionary: Dictionary,
           lam: float, batch_size: int) -> Path:
    """Resume (or start) the build at `out`, under its lock; returns `out`."""
    done = _start(out, spec)  # raises if `out` was built with other settings
    if (out / "meta.json").is_file():
        try:
            TargetStore.open(out)
            return out
        except UserError:  # complete but damaged since: _start found what is intact, redo the rest
            (out / "meta.json").unlink()
    atoms = dictionary.atoms.to(teacher.device).float()  # (d, k)
    gram = atoms.T @ atoms  # (k, k)
    progress = _read_json_or_none(out / "progress.json") or {}
    # _start returns either the recorded prefix or, with a cap, 0 (so the count stays exact)
    truncated = int(progress.get("truncated", 0)) if done and progress.get("done") == done else 0
    max_len = spec["max_len"]
    bar = Progress(spec["n_chunks"], "targets", "chunk", initial=done)
    for start in range(done, spec["n_chunks"], batch_size):
        stop = min(start + batch_size, spec["n_chunks"])
        chunk_ids = source.chunk_tokens(np.arange(start, stop))
        codes = _encode_chunks(chunk_ids, teacher, atoms, gram, lam)
        truncated += _write_codes(out, spec, start, codes.cpu())
        atomic_write_json(out / "progress.json", {"done": stop, "truncated": truncated})
        bar.update(stop - start)
    bar.close()
    counts, ptr, _, _ = _arrays(out, spec, mode="r+")
    n_positions = spec["n_chunks"] * (max_len - 2)
    atomic_write_json(out / "meta.json", {**spec, "truncated": truncated,
                                          "n_positions": n_positions, "n_entries": int(ptr[-1]),
                                          "mean_support": float(ptr[-1]) / n_positions})
    return out


class StoredTargets:
    """MLSM target provider reading a target store: same `codes(batch)` as the online TargetCoder.

    tokens: the run's opened token store; tokenizer, max_len: the run's. dictionary / layer / lam
    / teacher_init (init, seed): the run's MLSM options when given (checked against what the store
    was built with); the teacher is never loaded.
    """

    def __init__(self, path: str, tokens: Any, tokenizer: Any, max_len: int, *,
                 dictionary: str = "", layer: int = -1, lam: float = 0.0,
                 teacher_init: tuple[str, int] | None = None):
        from mlsm.data.corpus import tokenizer_hash

        self.store = TargetStore.open(path)
        meta = self.store.meta
        if ((tokens.meta.get("fingerprint"), tokens.n_tokens)
                != (meta["store_fingerprint"], meta["store_n_tokens"])):
            raise UserError(f"target store {path} was built from another token store "
                            f"({meta['store']}); delete it and rebuild it with `mlsm targets "
                            f"--store {tokens.path} --dictionary DICT --out {path}`")
        if tokenizer_hash(tokenizer) != meta["tokenizer_hash"]:
            raise UserError(f"target store {path} was built with another tokenizer; "
                            "rebuild it for this token store")
        if int(max_len) != int(meta["max_len"]):
            raise UserError(f"target store {path} was built for max_len={meta['max_len']} but "
                            f"data.max_len={max_len}; rebuild it with --max-len {max_len}")
        if dictionary and dictionary_hash(load_dictionary(dictionary)) != meta["dictionary_hash"]:
            raise UserError(f"target store {path} was built with another dictionary than "
                            f"{dictionary}; rebuild it or drop objective.dictionary")
        if layer >= 0 and layer != int(meta["layer"]):
            raise UserError(f"target store {path} holds layer-{meta['layer']} codes but "
                            f"objective.layer={layer}; rebuild it with --layer {layer}")
        if lam and abs(lam - float(meta["lam"])) > 1e-12:
            raise UserError(f"target store {path} was coded with λ={meta['lam']} but "
                            f"objective.lam={lam}; drop objective.lam or rebuild")
        if teacher_init is not None:
            _check_init(path, meta, *teacher_init)
        self.k = self.store.k

    @torch.no_grad()
    def codes(self, batch: Any) -> torch.Tensor:
        """Codes (N, k) of the selected positions, rows in row-major order of batch.selected."""
        rows, cols = batch.selected.cpu().nonzero(as_tuple=True)  # (N,), (N,)
        chunks = batch.chunks.cpu()[rows].numpy()
        dense = self.store.dense(chunks, cols.numpy())  # (N, k) on the host
        if batch.input_ids.device.type == "cuda":  # pinned: the copy does not wait for the GPU
            return dense.pin_memory().to(batch.input_ids.device, non_blocking=True)
        return dense.to(batch.input_ids.device)


def _check_init(path: str, meta: dict[str, Any], init: str, seed: int) -> None:
    """The run's objective.teacher_init / teacher_seed must be the teacher the store was coded
    with (a store of the pre-trained teacher records neither)."""
    built = (meta.get("teacher_init", "pretrained"), meta.get("teacher_seed", 0))
    want = (init, seed if init == "random" else 0)
    if built[0] == "pretrained":
        built = ("pretrained", 0)
    if built != want:
        said = built[0] + (f" (seed {built[1]})" if built[0] == "random" else "")
        raise UserError(f"target store {path} was coded with the {said} teacher but the run says "
                        f"objective.teacher_init={init} teacher_seed={seed}; set them to match "
                        "or rebuild the store with `mlsm targets --teacher-init ...`")
