"""Dictionary learning for MLSM: D ∈ R^{d×k} whose sparse codes are the student's targets.

    min_{D ∈ C, α_i ≥ 0} Σ_i ½‖x_i − Dα_i‖² + λ‖α_i‖₁,   C = {D : ‖d_j‖₂ ≤ 1}      (Berend 2023)

learned by online dictionary learning (Mairal, Bach, Ponce & Sapiro 2009, "Online dictionary
learning for sparse coding", Alg. 1–2 with the mini-batch extension of §3.4): for each mini-batch
the codes are computed exactly (`sparse_encode`), the sufficient statistics
A = Σ ααᵀ (k, k) and B = Σ xαᵀ (d, k) are accumulated with a forgetting factor, and every column
is updated once by block-coordinate descent u_j = (b_j − D a_j)/A_jj + d_j, d_j = u_j/max(1, ‖u_j‖)
(Alg. 2). Three refinements, each measured on MiniLM states against SPAMS' trainDL:
  * when X is cycled, the statistics of the pass before the last are dropped (Mairal et al.
    2010, JMLR, §3.4 "handling fixed-size data sets", approximated by whole passes as SPAMS
    does): codes made with old dictionaries otherwise drag D back (2 % worse objective);
  * atoms the codes (almost) never use are replaced by the batch's worst-coded vectors (K-SVD's
    rule) rather than random ones: 0.5 % lower objective;
  * each vector's last support warm-starts its next code (same exact codes, ~30 % less time).
The x_i are ℓ2-normalised layer-l teacher states of non-special tokens of a token-store sample.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from threadpoolctl import ThreadpoolController

from mlsm import locking
from mlsm.artifacts.outputs import guard_output_file
from mlsm.defaults import LAM, TEACHER_LAYER, default_k, lam_range
from mlsm.dictionary_config import DictionaryConfig, dictionary_config
from mlsm.errors import UserError
from mlsm.fileio import atomic_write
from mlsm.hf import first_line
from mlsm.inputs import read_json
from mlsm.limits import BYTES_PER_VECTOR_FLOAT
from mlsm.progress import Progress
from mlsm.teacher.active_set import WARM_MAX
from mlsm.teacher.slots import padded_gram
from mlsm.teacher.sparse_coding import encode_with_gram, objective, sparse_encode
from mlsm.teacher.states import collect_vectors
from mlsm.teacher.teacher import LAYER_SETTING, Teacher

DICT_FORMAT = "mlsm-dictionary"


@dataclass
class Dictionary:
    """Atoms (d, k) as columns plus the meta that says how they were made."""

    atoms: torch.Tensor  # (d, k)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def d(self) -> int:
        return int(self.atoms.shape[0])

    @property
    def k(self) -> int:
        return int(self.atoms.shape[1])

    @property
    def lam(self) -> float:
        """The sparsity penalty the atoms were learned with, which the codes must use too."""
        if self.meta.get("lam") is None:  # a dictionary from elsewhere, or meta edited by hand
            raise UserError("the dictionary's meta does not say the lambda it was learned with; "
                            'add "lam": VALUE to its .json meta, or set objective.lam in the run '
                            f"config (mlsm learns with {LAM} by default)")
        return float(self.meta["lam"])

    @property
    def layer(self) -> int:
        """The teacher layer the dictionary was learned on (`defaults.TEACHER_LAYER` if unsaid)."""
        return int(self.meta.get("layer", TEACHER_LAYER))

    def check_teacher(self, teacher: Teacher) -> None:
        """The dictionary must live in the teacher's hidden space (same d, same layer)."""
        if self.d != teacher.hidden_size:
            raise UserError(f"the dictionary has d={self.d} but the teacher's hidden size is "
                            f"{teacher.hidden_size}; learn a dictionary with this teacher (`mlsm "
                            "dictionary --teacher ...`)")
        layer = self.meta.get("layer")
        if layer is not None and int(layer) != teacher.layer:
            raise UserError(f"the dictionary was learned on layer {layer} but the teacher stops at "
                            f"layer {teacher.layer}; use layer {layer} ({LAYER_SETTING}) or learn "
                            "a new dictionary")


def _check_options(k: int, lam: float) -> None:
    if k < 1:
        raise UserError(f"the dictionary size k must be >= 1 (got {k}); use e.g. --k 1536 "
                        "(4 × hidden size)")
    lam_ok, lam_text = lam_range()
    if not lam_ok(lam):
        raise UserError(f"lambda must be {lam_text}, got {lam}; use e.g. --lam {LAM}")


def _check_sizes(c: DictionaryConfig) -> None:
    """Refuse more atoms than vectors (it would learn nonsense) before the slow collection of
    teacher states starts; each setting's own range is checked beside its field."""
    if c.k is not None and c.n_vectors < c.k:
        raise UserError(f"--n-vectors {c.n_vectors} is fewer than the {c.k} atoms to learn (--k); "
                        "collect at least k vectors (a dictionary is usually learned on >= 100 x "
                        "k), or lower --k")


def check_vector_memory(n_vectors: int, d: int) -> None:
    """Refuse, before collecting, more teacher states than this machine's memory holds: the
    n x d float32 matrix is held whole (and copied once while it is gathered), so
    `--n-vectors 2000000000` collected for minutes before failing."""
    need = 2 * n_vectors * d * BYTES_PER_VECTOR_FLOAT
    try:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not on this system: nothing to compare
        return
    if need > have:
        most = max(1, have // (2 * d * BYTES_PER_VECTOR_FLOAT))
        raise UserError(f"--n-vectors {n_vectors:,} needs about {need / 2**30:,.1f} GiB for the "
                        f"teacher states ({d} floats each, gathered then joined), more than this "
                        f"machine's {have / 2**30:,.1f} GiB; use --n-vectors {most:,} or fewer")


# --------------------------------------------------------------------------- data


# --------------------------------------------------------------------------- learning


def learn_atoms(X: torch.Tensor, k: int, lam: float = LAM, *, n_iter: int | None = None,
                batch_size: int = 512, forget: float = 1.0, seed: int = 0,
                init: torch.Tensor | None = None, progress: bool = True) -> torch.Tensor:
    """Online dictionary learning on rows of X (n, d); returns D (d, k) on X's device/dtype.

    n_iter mini-batches (default: one pass over X; more cycle through X in a new random order
    each pass). forget = ρ of the forgetting factor β_t = (1 − 1/t)^ρ (Mairal et al. 2009 §3.4);
    ρ > 1 forgets codes of early dictionaries faster. init: optional starting dictionary (d, k);
    default k random data vectors.
    """
    _check_options(k, lam)
    if X.dim() != 2 or X.shape[0] == 0:
        raise UserError("dictionary learning needs a non-empty (n, d) matrix of vectors")
    if not bool(torch.isfinite(X).all()):
        raise UserError("training vectors contain NaN or inf; check the teacher outputs")
    n, d = X.shape
    gen = torch.Generator().manual_seed(seed)
    # (k, d) atoms as rows
    Dt = (_init_atoms(X, k, gen) if init is None else init.to(X)).T.contiguous()
    stats = _Stats.zeros(k, d, X)
    # (k+1, K) Gram matrix of the atoms, kept up to date by `_update_atoms`
    Gp = padded_gram(D=Dt.T)
    n_iter = n_iter if n_iter is not None else max(1, math.ceil(n / batch_size))
    order, pos = torch.randperm(n, generator=gen), 0
    # Supports of every vector's last code: when X is cycled they warm-start its next code.
    support = _Supports(n, k, X.device) if n_iter * batch_size > n else None
    bar = Progress(n_iter, "dictionary", "batch", enabled=None if progress else False)
    for t in range(1, n_iter + 1):
        if pos + batch_size > n:  # a new pass over X
            order, pos = torch.randperm(n, generator=gen), 0
            stats.new_pass()
        rows = order[pos : pos + batch_size].to(X.device)
        pos += batch_size
        Xb = X[rows]  # (b, d)
        warm = None if support is None else support.get(rows)
        codes = encode_with_gram(Xb, Dt.T, Gp, lam, warm=warm)
        if support is not None:
            support.put(rows, codes)
        stats.add(Xb, codes, beta=(1.0 - 1.0 / t) ** forget)
        _update_atoms(Dt, Gp, stats, Xb, codes, lam, X, gen)
        bar.update(1)
    bar.close()
    return Dt.T.contiguous()


class _Supports:
    """The atoms of each vector's latest code, largest first: WARM_MAX int16s (int32 for k ≥ 2¹⁵) a
    vector."""

    def __init__(self, n: int, k: int, device: torch.device) -> None:
        self.k = k
        dtype = torch.int16 if k < 2**15 else torch.int32
        self.atoms = torch.full((n, WARM_MAX), -1, dtype=dtype, device=device)

    def get(self, rows: torch.Tensor) -> torch.Tensor | None:
        atoms = self.atoms[rows]
        width = int((atoms >= 0).sum(1).max())
        return atoms[:, :width] if width else None

    def put(self, rows: torch.Tensor, codes: torch.Tensor) -> None:
        vals, atoms = codes.topk(min(WARM_MAX, self.k), dim=1)
        self.atoms[rows, : atoms.shape[1]] = torch.where(vals > 0, atoms, -1).to(self.atoms.dtype)


@dataclass
class _Stats:
    """The surrogate's statistics A = Σ_s w_s mean_i(α_i α_iᵀ) (k, k) and
    Bᵀ = Σ_s w_s mean_i(α_i x_iᵀ) (k, d) over mini-batches s, with weights w_s = Π_{u>s} β_u.

    Stored divided by `scale` = Π β, so forgetting costs one scalar per step, not a pass over k².
    When the data is cycled, the terms of a sample's older codes are stale: at the start of
    each pass the terms of the pass before the last are dropped (Mairal et al. 2010, JMLR, §3.4
    "handling fixed-size data sets", by whole passes as SPAMS does); `A_old`, `Bt_old` hold the
    last pass's terms.
    """

    A: torch.Tensor  # (k, k)
    Bt: torch.Tensor  # (k, d)
    A_old: torch.Tensor  # (k, k)
    Bt_old: torch.Tensor  # (k, d)
    scale: float = 1.0

    @staticmethod
    def zeros(k: int, d: int, like: torch.Tensor) -> _Stats:
        return _Stats(*(like.new_zeros(shape) for shape in ((k, k), (k, d), (k, k), (k, d))))

    def add(self, Xb: torch.Tensor, codes: torch.Tensor, beta: float) -> None:
        """Decay by β, then add the batch means of ααᵀ and αxᵀ for codes (b, k)."""
        self.scale *= beta
        if self.scale < 1e-12:  # fold the scale in before 1/scale overflows (β = 0 at t = 1)
            for m in (self.A, self.Bt, self.A_old, self.Bt_old):
                m.mul_(self.scale)
            self.scale = 1.0
        w = 1.0 / (Xb.shape[0] * self.scale)
        S = codes.T.to_sparse()  # (k, b), ~30 non-zeros per column: sparse products are ~5× faster
        torch.addmm(self.A, S, codes, alpha=w, out=self.A)
        torch.addmm(self.Bt, S, Xb, alpha=w, out=self.Bt)

    def new_pass(self) -> None:
        """Drop the terms of the pass before the last; the last pass becomes the old one."""
        for total, old in ((self.A, self.A_old), (self.Bt, self.Bt_old)):
            total.sub_(old)
            old.copy_(total)

    def usage(self) -> torch.Tensor:
        """(k,) A_jj = weighted mean of α_j² over the codes."""
        return self.A.diagonal() * self.scale


def _init_atoms(X: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """k distinct random data vectors as unit columns (repeats only when n < k)."""
    n = X.shape[0]
    idx = (torch.randperm(n, generator=gen)[:k] if n >= k
           else torch.randint(0, n, (k,), generator=gen))
    D = X[idx.to(X.device)].T.clone()  # (d, k)
    if n < k:
        D += 0.01 * torch.randn(D.shape, generator=gen).to(D)
    return D / D.norm(dim=0, keepdim=True).clamp(min=1e-12)


MIN_USAGE = 1e-6  # atoms with A_jj below this are replaced (SPAMS' threshold, same scale of A)


@functools.cache
def _threadpools() -> ThreadpoolController:
    """Made once: `threadpool_limits` would scan the loaded libraries on every call (~0.5 ms)."""
    return ThreadpoolController()


def _update_atoms(Dt: torch.Tensor, Gp: torch.Tensor, stats: _Stats, Xb: torch.Tensor,
                  codes: torch.Tensor, lam: float, X: torch.Tensor, gen: torch.Generator,
                  block: int = 64) -> None:
    """One block-coordinate pass over the atoms (rows of Dt (k, d)), in place
    (Mairal et al. 2009, Alg. 2).

    Atom j: u = (b_j − D a_j)/A_jj + d_j, d_j = u / max(1, ‖u‖), in order. Atoms the codes
    (almost) never use are wasted: they are replaced by the worst-coded vectors of the batch
    Xb (largest ½‖x − Dα‖² + λ‖α‖₁ under its codes), where a new atom lowers the objective most
    (K-SVD's rule, Aharon, Elad & Bruckstein 2006; −0.5 % objective against random data vectors on
    MiniLM states). Gp (`slots.padded_gram`) is brought up to date with the new atoms.
    """
    used = stats.usage() > MIN_USAGE
    dead = (~used).nonzero().squeeze(1)
    # before D moves
    fresh = _worst_coded(Xb, codes, Dt, lam, dead.numel()) if dead.numel() else None
    # NumPy's BLAS gets one thread: OpenBLAS workers spin after each call and would slow the
    # torch threads of the next sparse coding ~2× (measured: 180 → 80 ms per mini-batch).
    with _threadpools().limit(limits=1, user_api="blas"):
        _column_pass(Dt, Gp, stats.A, stats.Bt, used, block)
    if fresh is not None:
        if fresh.shape[0] < dead.numel():  # a batch smaller than the unused atoms: random data too
            fresh = torch.cat([fresh, _init_atoms(X, dead.numel() - fresh.shape[0], gen).T])
        k = Dt.shape[0]
        Dt[dead] = fresh
        Gp[dead, :k] = Dt[dead] @ Dt.T
        Gp[:k, dead] = Gp[dead, :k].T


def _worst_coded(Xb: torch.Tensor, codes: torch.Tensor, Dt: torch.Tensor, lam: float,
                 n: int) -> torch.Tensor:
    """Up to n rows of Xb (b, d) with the largest objective under codes (b, k), as unit vectors."""
    worst = Xb[objective(Xb, Dt.T, codes, lam).topk(min(n, Xb.shape[0])).indices]
    return worst / worst.norm(dim=1, keepdim=True).clamp(min=1e-12)


def _column_pass(Dt: torch.Tensor, Gp: torch.Tensor, A: torch.Tensor, Bt: torch.Tensor,
                 used: torch.Tensor, block: int) -> None:
    """The sequential atom updates of `_update_atoms` (unused atoms stay), and the new Gram matrix.

    D a_j would cost a (d × k) read per atom; instead D A[:, J] is computed once per block J of
    atoms (one GEMM, the bulk of the flops), and inside the block an update only has to account
    for the moves δ of the block's earlier atoms: u_j = r_j − Σ_{i<j in J} (A_ij/A_jj) δ_i with
    r_j = (b_j − D a_j)/A_jj + d_j at the block's start. Same pass as Alg. 2 in exact arithmetic.
    Once a block is final, its rows of the Gram matrix against all final atoms are computed
    and mirrored: half the flops of a fresh DᵀD.
    """
    k = Dt.shape[0]
    # (k, 1); 0: atom stays
    inv = torch.where(used, 1.0 / A.diagonal().clamp(min=1e-30), 0.0)[:, None]
    for lo in range(0, k, block):
        hi = min(lo + block, k)
        old = Dt[lo:hi].clone()  # (b, d)
        R = (Bt[lo:hi] - A[lo:hi] @ Dt) * inv[lo:hi] + old  # (b, d)
        Dt[lo:hi] += _block_moves(R, A[lo:hi, lo:hi] * inv[lo:hi], old)
        Gp[lo:hi, :hi] = Dt[lo:hi] @ Dt[:hi].T  # (b, hi)
        Gp[:lo, lo:hi] = Gp[lo:hi, :lo].T


def _block_moves(R: torch.Tensor, L: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Moves δ (b, d) of one block's atoms, one after the other: u_j = R_j − L_j,<j δ_<j, projected
    on the unit ball. On CPU this runs on NumPy views, whose per-call overhead is a few times
    lower than torch's for these tiny vectors."""
    if R.device.type == "cpu":
        return torch.from_numpy(_block_moves_loop(np, R.numpy(), L.numpy(), old.numpy()))
    return _block_moves_loop(torch, R, L, old)


def _block_moves_loop(xp: Any, R: Any, L: Any, old: Any) -> Any:
    """`_block_moves` on NumPy arrays or torch tensors (xp = numpy or torch)."""
    delta = xp.zeros_like(R)
    for i in range(R.shape[0]):
        u = R[i] - L[i, :i] @ delta[:i]
        n2 = u @ u
        # max(1, ‖u‖) without a branch: no host sync on CUDA
        u /= ((n2 + 1 + abs(n2 - 1)) / 2) ** 0.5
        delta[i] = u - old[i]
    return delta


def dictionary_objective(X: torch.Tensor, D: torch.Tensor, lam: float,
                         batch_size: int = 4096) -> float:
    """Mean of ½‖x − Dα*‖² + λ‖α*‖₁ over rows of X with exact codes α*."""
    G = D.T @ D
    total = 0.0
    for Xb in X.split(batch_size):
        total += float(objective(Xb, D, sparse_encode(Xb, D, lam, gram=G), lam).sum())
    return total / max(1, X.shape[0])


def learn_dictionary(store: Any, teacher: Teacher, config: DictionaryConfig | None = None, *,
                     out: str | Path | None = None, **settings: Any) -> Dictionary:
    """Collect `n_vectors` teacher states from a token store and learn a dictionary on them.

    The settings are `config`'s (a `DictionaryConfig`, default: its defaults) with the keyword
    `settings` on top (k, lam, n_vectors, max_len, batch_size, n_iter, forget, eval_vectors,
    seed, sampling: each documented beside its field there). k defaults to 4 × the teacher's
    hidden size; the final objective is the mean over up to eval_vectors of the collected
    vectors. When `out` is given the result is saved there.
    """
    c = dictionary_config(config, settings)
    if isinstance(store, str | Path):  # a path is opened (and checked) here
        from mlsm.data.corpus import TokenStore

        store = TokenStore.open(store)
    if not isinstance(teacher, Teacher):
        raise UserError(f"learn_dictionary() takes a Teacher, got a {type(teacher).__name__}; "
                        "load one with mlsm.load_teacher(PATH, layer)")
    c = dataclasses.replace(c, k=default_k(teacher.hidden_size) if c.k is None else c.k)
    _check_sizes(c)
    check_vector_memory(c.n_vectors, teacher.hidden_size)
    if out is None:
        return _learn(store, teacher, c, None)
    check_dictionary_out(out)
    # one writer: two at once left the atoms of one beside the meta of the other
    with locking.hold(_paths(out)[0], "dictionary"):
        return _learn(store, teacher, c, out)


def _learn(store: Any, teacher: Teacher, c: DictionaryConfig,
           out: str | Path | None) -> Dictionary:
    X = collect_vectors(teacher, store, c.n_vectors, max_len=c.max_len, seed=c.seed,
                        sampling=c.sampling).to(teacher.device)
    start = time.perf_counter()
    D = learn_atoms(X, c.k, c.lam, n_iter=c.n_iter, batch_size=c.batch_size, forget=c.forget,
                    seed=c.seed)
    seconds = time.perf_counter() - start
    eval_gen = torch.Generator().manual_seed(c.seed + 1)
    sample = X[torch.randperm(X.shape[0], generator=eval_gen)[:c.eval_vectors]]
    meta = _meta(teacher, store, k=c.k, lam=c.lam, n=X.shape[0], max_len=c.max_len,
                 batch_size=c.batch_size, n_iter=c.n_iter or math.ceil(X.shape[0] / c.batch_size),
                 seed=c.seed, seconds=seconds, objective=dictionary_objective(sample, D, c.lam),
                 n_eval=sample.shape[0], sampling=c.sampling)
    result = Dictionary(D.cpu(), meta)
    if out is not None:
        save_dictionary(result, out)
    return result


def _meta(teacher: Teacher, store: Any, **values: Any) -> dict[str, Any]:
    from mlsm.data.corpus import tokenizer_hash  # corpus pulls in the tokenizers stack

    return {
        "format": DICT_FORMAT, "version": 1,
        "teacher": teacher.name, "teacher_tokenizer_hash": tokenizer_hash(teacher.tokenizer),
        "layer": teacher.layer, "d": teacher.hidden_size,
        "store": str(getattr(store, "path", "")), **values,
    }


# --------------------------------------------------------------------------- files


def _paths(path: str | Path) -> tuple[Path, Path]:
    path = Path(path)
    if path.suffix != ".safetensors":
        path = path.with_name(path.name + ".safetensors")
    return path, path.with_suffix(".json")


def check_dictionary_out(path: str | Path) -> None:
    """Refuse an --out whose PATH.safetensors / PATH.json exist but are not an mlsm dictionary
    (checked before minutes of learning; a dictionary of ours may be replaced)."""
    given = Path(path)
    if given.exists() and not given.is_file() and not given.is_dir():
        # /dev/null, a FIFO: the .safetensors/.json suffixes would add two files beside it
        guard_output_file(given, "mlsm dictionary", lambda _: False, example="dict.safetensors")
    weights, meta_path = _paths(path)
    guard_output_file(weights, "mlsm dictionary", _ours_weights, example="dict.safetensors")
    guard_output_file(meta_path, "mlsm dictionary's meta", _ours_meta, example="dict.safetensors")


def _ours_weights(weights: Path) -> bool:
    try:
        with safe_open(str(weights), "pt") as fh:
            return set(fh.keys()) == {"atoms"} and "meta" in (fh.metadata() or {})
    except Exception:  # safetensors raises its own error types for a non-safetensors file
        return False


def _ours_meta(meta_path: Path) -> bool:
    try:
        return json.loads(meta_path.read_text(encoding="utf-8")).get("format") == DICT_FORMAT
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError, RecursionError):
        return False


def save_dictionary(dictionary: Dictionary, path: str | Path) -> Path:
    """Write atoms to PATH.safetensors and meta to PATH.json, each atomically; returns the
    former."""
    check_dictionary_out(path)  # before the lock: a device path cannot hold a lock file beside it
    weights, meta_path = _paths(path)
    atoms = dictionary.atoms.detach().cpu().float().contiguous()
    # the atoms' digest in both metas: a .json beside the weights of another write (a kill
    # between the two renames) never agrees with them, even when every setting is the same
    meta = {"format": DICT_FORMAT, **dictionary.meta, "d": dictionary.d, "k": dictionary.k,
            "atoms_sha256": hashlib.sha256(atoms.numpy().tobytes()).hexdigest()}
    text = json.dumps(meta, indent=2, sort_keys=True)
    try:
        with locking.hold(weights, "dictionary"):  # one writer for the pair (re-entrant)
            check_dictionary_out(path)
            atomic_write(weights, lambda p: save_file({"atoms": atoms}, p, metadata={"meta": text}))
            atomic_write(meta_path, lambda p: Path(p).write_text(text + "\n"))
    except (OSError, SafetensorError) as exc:
        reason = (getattr(exc, "strerror", None) or str(exc)).splitlines()[0]
        raise UserError(f"could not write dictionary {weights} ({reason}); free "
                        "space and re-run") from None
    return weights


def load_dictionary(path: str | Path, device: str | torch.device = "cpu") -> Dictionary:
    """Read a dictionary written by `save_dictionary` (PATH or PATH.safetensors)."""
    weights, meta_path = _paths(path)
    if not weights.is_file():
        raise UserError(f"no dictionary at {weights}; learn one with `mlsm dictionary --store "
                        f"STORE --out {weights}`")
    # the command must work as written: --store is required, and a damaged file is not ours
    fix = (f"delete it and learn it again with `mlsm dictionary --store STORE --out {weights}` "
           "(the token store prepared with the teacher's tokenizer)")
    try:
        tensors = load_file(str(weights), device=str(device))
    except (SafetensorError, OSError, ValueError) as exc:  # binary, truncated, torn header
        raise UserError(f"dictionary {weights} is damaged or not a safetensors file "
                        f"({first_line(exc)}); {fix}") from None
    atoms = tensors.get("atoms")
    if atoms is None or atoms.dim() != 2 or not atoms.is_floating_point():
        raise UserError(f"{weights} is not an mlsm dictionary (no 2-D float tensor `atoms`; it "
                        f"holds {', '.join(sorted(tensors)) or 'nothing'}); {fix}")
    embedded = _embedded_meta(weights)
    meta = (read_json(meta_path, "dictionary meta", fix, fields=META_FIELDS)
            if meta_path.exists() else embedded)
    if meta.get("k") is not None and meta["k"] != atoms.shape[1]:
        raise UserError(f"dictionary {weights} holds {atoms.shape[1]} atoms but its meta "
                        f"{meta_path.name} says k = {meta['k']}: the two files are of different "
                        f"dictionaries; {fix}")
    # the weights carry the meta they were written with: a value of the .json that differs
    # from it, or an atoms digest the .json lacks (a .json of an older write), is another write;
    # a key removed by hand is not (its reader says what is missing)
    keys = (set(meta) & set(embedded)) | ({"atoms_sha256"} & set(embedded))
    differ = sorted(key for key in keys if meta.get(key) != embedded.get(key))
    if differ:  # a write killed between the two files, or two writers: not one dictionary
        raise UserError(f"dictionary {weights} and its meta {meta_path.name} are of different "
                        f"dictionaries ({', '.join(differ[:3])} differ from the meta the weights "
                        f"carry; a write was interrupted, or another one wrote one of them); "
                        f"{fix}")
    if not bool(atoms.any()):  # every sparse code against it would be zero
        raise UserError(f"dictionary {weights} has only zero atoms; {fix}")
    return Dictionary(atoms, meta)


def _embedded_meta(weights: Path) -> dict[str, Any]:
    """The meta `save_dictionary` puts in the safetensors header ({} for an older or foreign file
    whose header holds none, or none that parses as a JSON object)."""
    try:
        with safe_open(str(weights), "pt") as fh:
            text = (fh.metadata() or {}).get("meta")
        meta = json.loads(text) if text else {}
    except (SafetensorError, OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


# what readers use of a dictionary's meta (Dictionary.lam / .layer, the export card, `mlsm flops`)
META_FIELDS = {"lam": "number?", "layer": "int?", "k": "int?", "objective": "number?",
               "teacher": "text?"}
