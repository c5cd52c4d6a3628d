"""Online dictionary learning, the algorithm: atoms D ∈ R^{d×k} from unit vectors X (n, d).

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

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from threadpoolctl import ThreadpoolController

from mlsm.defaults import LAM, lam_range
from mlsm.errors import UserError
from mlsm.progress import Progress
from mlsm.teacher.active_set import WARM_MAX
from mlsm.teacher.slots import padded_gram
from mlsm.teacher.sparse_coding import encode_with_gram, objective, sparse_encode


def _check_options(k: int, lam: float) -> None:
    if k < 1:
        raise UserError(f"the dictionary size k must be >= 1 (got {k}); use e.g. --k 1536 "
                        "(4 × hidden size)")
    lam_ok, lam_text = lam_range()
    if not lam_ok(lam):
        raise UserError(f"lambda must be {lam_text}, got {lam}; use e.g. --lam {LAM}")


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
