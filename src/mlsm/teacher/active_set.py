"""Batched primal active-set solver for the non-negative LASSO, all rows in lock-step.

On the quadratic form of the problem, min ½αᵀGα − (c − λ)ᵀα over α ≥ 0 with c = Dᵀx and
G = DᵀD, this is the primal active-set method of Lawson & Hanson (1974, ch. 23) with several
atoms entering per step:

  1. the KKT gradient v = c − λ − Gα of every atom (one `embedding_bag` over the Gram rows of
     the active atoms, weighted by α) gives each row's top-q violators (v_j > tol); a row with
     none is optimal and leaves the batch;
  2. the violators enter one after the other through rank-one updates of G_AA⁻¹ (block inverse,
     Schur complement s = G_jj − gᵀG_AA⁻¹g). Entering atom j changes the equality solution by
     −u·v_j/s (u = (G_AA⁻¹g, −1)), so the violation of the next candidate is updated in
     closed form and a candidate enters only while it still violates: its coefficient v_j/s is
     then positive, and no entering atom bounces straight back out;
  3. z = G_AA⁻¹(c_A − λ), and while some z_s < 0 the Lawson–Hanson interpolation
     α ← α + t(z − α), t = min α_s/(α_s − z_s), moves to the boundary and the blocking atom
     leaves (rank-one downdate of G_AA⁻¹; z is downdated in closed form,
     z ← z − G⁻¹[:,s] z_s/G⁻¹_ss);
  4. α = z. A row whose entering atoms all left again adds one atom at a time from then on
     (the Lawson–Hanson theory guarantees progress for one), else q doubles up to `q_max`.

Every step decreases the objective, so the method ends; the few steps (about nnz/q) each cost
one pass over (rows, k), which is what makes it faster than following the homotopy path one
event at a time. The small (|A| × |A|) algebra is float64; the wide (rows, k) work uses the
input dtype. Rows flagged as failed (a violating atom numerically in the span of A, or the step
cap) are left to the caller's fallback.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from mlsm.teacher.slots import SlotCodes, pad_slots, remove_slot

NEG = float("-inf")
WARM_MAX = 20  # atoms of a warm start used: the batched Cholesky of (m, s, s) costs ~s³


@dataclass
class _Sets:
    """Per-row state; m rows, S slots (append-only, holes after atoms leave), K ≥ k+1 columns."""

    rows: torch.Tensor  # (m,) row ids in the caller's batch
    cpad: torch.Tensor  # (m, K) c − λ on atoms, −inf on the empty-slot column k and padding
    Ginv: torch.Tensor  # (m, S, S) float64 G_AA⁻¹ on the active slots, 0 elsewhere
    idx: torch.Tensor  # (m, S) atom of each slot; k marks an empty slot
    ok: torch.Tensor  # (m, S) slot holds an active atom
    alpha: torch.Tensor  # (m, S) float64 coefficients ≥ 0
    cnt: torch.Tensor  # (m,) slots used so far
    q: torch.Tensor  # (m,) atoms a row may add per step

    def select(self, keep: torch.Tensor) -> _Sets:
        return _Sets(**{f.name: getattr(self, f.name)[keep] for f in fields(self)})

    def ensure_slots(self, need: int, k: int) -> None:
        """Append empty slots so that `need` fit."""
        if need > self.idx.shape[1]:
            pad_slots(self, need - self.idx.shape[1], k)


def active_set(c: torch.Tensor, Gp: torch.Tensor, lam: float, tol: float, max_steps: int,
               q_max: int = 8,
               warm: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes for correlations c = Dᵀx (n, k); Gp = `slots.padded_gram(DᵀD)` in c's dtype.

    warm: optional (n, s) guessed supports (atoms; k or −1 = none), e.g. the supports of earlier
    codes of the same rows, most important first: the method then starts from their first
    `WARM_MAX` atoms instead of from α = 0.
    Returns (idx (n, S), alpha (n, S), fail (n,)) as `homotopy.homotopy` does: row i's code has
    alpha[i, s] at atom idx[i, s] (k on empty slots). On CPU a row that is not failed has no atom
    with KKT gradient above `tol`; the fixed-shape path flags no row (it would cost a sync to
    know), so callers check the codes themselves, as `sparse_coding.encode_with_gram` does.

    On CPU every row runs to its own end in compiled code (`active_set_cpu`, 3–4× faster there);
    on other devices (CUDA) all rows go in lock-step through `active_set_fixed.active_set_fixed`:
    a fixed sequence of operators with no host synchronisation (GPUs pay per launch and per sync).
    `active_set_batched` is the earlier lock-step path, kept as an option.
    """
    if warm is not None:
        warm = warm[:, :WARM_MAX]
    if c.device.type == "cpu":
        from mlsm.teacher.active_set_cpu import active_set_rows  # numba: imported when first needed

        return active_set_rows(c, Gp, lam, tol, max_steps, q_max, warm)
    from mlsm.teacher.active_set_fixed import active_set_fixed

    return active_set_fixed(c, Gp, lam, tol, warm=warm)


def active_set_batched(c: torch.Tensor, Gp: torch.Tensor, lam: float, tol: float, max_steps: int,
                       q_max: int = 8, warm: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`active_set` with all rows in lock-step as batched torch operations (any device); uses
    every column of `warm` (`active_set` passes at most `WARM_MAX`)."""
    n, k = c.shape
    dev = c.device
    cpad = torch.full((n, Gp.shape[1]), NEG, dtype=c.dtype, device=dev)
    cpad[:, :k] = c - lam
    S = 16
    st = _Sets(rows=torch.arange(n, device=dev), cpad=cpad,
               Ginv=torch.zeros(n, S, S, dtype=torch.float64, device=dev),
               idx=torch.full((n, S), k, dtype=torch.long, device=dev),
               ok=torch.zeros(n, S, dtype=torch.bool, device=dev),
               alpha=torch.zeros(n, S, dtype=torch.float64, device=dev),
               cnt=torch.zeros(n, dtype=torch.long, device=dev),
               q=torch.full((n,), q_max, dtype=torch.long, device=dev))
    if warm is not None and warm.shape[1]:
        _warm_sets(st, warm.to(dev), Gp)
    out = SlotCodes.empty(n, k, dev, failed=True)  # fail is cleared when a row converges
    for _ in range(max_steps):
        if st.rows.numel() == 0:
            break
        v, j = _violators(st, Gp, int(st.q.max()))
        done = v[:, 0] <= tol
        n_done = int(done.sum())
        if n_done:
            out.store(st.rows[done], st.idx[done], st.alpha[done], k)
            out.fail[st.rows[done]] = False
            if n_done == done.numel():
                break
            if n_done >= 0.25 * done.numel():  # shrink the batch now and then; until then a
                keep = (~done).nonzero().squeeze(1)  # finished row just finds no violator again
                st, v, j = st.select(keep), v[keep], j[keep]
        entered, stuck = _enter(st, v, j, Gp, tol)
        _feasible_solve(st, k)
        kept = (st.ok.gather(1, entered[1]) & entered[0]).any(1)
        st.q = torch.where(kept, (2 * st.q).clamp(max=q_max), torch.ones_like(st.q))
        if bool(stuck.any()):  # a violator that cannot enter: degenerate, hand the row over
            out.store(st.rows[stuck], st.idx[stuck], st.alpha[stuck], k)
            st = st.select((~stuck).nonzero().squeeze(1))
    if st.rows.numel():  # step cap: return the feasible iterate, flagged
        out.store(st.rows, st.idx, st.alpha, k)
    return out.result()


def _warm_sets(st: _Sets, warm: torch.Tensor, Gp: torch.Tensor) -> None:
    """Start every row from its guessed support A with G_AA⁻¹ on it, then solve on A from α = 0.

    Atoms in the span of the others are left out (`_factor`). Atoms with a coefficient ≤ 0 in
    the equality solution on A are mostly stale: they are dropped all at once and A factored
    again (Lawson–Hanson would drop them one at a time). α = 0 is feasible, so the Lawson–Hanson
    solve on the rest is a valid start; atoms it drops can enter again later.
    """
    k, K = Gp.shape[0] - 1, Gp.shape[1]
    warm = warm.long()
    idx = torch.where((warm >= 0) & (warm < k), warm, k).sort(1).values  # atoms first
    s = int((idx < k).sum(1).max())
    if s == 0:
        return
    idx = idx[:, :s]  # (m, s)
    ok = idx < k
    Gaa = Gp.take(idx[:, :, None] * K + idx[:, None, :]).double()  # (m, s, s)
    L = _factor(Gaa, ok)
    rhs = torch.where(ok, st.cpad.gather(1, idx).double(), 0.0).unsqueeze(2)  # (m, s, 1) c_A − λ
    stale = ok & (torch.cholesky_solve(rhs, L).squeeze(2) <= 0)
    if bool(stale.any()):
        ok &= ~stale
        L = _factor(Gaa, ok)
    st.ensure_slots(s, k)
    st.idx[:, :s] = torch.where(ok, idx, k)
    st.ok[:, :s] = ok
    st.Ginv[:, :s, :s] = torch.cholesky_inverse(L) * (ok[:, :, None] & ok[:, None, :])
    # new atoms go after the last kept slot
    st.cnt = (ok * torch.arange(1, s + 1, device=ok.device)).amax(1)
    _feasible_solve(st, k)


def _factor(Gaa: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """Cholesky factor L (m, s, s) of G_AA on the slots `ok` (identity elsewhere), after leaving out
    (in `ok`, in place) every atom whose Schur complement given the atoms before it, L_ii², is
    rounding noise relative to its G_jj: the same test as for entering atoms."""
    m, s = ok.shape
    eye = torch.eye(s, dtype=Gaa.dtype, device=Gaa.device)
    col = torch.arange(s, device=Gaa.device)
    g_jj = Gaa.diagonal(dim1=1, dim2=2)
    while True:  # every repeat leaves out an atom of a row, so this ends; usually runs once
        L, info = torch.linalg.cholesky_ex(torch.where(ok[:, :, None] & ok[:, None, :], Gaa, eye))
        # columns before a failed pivot
        factored = col < torch.where(info > 0, info - 1, s)[:, None]
        weak = ok & ~(factored & (L.diagonal(dim1=1, dim2=2) ** 2 > 1e-5 * g_jj))
        if not bool(weak.any()):
            return L
        # the first weak atom of a row depends on earlier ones
        rows = weak.any(1).nonzero().squeeze(1)
        ok[rows, weak[rows].int().argmax(1)] = False


def _violators(st: _Sets, Gp: torch.Tensor, q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The q largest KKT gradients v = c − λ − Gα among inactive atoms, (m, q) values and atoms."""
    flat = st.ok.view(-1).nonzero().squeeze(1)
    counts = st.ok.sum(1)
    # (m, K) = Gα
    g = F.embedding_bag(st.idx.view(-1)[flat], Gp, counts.cumsum(0) - counts,
                        per_sample_weights=st.alpha.view(-1)[flat].to(Gp.dtype), mode="sum")
    torch.sub(st.cpad, g, out=g)
    g.scatter_(1, st.idx, NEG)  # active atoms (and the empty-slot column) are not candidates
    v, j = g.topk(q, dim=1)
    return v, j.clamp(max=Gp.shape[0] - 1)  # a −inf pick past the atoms: the empty-slot row


def _enter(st: _Sets, v: torch.Tensor, j: torch.Tensor, Gp: torch.Tensor, tol: float
           ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Let candidates j (m, q) enter in order while they still violate (see the module doc).

    With B = G_AA⁻¹ G_{A,Q} and the Schur complement C = G_QQ − G_{Q,A} B of the candidates Q,
    letting candidate r enter changes the others' violations by −C_ir v_r / C_rr and their Schur
    complement like one step of Gaussian elimination, so the order-dependent decisions only need
    (m, q, q) work; the accepted set A' then enters at once by the block inverse
    G_{A∪A'}⁻¹ = G_AA⁻¹ (padded) + W C_{A'A'}⁻¹ Wᵀ with W = (B; −I) on the new slots.
    Returns ((accepted (m, q), slot (m, q)), stuck (m,)): stuck rows had a violating candidate
    with a vanishing Schur complement.
    """
    m, q = j.shape
    K = Gp.shape[1]
    Gaq = Gp.take(st.idx[:, :, None] * K + j[:, None, :]).double()  # (m, S, q) G_{A,Q}
    B = torch.bmm(st.Ginv, Gaq)  # (m, S, q)
    Gqq = Gp.take(j[:, :, None] * K + j[:, None, :]).double()  # (m, q, q)
    C = Gqq - torch.bmm(Gaq.transpose(1, 2), B)  # (m, q, q)
    acc = _accept(C.clone(), v.double(), st.q, tol, Gqq.diagonal(dim1=1, dim2=2))
    stuck = acc.isnan().any(1)  # marked by _accept
    acc = acc.nan_to_num(0.0).bool()
    # Slots only for the accepted atoms: every extra slot costs in each (m, S, S) operation.
    st.ensure_slots(int((st.cnt + acc.sum(1)).max()), Gp.shape[0] - 1)
    S = st.idx.shape[1]
    B = F.pad(B, (0, 0, 0, S - B.shape[1]))  # new slots: zero rows of the old G_AA⁻¹
    eye = torch.eye(q, dtype=C.dtype, device=C.device)
    both = acc[:, :, None] & acc[:, None, :]
    Cinv, _ = torch.linalg.inv_ex(torch.where(both, C, eye))  # (m, q, q), identity off A'
    # new slot of each accepted
    slot = (st.cnt[:, None] + acc.cumsum(1) - 1).clamp(min=0, max=S - 1)
    e, r = acc.nonzero(as_tuple=True)
    W = B * acc[:, None, :]  # (m, S, q): (B; −I) on the new slots, 0 for rejected candidates
    W[e, slot[e, r], r] = -1.0
    st.Ginv.baddbmm_(torch.bmm(W, Cinv * both), W.transpose(1, 2))
    st.idx[e, slot[e, r]] = j[e, r]
    st.ok[e, slot[e, r]] = True
    st.cnt += acc.sum(1)
    return (acc, slot), stuck


def _accept(C: torch.Tensor, v: torch.Tensor, q: torch.Tensor, tol: float,
            g_jj: torch.Tensor) -> torch.Tensor:
    """Sequential entry decisions on the candidates' Schur complement C (m, q, q), in place.

    A candidate enters while it still violates (v > tol) and its Schur complement is not
    rounding noise relative to its G_jj (G is only known to float32 precision).
    Returns (m, q) float: 1 entered, 0 not, NaN = violating but numerically dependent on A.
    """
    out = torch.zeros_like(v)
    for r in range(v.shape[1]):
        piv = C[:, r, r]
        wants = (q > r) & (v[:, r] > tol)
        ok = wants & (piv > 1e-5 * g_jj[:, r])
        out[:, r] = torch.where(ok, 1.0, torch.where(wants, float("nan"), 0.0))
        # eliminate r from the rows/columns after it (Schur complement), update the violations
        f = (ok / torch.where(ok, piv, 1.0))[:, None] * C[:, r + 1 :, r]  # (m, q−r−1)
        v[:, r + 1 :] -= f * v[:, r : r + 1]
        C[:, r + 1 :, r + 1 :] -= f[:, :, None] * C[:, r, r + 1 :][:, None, :]
    return out


def _feasible_solve(st: _Sets, k: int) -> None:
    """α ← the equality solution on A, after Lawson–Hanson steps that drop blocking atoms."""
    rhs = torch.where(st.ok, st.cpad.gather(1, st.idx).double(), 0.0)  # c_A − λ
    z = torch.bmm(st.Ginv, rhs.unsqueeze(2)).squeeze(2)  # (m, S)
    a = st.alpha
    for _ in range(st.idx.shape[1] + 1):
        neg = st.ok & (z <= 0)
        rows = neg.any(1)
        if not bool(rows.any()):
            break
        ratio = torch.where(neg, a / (a - z).clamp(min=1e-300), float("inf"))
        t, s = ratio.min(1)
        a = torch.where(rows[:, None], a + t.clamp(max=1.0)[:, None] * (z - a), a)
        d = rows.nonzero().squeeze(1)
        s = s[d]
        col, piv = remove_slot(st.Ginv, d, s)
        z[d] = z[d] - col * (z[d, s] / piv)[:, None]  # solution without slot s
        st.idx[d, s] = k
        st.ok[d, s] = False
        z[d, s] = 0.0
        a[d, s] = 0.0
    st.alpha = z.clamp(min=0) * st.ok
