"""The active-set method of `active_set.py`, compiled, one row at a time per thread (CPU path).

The batched torch loop keeps all rows in lock-step: on a GPU that is what makes it fast, on a
CPU its ~5000 small tensor operations per call cost more than the arithmetic. Here every row
runs the same Lawson–Hanson method with several atoms entering per step (see `active_set.py`
for the derivation) to its own end, in numba-compiled code, with the row's working set in
cache: its gradient g (k floats), the Gram rows of its ≤ S active atoms, G_AA⁻¹ (S × S).
The rows are split over as many threads as torch may use (`torch.get_num_threads()`).

Per row (c = Dᵀx, G = DᵀD):
  1. g = c − λ − G_{A,:}ᵀ α_A over all atoms (|A| SIMD passes over k), then one pass for its
     top-q violators among inactive atoms (g_j > tol); none: the row is optimal;
  2. the violators enter in order while they still violate: candidate j's Schur complement
     s = G_jj − gᵀG_AA⁻¹g (g = G_{A,j}) gives its coefficient v_j/s in the equality solution on
     A ∪ {j}; the later candidates' violations drop by C_ij v_j/s (C the Schur complement
     column), and G_AA⁻¹ grows by the block inverse. A violator with s ≤ 1e-5·G_jj is in the
     span of A: the row is handed to the caller's fallback;
  3. z = G_AA⁻¹(c_A − λ); Lawson–Hanson steps α ← α + t(z − α) drop blocking atoms (rank-one
     downdate of G_AA⁻¹, z downdated in closed form) until z > 0; α = z;
  4. q doubles up to q_max while entering atoms stay, else one atom enters per step.
The active set is kept compact (a leaving atom's slot takes the last one), so the small
algebra is exactly |A| × |A|. G and g stay in the input dtype (the wide work); the small
algebra is float64.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numba as nb
import numpy as np
import torch

from mlsm.teacher.slots import SlotCodes

SLOTS = 128  # active-set capacity of the first attempt (MiniLM codes: ~35 atoms, at most ~90)
DONE, FAIL, FULL = 0, 1, 2  # row status: optimal / fallback needed / more than S slots needed


@nb.njit(nogil=True, cache=True)
def solve_rows(
    c, lam, G, tol, q_max, max_steps, warm, first, step, out_idx, out_alpha, out_n, status
):
    """Solve rows first, first + step, … of c (n, k) = XD with λ = lam[0] and G (≥k, ≥k): write
    the first out_n[i] slots of out_idx / out_alpha (n, S) and status[i]. warm (n, w): guessed
    supports (−1 = none). Releases the GIL: `step` threads each take their own rows."""
    n, k = c.shape
    S = out_idx.shape[1]
    g = np.empty(k, c.dtype)
    active = np.zeros(k, np.bool_)
    A = np.empty(S, np.int64)
    Ginv = np.empty((S, S))
    alpha, z, rhs, w = np.empty(S), np.empty(S), np.empty(S), np.empty(S)
    cj, cv, entered = np.empty(q_max, np.int64), np.empty(q_max), np.empty(q_max, np.int64)
    for i in range(first, n, step):
        na, st = _solve_row(c[i], lam[0], G, tol, q_max, max_steps, warm[i], g, active, A, Ginv,
                            alpha, z, rhs, w, cj, cv, entered)
        out_idx[i, :na] = A[:na]
        out_alpha[i, :na] = alpha[:na]
        out_n[i] = na
        status[i] = st
        for s in range(na):
            active[A[s]] = False


@nb.njit(nogil=True, cache=True)
def _solve_row(
    c, lam, G, tol, q_max, max_steps, warm, g, active, A, Ginv, alpha, z, rhs, w, cj, cv, entered
):
    """Returns (|A|, status); the row's code is alpha[:|A|] on atoms A[:|A|]."""
    k = c.shape[0]
    S = A.shape[0]
    na = 0
    for j in warm:  # warm start: enter the guessed atoms that are independent of the ones before
        if 0 <= j < k and not active[j] and na < S:
            s = _schur(G, j, A, na, Ginv, w)
            if s > 1e-5 * G[j, j]:
                na = _add(j, s, A, na, Ginv, w, active)
                alpha[na - 1] = 0.0
    na = _feasible_solve(c, lam, A, na, Ginv, alpha, z, rhs, active)  # Lawson–Hanson from α = 0
    q = q_max
    for _ in range(max_steps):
        nc = _gradient_and_violators(c, lam, G, A, na, alpha, g, active, tol, q, cj, cv)
        if nc == 0:
            return na, DONE
        ne = 0
        for r in range(nc):
            j, v = cj[r], cv[r]
            if v <= tol:  # no longer violates once the atoms before it entered
                continue
            if na == S:
                return na, FULL
            s = _schur(G, j, A, na, Ginv, w)
            if s <= 1e-5 * G[j, j]:  # violating but numerically in the span of A
                return na, FAIL
            for r2 in range(r + 1, nc):  # closed-form violation update of the later candidates
                i = cj[r2]
                cij = G[i, j]
                for p in range(na):
                    cij -= G[i, A[p]] * w[p]
                cv[r2] -= cij * v / s
            na = _add(j, s, A, na, Ginv, w, active)
            alpha[na - 1] = 0.0
            entered[ne] = j
            ne += 1
        na = _feasible_solve(c, lam, A, na, Ginv, alpha, z, rhs, active)
        kept = False
        for e in range(ne):
            kept = kept or active[entered[e]]
        q = min(2 * q, q_max) if kept else 1
    return na, FAIL  # step cap: the feasible iterate, flagged


@nb.njit(nogil=True, cache=True)
def _gradient_and_violators(c, lam, G, A, na, alpha, g, active, tol, q, cj, cv):
    """g = c − λ − Σ_s α_s G[A_s, :]; the q largest g_j > tol of inactive atoms, sorted, into
    (cj, cv). Returns how many there are."""
    k = c.shape[0]
    af = np.empty(1, c.dtype)
    for j in range(k):
        g[j] = c[j] - lam
    for s in range(na):
        af[0] = alpha[s]  # α_s in the input dtype, so the loop below stays in it (SIMD)
        a = af[0]
        row = G[A[s]]
        for j in range(k):
            g[j] -= a * row[j]
    nc = 0
    thr = tol
    for j in range(k):
        v = g[j]
        if v > thr and not active[j]:
            p = min(nc, q - 1)  # insertion into the sorted buffer (the last one falls out)
            while p > 0 and cv[p - 1] < v:
                cv[p] = cv[p - 1]
                cj[p] = cj[p - 1]
                p -= 1
            cv[p] = v
            cj[p] = j
            if nc < q:
                nc += 1
            if nc == q:
                thr = cv[q - 1]
    return nc


@nb.njit(nogil=True, cache=True)
def _schur(G, j, A, na, Ginv, w):
    """w = G_AA⁻¹ G_{A,j} (into w[:na]) and the Schur complement G_jj − G_{j,A} w."""
    s = np.float64(G[j, j])
    for p in range(na):
        acc = 0.0
        for r in range(na):
            acc += Ginv[p, r] * G[j, A[r]]
        w[p] = acc
    for p in range(na):
        s -= G[j, A[p]] * w[p]
    return s


@nb.njit(nogil=True, cache=True)
def _add(j, s, A, na, Ginv, w, active):
    """Append atom j: G⁻¹ ← [[G⁻¹ + wwᵀ/s, −w/s], [−wᵀ/s, 1/s]] (block inverse)."""
    for p in range(na):
        wp = w[p] / s
        for r in range(na):
            Ginv[p, r] += wp * w[r]
        Ginv[p, na] = -wp
        Ginv[na, p] = -wp
    Ginv[na, na] = 1.0 / s
    A[na] = j
    active[j] = True
    return na + 1


@nb.njit(nogil=True, cache=True)
def _feasible_solve(c, lam, A, na, Ginv, alpha, z, rhs, active):
    """α ← the equality solution G_AA⁻¹(c_A − λ) after Lawson–Hanson steps that drop blocking
    atoms."""
    for p in range(na):
        rhs[p] = c[A[p]] - lam
    for p in range(na):
        acc = 0.0
        for r in range(na):
            acc += Ginv[p, r] * rhs[r]
        z[p] = acc
    while True:
        best, t = -1, 2.0
        for p in range(na):
            if z[p] <= 0.0:
                ratio = alpha[p] / max(alpha[p] - z[p], 1e-300)
                if ratio < t:
                    best, t = p, ratio
        if best < 0:
            break
        for p in range(na):
            alpha[p] += t * (z[p] - alpha[p])
        na = _remove(best, A, na, Ginv, alpha, z, active)
    for p in range(na):
        alpha[p] = max(z[p], 0.0)
    return na


@nb.njit(nogil=True, cache=True)
def _remove(p, A, na, Ginv, alpha, z, active):
    """Drop slot p: G⁻¹ ← G⁻¹ − G⁻¹[:, p] G⁻¹[p, :] / G⁻¹_pp, z ← z − G⁻¹[:, p] z_p / G⁻¹_pp
    (the equality solution without p); the last slot moves into p."""
    piv = Ginv[p, p]
    f = z[p] / piv
    col = Ginv[:na, p].copy()
    for r in range(na):
        z[r] -= col[r] * f
        cr = col[r] / piv
        for c in range(na):
            Ginv[r, c] -= cr * col[c]
    active[A[p]] = False
    last = na - 1
    if p != last:
        A[p] = A[last]
        alpha[p] = alpha[last]
        z[p] = z[last]
        for c in range(na):
            Ginv[p, c] = Ginv[last, c]
        for r in range(na):
            Ginv[r, p] = Ginv[r, last]
        Ginv[p, p] = Ginv[last, last]
    return last


def active_set_rows(c: torch.Tensor, Gp: torch.Tensor, lam: float, tol: float, max_steps: int,
                    q_max: int = 8, warm: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`active_set.active_set` for CPU tensors, on as many threads as torch may use; uses every
    column of `warm` (`active_set` passes at most `WARM_MAX`)."""
    n, k = c.shape
    cn = c.detach().contiguous().numpy()  # (n, k)
    lam_ = np.array([lam], dtype=cn.dtype)  # λ in c's dtype: the gradient pass stays in it
    G = Gp.detach().numpy()  # (k+1, K): row j holds G_j,: in its first k columns
    w = (np.empty((n, 0), np.int64) if warm is None
         else np.ascontiguousarray(warm.numpy(), dtype=np.int64))
    out = SlotCodes.empty(n, k, c.device, failed=True)
    rows = np.arange(n)
    threads = max(1, min(torch.get_num_threads(), n))
    for S in (min(k, SLOTS), k):  # rows that need more than SLOTS atoms run again with room for all
        r = rows.size
        idx, alpha = np.full((r, S), k, np.int64), np.zeros((r, S))
        cnt, status = np.zeros(r, np.int64), np.empty(r, np.int8)
        args = (cn[rows] if r < n else cn, lam_, G, tol, q_max, max_steps, w[rows] if r < n else w)
        # Plain threads, made per call: unlike an OpenMP pool (numba's prange, ~10 % faster
        # here) they leave nothing behind that breaks a later fork(), e.g. DataLoader workers.
        with ThreadPoolExecutor(threads) as pool:
            for job in [
                pool.submit(solve_rows, *args, t, threads, idx, alpha, cnt, status)
                for t in range(threads)
            ]:
                job.result()
        width = max(int(cnt.max(initial=0)), 1)
        at = torch.from_numpy(rows)
        out.store(at, torch.from_numpy(idx[:, :width]), torch.from_numpy(alpha[:, :width]), k)
        out.fail[at] = torch.from_numpy(status != DONE)
        rows = rows[status == FULL]
        if rows.size == 0:
            break
    return out.result()
