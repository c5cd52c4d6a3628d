"""Batched homotopy (LARS-lasso) for the non-negative LASSO, all rows in lock-step.

For one row the solution path α(μ) of min ½‖x − Dα‖² + μ‖α‖₁, α ≥ 0 is piecewise linear in μ
(Efron et al. 2004, §3 "LARS-Lasso"; Osborne, Presnell & Turlach 2000). With c = Dᵀx, G = DᵀD
and the active set A, the path starts at μ₀ = max_j c_j with A = {argmax} and follows

    α_A(μ − t) = α_A(μ) + t·w,     w = G_AA⁻¹ 1                       (active correlations
    ĉ_j(μ − t) = ĉ_j(μ) − t·a_j,   a = G_{:,A} w,   ĉ = c − Gα         all stay equal to μ)

until an inactive atom's correlation reaches the shrinking μ (it enters: t = r_j / (1 − a_j)
with r_j = μ − ĉ_j) or an active coefficient reaches 0 (it leaves: t = −α_s / w_s), or μ
reaches the target λ. Every row takes the same kind of step at once, so one step costs:

  * a = G_{:,A} w for every atom: an `embedding_bag` over the rows of G named by each row's
    active set (sum of |A| rows of G weighted by w), ~27 GMAC/s in fp32 on a 2-core CPU;
  * five in-place elementwise passes over (rows, k) and a blocked argmax (torch's
    max-with-index is ~10× slower than `amax` on CPU, so blocks of 64 go through `amax` first);
  * a rank-one update of G_AA⁻¹ when an atom enters or leaves (block inverse / Schur
    complement; no factorisation in the loop).

The small (|A| × |A|) algebra runs in float64; the wide (rows, k) work in the input dtype,
in place where possible (fresh multi-MB temporaries cost page faults on CPU). When a row
reaches λ its coefficients are recomputed on its final support (α_A = G_AA⁻¹(c_A − λ)),
and the caller checks the KKT conditions against the whole dictionary: rows that fail (a
degenerate path, fp32 drift, the step cap) are reported, never silently returned.

Role: `sparse_encode` runs this path only for the rows its main solver (`active_set.py`) could
not finish. On MiniLM states it is ~2× slower than the active set, which needs one pass over
(rows, k) per ~8 entering atoms instead of one per event.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from mlsm.teacher.slots import BLOCK, SlotCodes, pad_slots, remove_slot

BIG = 1e30  # "never enters": distance of active atoms and padding columns
MAX_STALL = 16  # consecutive zero-length steps after which a row is given up (cycling)


@dataclass
class _Path:
    """Per-row path state; m rows, S active-set slots, K ≥ k+1 padded atom columns."""

    rows: torch.Tensor  # (m,) row ids in the caller's batch
    r: torch.Tensor  # (m, K) μ − ĉ_j ≥ 0 for inactive atoms, BIG for active atoms and padding
    idx: torch.Tensor  # (m, S) atom in each slot; k marks an empty slot (zero row of G)
    ok: torch.Tensor  # (m, S) slot holds an active atom
    alpha: torch.Tensor  # (m, S) float64 coefficients of the slots
    Ginv: torch.Tensor  # (m, S, S) float64 G_AA⁻¹ on the active slots, 0 on empty ones
    cnt: torch.Tensor  # (m,) slots used so far (new atoms are appended)
    mu: torch.Tensor  # (m,) float64 current regularisation μ ≥ λ
    banned: torch.Tensor  # (m,) atom that just left (may not re-enter at once), else k
    live: torch.Tensor  # (m,) bool, row still walking
    stall: torch.Tensor  # (m,) consecutive zero-length steps

    def select(self, keep: torch.Tensor) -> _Path:
        return _Path(**{f.name: getattr(self, f.name)[keep] for f in fields(self)})


def homotopy(c: torch.Tensor, Gp: torch.Tensor, lam: float, max_steps: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Non-negative LASSO codes for correlations c = Dᵀx (n, k) by the batched LARS-lasso path.

    Gp: `slots.padded_gram(DᵀD)` in c's dtype. Returns (idx (n, S), alpha (n, S) ≥ 0, fail (n,)):
    row i's code has alpha[i, s] at atom idx[i, s] (idx = k for empty slots); fail marks rows
    whose path hit the step cap or ended with a negative coefficient. KKT is not checked here.
    """
    n, k = c.shape
    dev = c.device
    out = SlotCodes.empty(n, k, dev, failed=False)
    path = _start(c, Gp, lam, S=8)
    q = torch.empty_like(path.r)
    banned = False
    for _ in range(max_steps):
        if path.rows.numel() == 0:
            break
        w, slope = _direction(path, Gp)
        t, event, j_in, s_out = _step_length(path, w, slope, lam, q)
        path.alpha.addcmul_(w, t[:, None])  # w = 0 on empty slots and finished rows
        path.mu.sub_(t)
        path.r.addcmul_(slope, t.to(slope.dtype)[:, None])  # r(μ − t) = r + t(a − 1)
        path.stall = torch.where(t > 0, 0, path.stall + 1)
        event = torch.where((path.stall > MAX_STALL) & (event > 0), 3, event)  # 3: cycling in place
        n_event = torch.bincount(event + 1, minlength=5).tolist()  # one sync for the branches below
        if banned:
            path.banned.fill_(k)
        if n_event[2]:
            path = _grow(path, event == 1, k)
            _enter(path, event == 1, j_in, Gp)
        banned = n_event[3] > 0
        if banned:
            _leave(path, (event == 2).nonzero().squeeze(1), s_out, k)
        if n_event[1] or n_event[4]:
            _finish(path, (event == 0) | (event == 3), c, lam, out)
            out.fail[path.rows[event == 3]] = True
            if int(path.live.sum()) < 0.75 * path.live.numel():  # shrink the batch now and then
                path = path.select(path.live.nonzero().squeeze(1))
                q = torch.empty_like(path.r)
    if path.rows.numel():  # step cap reached
        live = path.live.clone()
        _finish(path, live, c, lam, out)
        out.fail[path.rows[live]] = True
    return out.result()


def _start(c: torch.Tensor, Gp: torch.Tensor, lam: float, S: int) -> _Path:
    """Rows whose μ₀ = max c exceeds λ start with A = {argmax c}; the rest have α = 0."""
    n, k = c.shape
    mu0, j0 = c.max(1)
    rows = (mu0 > lam).nonzero().squeeze(1)
    c, mu0, j0 = c[rows], mu0[rows], j0[rows]
    m, K = rows.numel(), Gp.shape[1]
    r = c.new_full((m, K), BIG)
    r[:, :k] = mu0[:, None] - c
    r.scatter_(1, j0[:, None], BIG)
    idx = torch.full((m, S), k, dtype=torch.long, device=c.device)
    idx[:, 0] = j0
    ok = torch.zeros(m, S, dtype=torch.bool, device=c.device)
    ok[:, 0] = True
    Ginv = torch.zeros(m, S, S, dtype=torch.float64, device=c.device)
    Ginv[:, 0, 0] = 1.0 / Gp.take(j0 * (K + 1)).double()
    return _Path(
        rows=rows,
        r=r,
        idx=idx,
        ok=ok,
        alpha=torch.zeros(m, S, dtype=torch.float64, device=c.device),
        Ginv=Ginv,
        cnt=torch.ones(m, dtype=torch.long, device=c.device),
        mu=mu0.double(),
        banned=torch.full((m,), k, dtype=torch.long, device=c.device),
        live=torch.ones(m, dtype=torch.bool, device=c.device),
        stall=torch.zeros(m, dtype=torch.long, device=c.device),
    )


def _direction(path: _Path, Gp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w = G_AA⁻¹ 1 (m, S) and slope = a − 1 = G_{:,A} w − 1 (m, K), +1 on A and padding.

    An inactive atom approaches entry (r falls) where slope < 0.
    """
    w = path.Ginv.sum(2)  # 0 on empty slots and on finished rows (see `_finish`)
    # Ragged bags over the active slots only (padding would double the work).
    flat = path.ok.view(-1).nonzero().squeeze(1)
    counts = path.ok.sum(1)
    a = F.embedding_bag(path.idx.view(-1)[flat], Gp, counts.cumsum(0) - counts,
                        per_sample_weights=w.view(-1)[flat].to(Gp.dtype), mode="sum")  # (m, K)
    a.scatter_(1, path.idx, 2.0)  # active atoms and the empty-slot column k never enter
    a[:, Gp.shape[0]:] = 2.0  # nor does the padding
    return w, a.sub_(1.0)


def _step_length(path: _Path, w: torch.Tensor, slope: torch.Tensor, lam: float, q: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step t (m,) to the next event: 0 = μ reaches λ, 1 = atom j_in enters, 2 = slot s_out
    leaves."""
    m, K = slope.shape
    torch.clamp(slope, max=-1e-12, out=q)
    torch.div(path.r, q, out=q)  # (m, K) −(step at which each atom would enter); −inf: never
    q.scatter_(1, path.banned[:, None], float("-inf"))
    blocks = q.view(m, K // BLOCK, BLOCK)
    b = blocks.amax(2).argmax(1)  # (m,) block holding the maximum
    inner = blocks.gather(1, b[:, None, None].expand(m, 1, BLOCK)).squeeze(1)  # (m, BLOCK)
    neg_t_in, off = inner.max(1)
    j_in, t_in = b * BLOCK + off, -neg_t_in.double()
    t_out, s_out = torch.where(w < 0, -path.alpha / w, float("inf")).min(1)  # w = 0 off A
    t_end = path.mu - lam
    t_min = torch.minimum(t_in, t_out)
    event = torch.where(t_end <= t_min, 0, torch.where(t_in < t_out, 1, 2))
    t = torch.minimum(t_min, t_end).clamp(min=0) * path.live
    return t, torch.where(path.live, event, -1), j_in, s_out


def _grow(path: _Path, entering: torch.Tensor, k: int, extra: int = 8) -> _Path:
    """Add `extra` empty slots when an entering row has none left."""
    if int(path.cnt[entering].max()) >= path.idx.shape[1]:
        pad_slots(path, extra, k)
    return path


def _enter(path: _Path, enter: torch.Tensor, j_in: torch.Tensor, Gp: torch.Tensor) -> None:
    """Append atom j_in in rows `enter` (m,) bool: rank-one update of G_AA⁻¹.

    With g = G_{A,j}, b = G_AA⁻¹ g and the Schur complement s = G_jj − gᵀb, the new inverse
    is G_AA⁻¹ + u uᵀ/s with u = (b, −1), the −1 in the new slot. An atom with s ≈ 0 lies
    numerically in the span of A (e.g. a duplicate of an active atom: its correlation moves
    with μ and never needs to enter); it is excluded from the row instead, and the KKT check
    afterwards confirms that the row's code is still optimal.
    """
    K = Gp.shape[1]
    rows = torch.arange(enter.numel(), device=enter.device)
    g = Gp.take(path.idx * K + j_in[:, None]).double()  # (m, S), 0 on empty slots
    b = torch.bmm(path.Ginv, g.unsqueeze(2)).squeeze(2)  # (m, S)
    g_jj = Gp.take(j_in * (K + 1)).double()
    schur = g_jj - (g * b).sum(1)  # (m,)
    path.r[rows[enter], j_in[enter]] = BIG  # entered, or excluded for good
    # G itself is only known to Gp's precision: a smaller Schur complement is rounding noise.
    enter = enter & (schur > max(1e-10, 100 * torch.finfo(Gp.dtype).eps) * g_jj)
    p = path.cnt.clamp(max=path.idx.shape[1] - 1)  # the new slot
    u = b.index_put((rows, p), torch.full_like(schur, -1.0))
    scale = torch.where(enter, 1.0 / schur, torch.zeros_like(schur))  # 0: row unchanged
    path.Ginv.addcmul_(u[:, :, None] * scale[:, None, None], u[:, None, :])
    e, pe = rows[enter], p[enter]
    path.idx[e, pe] = j_in[e]
    path.ok[e, pe] = True
    path.cnt[e] += 1


def _leave(path: _Path, lv: torch.Tensor, s_out: torch.Tensor, k: int) -> None:
    """Remove slot s from rows lv: G_AA⁻¹ ← G_AA⁻¹ − G⁻¹[:, s] G⁻¹[s, :] / G⁻¹[s, s]."""
    so = s_out[lv]
    jo = path.idx[lv, so]
    path.idx[lv, so] = k
    path.ok[lv, so] = False
    path.alpha[lv, so] = 0.0
    path.r[lv, jo] = 0.0  # its correlation equals μ now; it moves away from μ next step
    path.banned[lv] = jo
    remove_slot(path.Ginv, lv, so)


def _finish(path: _Path, done: torch.Tensor, c: torch.Tensor, lam: float, out: SlotCodes) -> None:
    """Store rows `done` with α_A recomputed on their support, α_A = G_AA⁻¹(c_A − λ).

    A negative coefficient (the path went wrong numerically) marks the row as failed.
    The rows are then retired from the path.
    """
    d = done.nonzero().squeeze(1)
    k = c.shape[1]
    rows, idx, ok = path.rows[d], path.idx[d], path.ok[d]
    rhs = torch.where(
        ok, c[rows].gather(1, idx.clamp(max=k - 1)).double() - lam, torch.zeros_like(path.alpha[d])
    )
    alpha = torch.bmm(path.Ginv[d], rhs.unsqueeze(2)).squeeze(2) * ok
    out.store(rows, idx, alpha, k)
    out.fail[rows] = (alpha < 0).any(1)
    # The row stops: no active slots, w = G⁻¹1 = 0, so later steps neither move nor bag it.
    path.live[d] = False
    path.ok[d] = False
    path.Ginv[d] = 0.0
