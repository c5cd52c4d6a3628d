"""Batched non-negative LASSO: the sparse codes that are MLSM's targets.

For every row x of X (ℓ2-normalised teacher states) and a dictionary D ∈ R^{d×k} we solve

    α* = argmin_{α ≥ 0} ½‖x − Dα‖² + λ‖α‖₁                      (Berend 2023, eq. 1)

*exactly up to a tolerance on the KKT conditions*, not for a fixed number of iterations.
With g = Dᵀ(x − Dα) − λ the optimality conditions of this problem are
    g_j = 0 where α_j > 0,   g_j ≤ 0 where α_j = 0                       (KKT)
and `kkt_violation` measures how far a code is from them.

Why an active-set method: the codes are very sparse (~25 of 1536 atoms on MiniLM states), so
after computing c = Dᵀx once, everything happens on small per-row index sets and on the Gram
matrix G = DᵀD. The solver is a batched Lawson–Hanson style primal active-set method
(Lawson & Hanson 1974, ch. 23) on the quadratic ½αᵀGα − (c − λ)ᵀα, α ≥ 0:
  1. screening: a working set W of the m atoms with the largest c per row; the sub-problem
     uses the (m × m) block of G only;
  2. on W: a free set I grows by the most violating atoms (several per step, one after a
     stall) and shrinks by feasibility steps (the Lawson–Hanson interpolation, or dropping all
     negative atoms at once when that lowers the objective more); each step solves
     G_II z = (c − λ)_I with one batched Cholesky over padded, compacted free sets;
  3. the KKT conditions are then checked against the *whole* dictionary (one GEMM pair);
     rows that fail get a new W = their support + the atoms with the largest KKT gradient and
     are solved again from their current codes (warm start). On coherent learned
     dictionaries most rows need this second round: top-c screening misses atoms that
     become attractive only once correlated atoms are in the code;
  4. rows that still fail after 4 rounds are solved on the full dictionary (W = all atoms).
Every returned row has passed the full KKT check, or comes from step 4.

`fista` is the official implementation's solver (FISTA, Beck & Teboulle 2009, a fixed number
of iterations) kept as a reference and a benchmark anchor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlsm.errors import UserError

MAX_ADD = 8  # atoms a row may add to its free set per active-set step


@dataclass
class SparseCodes:
    """Compact top-nnz form of codes: row i has values[i, j] at atom indices[i, j].

    Padding entries have value 0 (and index 0); rows are sorted by decreasing value.
    """

    indices: torch.Tensor  # (n, nnz) int64
    values: torch.Tensor  # (n, nnz)

    def to_dense(self, k: int) -> torch.Tensor:
        """Scatter back to a dense (n, k) tensor."""
        out = self.values.new_zeros(self.values.shape[0], k)
        return out.scatter_add_(1, self.indices, self.values)


def check_problem(X: torch.Tensor, D: torch.Tensor, lam: float) -> None:
    """Raise UserError for inputs the solvers cannot handle."""
    if X.dim() != 2 or D.dim() != 2:
        raise UserError(f"sparse coding needs X of shape (n, d) and D of shape (d, k); got {tuple(X.shape)} and {tuple(D.shape)}")
    if X.shape[1] != D.shape[0]:
        raise UserError(f"vectors have dimension {X.shape[1]} but the dictionary has {D.shape[0]} rows; use a dictionary learned on this teacher layer")
    if D.shape[1] < 1:
        raise UserError("the dictionary has no atoms; learn one with k >= 1")
    if not lam > 0:
        raise UserError(f"lambda must be > 0 (got {lam}); use e.g. --lam 0.05")
    if not bool(torch.isfinite(X).all()):
        raise UserError("input vectors contain NaN or inf; check the teacher outputs / input data")
    if not bool(torch.isfinite(D).all()):
        raise UserError("the dictionary contains NaN or inf; re-learn or re-load it")


def objective(X: torch.Tensor, D: torch.Tensor, codes: torch.Tensor, lam: float) -> torch.Tensor:
    """Per-row LASSO objective ½‖x − Dα‖² + λ‖α‖₁, shape (n,)."""
    r = X - codes @ D.T  # (n, d)
    return 0.5 * (r * r).sum(1) + lam * codes.abs().sum(1)


def kkt_violation(X: torch.Tensor, D: torch.Tensor, codes: torch.Tensor, lam: float) -> torch.Tensor:
    """Per-row max violation of the non-negative LASSO optimality conditions, shape (n,).

    g = Dᵀ(x − Dα) − λ must be 0 on the support and ≤ 0 off it; α must be ≥ 0.
    """
    g = (X - codes @ D.T) @ D - lam  # (n, k)
    on = codes > 0
    viol = torch.where(on, g.abs(), g.clamp(min=0))
    return torch.maximum(viol.amax(1), (-codes).clamp(min=0).amax(1))


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
    tol: float = 1e-5,
    working_set: int = 64,
    batch_size: int = 4096,
) -> torch.Tensor:
    """Exact (to `tol` on the KKT conditions) non-negative LASSO codes, shape (n, k).

    X: (n, d) rows to encode; D: (d, k) dictionary (columns = atoms); lam: λ > 0.
    gram: optional precomputed DᵀD (k, k) to reuse across calls. Runs on X's device/dtype.
    """
    check_problem(X, D, lam)
    D = D.to(X.dtype)
    G = D.T @ D if gram is None else gram.to(X.dtype)  # (k, k)
    out = []
    for start in range(0, X.shape[0], batch_size):
        out.append(_encode_batch(X[start : start + batch_size], D, G, lam, tol, working_set))
    if not out:
        return X.new_zeros(0, D.shape[1])
    return torch.cat(out)


def sparse_encode_topk(X: torch.Tensor, D: torch.Tensor, lam: float, nnz: int | None = None,
                       **kwargs) -> SparseCodes:
    """`sparse_encode` followed by `top_nnz`: the compact (indices, values) target form."""
    return top_nnz(sparse_encode(X, D, lam, **kwargs), nnz)


def _encode_batch(X: torch.Tensor, D: torch.Tensor, G: torch.Tensor, lam: float, tol: float,
                  m: int) -> torch.Tensor:
    """Screen → active set on W → full KKT check → re-screen failing rows → full fallback."""
    n, k = X.shape[0], D.shape[1]
    c = X @ D  # (n, k) = Dᵀx, computed once
    codes = X.new_zeros(n, k)
    todo = torch.arange(n, device=X.device)
    score = c  # (r, k) screening score of the rows in todo: c, later the KKT gradient g
    for _ in range(4):
        if todo.numel() == 0:
            return codes
        cur = codes[todo]  # (r, k) warm start (zero in round 1)
        n_sup = int((cur > 0).sum(1).max().item())
        mm = min(k, max(m, n_sup + 32))
        # The support stays in W and comes first; then the atoms that violate KKT the most.
        W = torch.where(cur > 0, torch.full_like(score, float("inf")), score).topk(mm, dim=1).indices
        cur = _solve_on_working_set(c[todo], G, W, cur.gather(1, W), n_sup, lam, tol)
        codes[todo] = cur
        g = (X[todo] - cur @ D.T) @ D - lam  # (r, k) KKT gradient on the full dictionary
        bad = _violation_from_grad(g, cur) > tol
        todo, score = todo[bad], g[bad]
    for chunk in todo.split(8):  # last resort, W = all atoms: (8, k, k) Gram blocks at most
        full = torch.arange(k, device=X.device).expand(chunk.numel(), k)
        codes[chunk] = _solve_on_working_set(c[chunk], G, full, codes[chunk], 0, lam, tol, 4 * k)
    return codes


def _violation_from_grad(g: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Max KKT violation per row given g = Dᵀ(x − Dα) − λ (see `kkt_violation`)."""
    return torch.where(codes > 0, g.abs(), g.clamp(min=0)).amax(1)


def _solve_on_working_set(c: torch.Tensor, G: torch.Tensor, W: torch.Tensor, warm: torch.Tensor,
                          n_warm: int, lam: float, tol: float, max_iter: int = 500,
                          max_add: int | None = None) -> torch.Tensor:
    """Active-set solve of min ½αᵀGα − (c−λ)ᵀα, α ≥ 0, with α restricted to atoms W (r, m).

    warm (r, m): a feasible start on W whose non-zeros are within its first n_warm slots.
    Returns dense codes (r, k). Rows that satisfy the KKT conditions on W leave the batch, so
    late iterations only touch the few rows with large supports.
    """
    r, m = W.shape
    HW = G.take(W[:, :, None] * G.shape[1] + W[:, None, :])  # (r, m, m) Gram block of W
    b = c.gather(1, W) - lam  # (r, m) linear term on W
    max_add = MAX_ADD if max_add is None else max_add
    st = _State.start(warm[:, :n_warm], max_add)
    alpha_W = b.new_zeros(r, m)  # (r, m) result, positions of W
    rows = torch.arange(r, device=b.device)
    live = torch.ones(r, dtype=torch.bool, device=b.device)
    for _ in range(max_iter):
        done = st.step(HW, b, tol, max_add) & live
        if bool(done.any()):
            alpha_W[rows[done]] = st.dense(done.nonzero().squeeze(1), m)
            live &= ~done
        if not bool(live.any()):
            break
        if int(live.sum()) < 0.75 * live.numel():  # shrink the batch only now and then
            keep = live.nonzero().squeeze(1)
            st, HW, b = st.select(keep), HW.index_select(0, keep), b.index_select(0, keep)
            rows, live = rows[keep], live[keep]
    if bool(live.any()):  # iteration cap: keep the feasible iterate; the caller re-checks KKT
        alpha_W[rows[live]] = st.dense(live.nonzero().squeeze(1), m)
    return b.new_zeros(r, c.shape[1]).scatter_(1, W, alpha_W.clamp(min=0))


@dataclass
class _State:
    """Per-row free sets as padded slots: pos (r, s) into W, ok (r, s) validity, a (r, s) ≥ 0."""

    pos: torch.Tensor
    ok: torch.Tensor
    a: torch.Tensor
    q: torch.Tensor  # (r,) how many atoms a row may add per step (1 after a stall)

    @staticmethod
    def start(warm: torch.Tensor, max_add: int) -> _State:
        """Free set = support of a feasible warm start (r, s) held in slots 0..s-1 of W."""
        r, s = warm.shape
        pos = torch.arange(s, device=warm.device).expand(r, s).clone()
        q = torch.full((r,), max_add, device=warm.device)
        return _State(pos, warm > 0, warm.clamp(min=0), q)

    def select(self, idx: torch.Tensor) -> _State:
        return _State(self.pos[idx], self.ok[idx], self.a[idx], self.q[idx])

    def dense(self, idx: torch.Tensor, m: int) -> torch.Tensor:
        a = torch.where(self.ok[idx], self.a[idx], torch.zeros_like(self.a[idx]))
        return a.new_zeros(idx.numel(), m).scatter_add_(1, self.pos[idx], a)

    def step(self, H: torch.Tensor, b: torch.Tensor, tol: float, max_add: int) -> torch.Tensor:
        """One Lawson–Hanson step for every row; returns (r,) bool 'KKT holds on W'.

        Several atoms may enter at once; entering atoms (α = 0) whose unconstrained optimum is
        ≤ 0 are sent back before the step, so α stays feasible and the objective never rises.
        A row whose entering atoms were all sent back adds one atom next time, which the
        Lawson–Hanson theory guarantees to enter with z > 0.
        """
        r, m = b.shape
        entering = self.ok & (self.a <= 0)  # (r, s), atoms added by the previous step
        HWI, z = self._solve(H, b)  # (r, m, s), (r, s)
        for _ in range(4):
            bounce = entering & self.ok & (z <= 0)
            if not bool(bounce.any()):
                break
            self.ok = self.ok & ~bounce
            # Re-solve only the rows that sent atoms back.
            rows = bounce.any(1).nonzero().squeeze(1)
            HWI[rows] = HWI[rows] * self.ok[rows, None, :]
            z[rows] = _solve_free(HWI[rows], b[rows], self.pos[rows], self.ok[rows])
        stalled = entering.any(1) & ~(entering & self.ok).any(1)
        self.q = torch.where(stalled, torch.ones_like(self.q), (2 * self.q).clamp(max=max_add))
        a = torch.where(self.ok, self.a, torch.zeros_like(self.a))
        neg = self.ok & (z <= 0)
        has_neg = neg.any(1)
        # Feasibility step (rows with neg): α ← α + t(z − α), t = min_j α_j/(α_j − z_j) over neg.
        ratio = torch.where(neg, a / (a - z).clamp(min=1e-30), torch.full_like(a, 2.0))
        t = torch.cat([ratio, ratio.new_ones(r, 1)], 1).amin(1, keepdim=True)  # (r, 1), ≤ 1
        drop = neg & (ratio <= t)  # the blocking atoms reach 0 and leave I
        lh = (a + t * (z - a)).clamp(min=0)
        # Safeguarded projection: dropping *all* negative atoms at once (α = max(z, 0)) often
        # saves many one-atom feasibility steps; take it when its objective is lower.
        proj = z.clamp(min=0) * self.ok
        use_proj = has_neg & (self._quad(HWI, b, proj) < self._quad(HWI, b, lh * ~drop))
        drop = torch.where(use_proj[:, None], neg, drop)
        self.a = torch.where(use_proj[:, None], proj, torch.where(has_neg[:, None], lh, z))
        self.ok = self.ok & ~drop
        # Rows where z was feasible: α = z; look for violators on W: w = b − G_WI α_I > tol.
        w = b - (HWI @ torch.where(self.ok, self.a, torch.zeros_like(self.a)).unsqueeze(2)).squeeze(2)
        in_I = torch.zeros(r, m, dtype=torch.bool, device=b.device).scatter_(1, self.pos, self.ok)
        viol = torch.where(in_I, torch.full_like(w, -1.0), w)  # (r, m) > tol: violates
        done = ~has_neg & (viol.amax(1) <= tol)
        self._add(viol, ~has_neg & ~done, tol)
        self._compact()
        return done

    def _quad(self, HWI: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Sub-problem objective ½xᵀG_II x − b_Iᵀx per row for x (r, s) on the free slots."""
        x = torch.where(self.ok, x, torch.zeros_like(x))
        Gx = (HWI @ x.unsqueeze(2)).squeeze(2).gather(1, self.pos)  # (r, s) = G_II x
        return (x * (0.5 * Gx - b.gather(1, self.pos))).sum(1)

    def _solve(self, H: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Columns G_WI (r, m, s) of the free atoms and the optimum z (r, s) on I."""
        r, m = b.shape
        HWI = H.gather(2, self.pos[:, None, :].expand(r, m, self.pos.shape[1]))  # (r, m, s)
        HWI = HWI * self.ok[:, None, :]
        return HWI, _solve_free(HWI, b, self.pos, self.ok)

    def _add(self, viol: torch.Tensor, rows_may_add: torch.Tensor, tol: float) -> None:
        """Append up to q most-violating atoms of W to each row's free set."""
        qmax = int(self.q.max().item()) if self.q.numel() else 0
        qmax = min(qmax, viol.shape[1])
        if qmax == 0:
            return
        v, p = viol.topk(qmax, dim=1)  # (r, q)
        rank = torch.arange(qmax, device=v.device)[None, :]
        ok = (v > tol) & rows_may_add[:, None] & (rank < self.q[:, None])
        self.pos = torch.cat([self.pos, p], 1)
        self.ok = torch.cat([self.ok, ok], 1)
        self.a = torch.cat([self.a, torch.zeros_like(v)], 1)

    def _compact(self) -> None:
        """Move valid slots first and trim the padding shared by all rows."""
        if self.ok.shape[1] == 0:
            return
        order = torch.sort(self.ok.to(torch.int8), dim=1, descending=True, stable=True).indices
        self.pos, self.ok, self.a = (t.gather(1, order) for t in (self.pos, self.ok, self.a))
        s = int(self.ok.sum(1).max().item())
        self.pos, self.ok, self.a = self.pos[:, :s], self.ok[:, :s], self.a[:, :s]


def _solve_free(HWI: torch.Tensor, b: torch.Tensor, pos: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """Solve G_II z = b_I for each row's free set I (padded slots get z = 0), shape (r, s)."""
    r, s = pos.shape
    if s == 0:
        return b.new_zeros(r, 0)
    H = HWI.gather(1, pos[:, :, None].expand(r, s, s))  # (r, s, s) = G_II
    both = ok[:, :, None] & ok[:, None, :]
    eye = torch.eye(s, dtype=H.dtype, device=H.device)
    # Padding becomes the identity; a tiny ridge keeps near-duplicate atoms factorisable.
    ridge = 1e-7 if H.dtype == torch.float32 else 1e-12
    H = torch.where(both, H, torch.zeros_like(H)) + eye * (~ok[:, :, None] + ridge)
    rhs = torch.where(ok, b.gather(1, pos), torch.zeros_like(b[:, :s]))
    L, info = torch.linalg.cholesky_ex(H)
    z = torch.cholesky_solve(rhs.unsqueeze(2), L).squeeze(2)
    # A failed factorisation (singular G_II) gives z = 0 for that row: treated as infeasible
    # and resolved by the feasibility step / the full-dictionary fallback.
    return torch.where((info == 0)[:, None] & ok, z, torch.zeros_like(z))
