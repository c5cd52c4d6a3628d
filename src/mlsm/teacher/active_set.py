"""Fallback solver: a batched Lawson–Hanson active-set method on the whole dictionary.

`sparse_encode` uses the homotopy (`mlsm.teacher.homotopy`) for every row and this solver only
for the rows whose homotopy path failed the KKT check (a degenerate or numerically hard path,
e.g. near-duplicate atoms in float32). It solves min ½αᵀGα − (c − λ)ᵀα, α ≥ 0 directly by the
primal active-set method of Lawson & Hanson (1974, ch. 23): a free set I grows by the most
violating atoms (several per step, one after a stall) and shrinks by feasibility steps (the
Lawson–Hanson interpolation, or dropping all negative atoms at once when that lowers the
objective more); each step solves G_II z = (c − λ)_I with one batched Cholesky over padded,
compacted free sets. It is slower than the homotopy but needs no path to be regular.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_ADD = 8  # atoms a row may add to its free set per active-set step


def solve_full(c: torch.Tensor, G: torch.Tensor, lam: float, tol: float, chunk: int = 8) -> torch.Tensor:
    """Codes (r, k) for correlations c = Dᵀx (r, k) on the whole dictionary, G = DᵀD (k, k).

    Rows go `chunk` at a time, since each needs its own (k, k) block of G.
    """
    k = c.shape[1]
    out = []
    for rows in torch.arange(c.shape[0], device=c.device).split(chunk):
        full = torch.arange(k, device=c.device).expand(rows.numel(), k)
        out.append(_solve_on_working_set(c[rows], G, full, c.new_zeros(rows.numel(), 0), 0, lam, tol, 4 * k))
    return torch.cat(out) if out else c.new_zeros(0, k)


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
