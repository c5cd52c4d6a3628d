"""Batched non-negative LASSO: the sparse codes that are MLSM's targets.

For every row x of X (ℓ2-normalised teacher states) and a dictionary D ∈ R^{d×k} we solve

    α* = argmin_{α ≥ 0} ½‖x − Dα‖² + λ‖α‖₁                 (MLSM's codes, Berend 2023)

*exactly up to a tolerance on the KKT conditions*, not for a fixed number of iterations.
With g = Dᵀ(x − Dα) − λ the optimality conditions of this problem are
    g_j = 0 where α_j > 0,   g_j ≤ 0 where α_j = 0                       (KKT)
and `kkt_violation` measures how far a code is from them.

How: the codes are very sparse (~30 of 1536 atoms on MiniLM states), so after computing
c = Dᵀx once, everything happens on small per-row active sets and the Gram matrix G = DᵀD:
  1. a batched primal active-set method (`mlsm.teacher.active_set`: Lawson–Hanson with several
     atoms entering per step, G_AA⁻¹ kept by rank-one updates) solves every row;
  2. the KKT conditions are checked against the *whole* dictionary (one `embedding_bag` over the
     Gram rows of each support);
  3. the rare rows that fail (a numerically degenerate active set) are solved again by the
     batched LARS-lasso homotopy (`mlsm.teacher.homotopy`), an independent exact method; the
     better of the two is kept. Rows that still miss the tolerance (only with duplicate or
     near-parallel atoms) are counted in a warning.

`fista` is the official implementation's solver (FISTA, Beck & Teboulle 2009, a fixed number
of iterations) kept as a reference and a benchmark anchor.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mlsm.defaults import LAM
from mlsm.errors import UserError
from mlsm.teacher.active_set import active_set
from mlsm.teacher.homotopy import homotopy
from mlsm.teacher.slots import padded_gram

TOL = 1e-5  # default KKT tolerance of the codes


@dataclass
class SparseCodes:
    """Compact top-nnz form of codes: row i has values[i, j] at atom indices[i, j].

    Padding entries have value 0 (and index 0); rows are sorted by decreasing value.
    """

    indices: torch.Tensor  # (n, nnz) int64
    values: torch.Tensor  # (n, nnz)


def check_problem(X: torch.Tensor, D: torch.Tensor, lam: float) -> None:
    """Raise UserError for inputs the solvers cannot handle."""
    for name, t in (("X", X), ("D", D)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise UserError(f"sparse coding needs {name} as a floating-point torch tensor, got "
                            f"{got}; convert it with torch.as_tensor({name}, dtype=torch.float32)")
    if X.dim() != 2 or D.dim() != 2:
        raise UserError(f"sparse coding needs X of shape (n, d) and D of shape (d, k); "
                        f"got {tuple(X.shape)} and {tuple(D.shape)}")
    if X.shape[1] != D.shape[0]:
        raise UserError(f"vectors have dimension {X.shape[1]} but the dictionary has {D.shape[0]} "
                        "rows; use a dictionary learned on this teacher layer")
    if D.shape[1] < 1:
        raise UserError("the dictionary has no atoms; learn one with k >= 1")
    if not lam > 0:
        raise UserError(f"lambda must be > 0 (got {lam}); Berend 2023 uses {LAM}")
    if not bool(torch.isfinite(X).all()):
        raise UserError("input vectors contain NaN or inf; check the teacher outputs / input data")
    if not bool(torch.isfinite(D).all()):
        raise UserError("the dictionary contains NaN or inf; re-learn or re-load it")


def objective(X: torch.Tensor, D: torch.Tensor, codes: torch.Tensor, lam: float) -> torch.Tensor:
    """Per-row LASSO objective ½‖x − Dα‖² + λ‖α‖₁, shape (n,)."""
    r = X - codes @ D.T  # (n, d)
    return 0.5 * (r * r).sum(1) + lam * codes.abs().sum(1)


def kkt_violation(X: torch.Tensor, D: torch.Tensor, codes: torch.Tensor,
                  lam: float) -> torch.Tensor:
    """Per-row max violation of the non-negative LASSO optimality conditions, shape (n,).

    g = Dᵀ(x − Dα) − λ must be 0 on the support and ≤ 0 off it; α must be ≥ 0.
    """
    return _violation_from_grad((X - codes @ D.T) @ D - lam, codes)  # g: (n, k)


def fista(X: torch.Tensor, D: torch.Tensor, lam: float, n_iter: int = 100) -> torch.Tensor:
    """Reference solver: FISTA with a fixed iteration count, as in the official MLSM code.

    Beck & Teboulle (2009), Alg. 2 with the prox of λ‖·‖₁ + indicator(α ≥ 0), i.e.
    max(0, v − λ/L). The gradient uses the residual form Dᵀ(Dy − x) (two (n,d,k) matmuls).
    """
    check_problem(X, D, lam)
    # Lipschitz constant of the gradient = largest eigenvalue of DᵀD = σ_max(D)².
    L = torch.linalg.matrix_norm(D.double(), ord=2).item() ** 2
    c = X @ D  # (n, k), Dᵀx for every row
    alpha = X.new_zeros(X.shape[0], D.shape[1])  # (n, k)
    y, t = alpha, 1.0
    for _ in range(n_iter):
        grad = (y @ D.T) @ D - c  # (n, k)
        new = (y - (grad + lam) / L).clamp(min=0)
        t_new = (1 + (1 + 4 * t * t) ** 0.5) / 2
        y = new + ((t - 1) / t_new) * (new - alpha)
        alpha, t = new, t_new
    return alpha


def top_nnz(codes: torch.Tensor, nnz: int | None = None) -> SparseCodes:
    """Compact form keeping the `nnz` largest entries per row (default: max row support)."""
    if nnz is None:
        nnz = max(int((codes > 0).sum(1).max().item()) if codes.numel() else 0, 1)
    nnz = min(nnz, codes.shape[1])
    values, indices = codes.topk(nnz, dim=1)  # (n, nnz), sorted descending
    indices = torch.where(values > 0, indices, torch.zeros_like(indices))
    return SparseCodes(indices=indices, values=values.clamp(min=0))


def sparse_encode(
    X: torch.Tensor,
    D: torch.Tensor,
    lam: float,
    *,
    gram: torch.Tensor | None = None,
    tol: float = TOL,
    batch_size: int = 4096,
    warm_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact (to `tol` on the KKT conditions) non-negative LASSO codes, shape (n, k).

    X: (n, d) rows to encode; D: (d, k) dictionary (columns = atoms); lam: λ > 0.
    gram: optional precomputed DᵀD (k, k) to reuse across calls. Runs on X's device/dtype.
    warm_start: optional (n, s) integer tensor of guessed supports (atom indices; values
    outside [0, k) mean none), e.g. the supports of the rows' codes under a slightly older
    dictionary. It only saves solver steps: the codes are the same exact solutions.
    """
    check_problem(X, D, lam)
    if warm_start is not None and (warm_start.dim() != 2 or warm_start.shape[0] != X.shape[0]
                                   or warm_start.dtype.is_floating_point):
        raise UserError(f"warm_start must be an integer tensor of shape (n, s) with "
                        f"n = {X.shape[0]} rows; got {warm_start.dtype} {tuple(warm_start.shape)}")
    D = D.to(X.dtype)
    Gp = padded_gram(D=D) if gram is None else padded_gram(gram.to(X.dtype))  # (k+1, K) Gram matrix
    out = [encode_with_gram(X[start : start + batch_size], D, Gp, lam, tol,
                         None if warm_start is None else warm_start[start : start + batch_size])
           for start in range(0, X.shape[0], batch_size)]
    return torch.cat(out) if out else X.new_zeros(0, D.shape[1])


def encode_with_gram(X: torch.Tensor, D: torch.Tensor, Gp: torch.Tensor, lam: float,
                     tol: float = TOL, warm: torch.Tensor | None = None) -> torch.Tensor:
    """`sparse_encode` of one batch given Gp = `slots.padded_gram(DᵀD)`, without input checks;
    for callers that keep Gp up to date themselves (dictionary learning).

    Active set for every row → KKT check on the whole dictionary → homotopy for failures."""
    n, (d, k) = X.shape[0], D.shape
    c = X @ D  # (n, k) = Dᵀx, computed once
    codes, viol = _checked(active_set(c, Gp, lam, tol, max_steps=2 * min(d, k) + 16, warm=warm),
                           c, Gp, lam)
    bad = (viol > tol).nonzero().squeeze(1)
    if bad.numel():
        again, viol2 = _checked(homotopy(c[bad], Gp, lam, max_steps=8 * min(d, k) + 16),
                                c[bad], Gp, lam)
        better = viol2 < viol[bad]
        codes[bad[better]], viol[bad[better]] = again[better], viol2[better]
        left = int((viol > tol).sum())
        if left:
            warnings.warn(f"{left} of {n} codes miss the KKT tolerance {tol:g} (max violation "
                          f"{float(viol.max()):.1e}); the dictionary is probably degenerate "
                          "(duplicate or near-parallel atoms): re-learn it or deduplicate its "
                          "atoms", stacklevel=3)
    return codes


def _checked(sol: tuple[torch.Tensor, torch.Tensor, torch.Tensor], c: torch.Tensor,
             Gp: torch.Tensor, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense codes (n, k) from a solver's (idx, alpha ≥ 0, fail) and their KKT violation (n,).

    g = c − Gα − λ on every atom comes from the support alone (|A| rows of G per code); the
    violation is max(|g| on the support, g off it), as in `kkt_violation`."""
    idx, alpha, fail = sol
    n, k = c.shape
    alpha = alpha.to(c.dtype)
    codes = c.new_zeros(n, k + 1).scatter_(1, idx, alpha)[:, :k]
    g = F.embedding_bag(idx, Gp, per_sample_weights=alpha, mode="sum")  # (n, K) = Gα
    g[:, :k].sub_(c).add_(lam).neg_()  # c − Gα − λ on the atoms
    support = torch.where(alpha > 0, idx, k)  # (n, S); column k (empty slot) is not read below
    on = g.gather(1, support).abs().amax(1)
    off = g.scatter_(1, support, float("-inf"))[:, :k].amax(1)
    viol = torch.maximum(on, off)
    return codes, viol.masked_fill(fail, float("inf"))


def _violation_from_grad(g: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Max KKT violation per row given g = Dᵀ(x − Dα) − λ (see `kkt_violation`)."""
    return torch.maximum(torch.where(codes > 0, g.abs(), g.clamp(min=0)).amax(1),
                         (-codes).clamp(min=0).amax(1))
