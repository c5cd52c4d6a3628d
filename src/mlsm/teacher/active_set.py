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
     leaves (rank-one downdate of G_AA⁻¹; z is downdated in closed form, z ← z − G⁻¹[:,s] z_s/G⁻¹_ss);
  4. α = z. A row whose entering atoms all left again adds one atom at a time from then on
     (the Lawson–Hanson theory guarantees progress for one), else q doubles up to `q_max`.

Every step decreases the objective, so the method ends; the few steps (about nnz/q) each cost
one pass over (rows, k), which is what makes it faster than following the homotopy path one
event at a time. The compiled CPU kernel (`active_set_cpu`) follows steps 1–4 exactly.

`active_set_batched` (every device but the CPU) runs the same method as fixed-shape steps, so
that no step reads a value on the host and a call issues the same operators whatever its rows
(a GPU pays per kernel launch and per device→host synchronisation, not only per FLOP): every row
has S slots; each step re-factors G_AA by a batched Cholesky (identity on empty slots) instead
of rank-one updates, takes one Lawson–Hanson step (a row with a negative z interpolates and drops
its blocking atoms, and lets nothing enter), then lets the top-q violators of the other rows
enter all at once (q doubles while no interpolation was needed, else falls to 1, where
Lawson–Hanson guarantees progress). A finished row is a fixed point of a step, so the loop runs a
fixed number of steps (`BATCHED_STEPS`) with no data-dependent exit, and is CUDA-graph capturable.
The small algebra is float64. Rows flagged as failed (a numerically singular G_AA, more than S
atoms, or not optimal after the last step) are left to the caller's fallback.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NEG = float("-inf")
WARM_MAX = 20  # atoms of a warm start used: the batched Cholesky of (m, s, s) costs ~s³
BATCHED_SLOTS = 96  # active-set capacity of the batched solver (MiniLM codes: ~35 atoms, at most ~90)
BATCHED_STEPS = 32  # steps of the batched solver per call (MiniLM rows: 0 of 1024 left at 32, 3 at 24); the rest go to the fallback


def active_set(c: torch.Tensor, Gp: torch.Tensor, lam: float, tol: float, max_steps: int,
               q_max: int = 8, warm: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes for correlations c = Dᵀx (n, k); Gp = `slots.padded_gram(DᵀD)` in c's dtype.

    warm: optional (n, s) guessed supports (atoms; k or −1 = none), e.g. the supports of earlier
    codes of the same rows, most important first: the method then starts from their first
    `WARM_MAX` atoms instead of from α = 0.
    Returns (idx (n, S), alpha (n, S), fail (n,)) as `homotopy.homotopy` does: row i's code has
    alpha[i, s] at atom idx[i, s] (k on empty slots). A row that is not failed has no atom with
    KKT gradient above `tol`.

    On CPU every row runs to its own end in compiled code (`active_set_cpu`, 3–4× faster there);
    on other devices all rows go in lock-step through `active_set_batched`.
    """
    if warm is not None:
        warm = warm[:, :WARM_MAX]
    if c.device.type == "cpu":
        from mlsm.teacher.active_set_cpu import active_set_rows  # numba: imported when first needed

        return active_set_rows(c, Gp, lam, tol, max_steps, q_max, warm)
    return active_set_batched(c, Gp, lam, tol, min(max_steps, BATCHED_STEPS), q_max, warm)


def active_set_batched(c: torch.Tensor, Gp: torch.Tensor, lam: float, tol: float, max_steps: int,
                       q_max: int = 8, warm: torch.Tensor | None = None, slots: int = BATCHED_SLOTS
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`active_set` with all rows in lock-step as fixed-shape torch operations (any device).

    Runs exactly `max_steps` steps (see the module doc): no step reads a value on the host, so
    the operator sequence does not depend on the data or the number of rows. A finished row is
    a fixed point of a step. Rows that need more than `slots` atoms, meet a degenerate active
    set or are not optimal after the last step come back flagged. Uses every column of `warm`
    that fits in `slots` (`active_set` passes at most `WARM_MAX`)."""
    n, k = c.shape
    S = min(slots, k)
    G64 = Gp.double()  # (k+1, K): the small algebra and the gradient in float64
    cpad = F.pad(c.double() - lam, (0, Gp.shape[1] - k), value=NEG)  # (n, K) c − λ, −inf past the atoms
    cpad[:, k] = 0.0  # empty slots: right-hand side 0 (column k is never a candidate: slot S holds k)
    idx = torch.full((n, S + 1), k, dtype=torch.long, device=c.device)  # slot S: scatter sink
    if warm is not None and warm.shape[1]:
        w = warm[:, :S].long().to(c.device)
        idx[:, : w.shape[1]] = torch.where((w >= 0) & (w < k), w, k)
    alpha = torch.zeros(n, S + 1, dtype=torch.float64, device=c.device)
    q = torch.full((n, 1), q_max, dtype=torch.long, device=c.device)
    fail = torch.zeros(n, dtype=torch.bool, device=c.device)
    lanes = torch.arange(q_max, device=c.device)
    moved = fail
    for _ in range(max_steps):
        moved, bad = _lawson_hanson(idx, alpha, G64, cpad, k)
        fail |= bad
        v, j = _violators(idx, alpha, G64, cpad, q_max)
        enter = (v > tol) & (lanes < q) & ~moved[:, None]  # a prefix of each row's candidates
        q = torch.where(moved[:, None], 1, (2 * q).clamp(max=q_max))
        fail |= _enter(idx, alpha, enter, j, k)
    v, _ = _violators(idx, alpha, G64, cpad, 1)
    fail |= moved | (v[:, 0] > tol)
    return idx[:, :S], alpha[:, :S], fail


def _lawson_hanson(idx: torch.Tensor, alpha: torch.Tensor, G64: torch.Tensor, cpad: torch.Tensor,
                   k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of Lawson & Hanson (1974) on every row's active set A, in place.

    z = G_AA⁻¹(c_A − λ) by a batched Cholesky of G_AA (identity on empty slots). Where z > 0 on
    A, α ← z; else α ← α + t(z − α) with t = min α_s/(α_s − z_s) over z_s ≤ 0, and the atoms that
    reach 0 there leave. Returns (moved (m,): α is not yet optimal on A, so nothing may enter;
    bad (m,): the Cholesky factorisation failed)."""
    sl = idx[:, :-1]  # (m, S)
    ok = sl < k
    Gaa = G64[sl[:, :, None], sl[:, None, :]]  # (m, S, S) G_AA; empty slots read the zero row k
    Gaa.diagonal(dim1=1, dim2=2).add_(~ok)  # identity on empty slots
    L, info = torch.linalg.cholesky_ex(Gaa)
    # an atom whose Schur complement given the slots before it, L_ii², is rounding noise relative to
    # G_jj is numerically in their span (G is only known to float32 precision): it leaves, and the row
    # G_jj: such atoms leave (their twin stays), and the row skips this step's update
    cols = torch.arange(sl.shape[1], device=sl.device)
    piv = torch.where(cols < torch.where(info > 0, info - 1, sl.shape[1])[:, None], L.diagonal(dim1=1, dim2=2), 0.0)
    weak_slot = ok & (piv.square() <= 1e-5 * Gaa.diagonal(dim1=1, dim2=2))  # first failed pivot included
    weak_slot &= weak_slot.cumsum(1) == 1  # only the first: later ones are judged once it has left
    weak = weak_slot.any(1, keepdim=True)
    rhs = cpad.gather(1, sl).unsqueeze(2)  # (m, S, 1) c_A − λ, 0 on empty slots
    # two triangular solves: cholesky_solve would read its error flags on the host
    z = torch.linalg.solve_triangular(L.mT, torch.linalg.solve_triangular(L, rhs, upper=False), upper=True).squeeze(2)
    a = alpha[:, :-1]
    neg = ok & (z <= 0)
    ratio = torch.where(neg, a / (a - z).clamp(min=1e-300), float("inf"))
    t = ratio.amin(1, keepdim=True)  # (m, 1); inf: no blocking atom
    moved = t.isfinite()
    step = torch.where(moved, a + t.clamp(max=1.0) * (z - a), z).clamp_(min=0)
    a.copy_(torch.where(weak, a, step).mul_(ok))
    leave = torch.where(weak, weak_slot, neg & (ratio <= t))
    sl.masked_fill_(leave, k)
    a.masked_fill_(leave, 0.0)
    return (moved | weak).squeeze(1), (info > 0) & ~weak.squeeze(1)


def _violators(idx: torch.Tensor, alpha: torch.Tensor, G64: torch.Tensor, cpad: torch.Tensor,
               q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The q largest KKT gradients v = c − λ − Gα among inactive atoms, (m, q) values and atoms."""
    g = F.embedding_bag(idx, G64, per_sample_weights=alpha, mode="sum")  # (m, K) = Gα (sink slot: α = 0)
    g = torch.sub(cpad, g).scatter_(1, idx, NEG)  # active atoms and the empty-slot column are no candidates
    return g.topk(q, dim=1)


def _enter(idx: torch.Tensor, alpha: torch.Tensor, enter: torch.Tensor, j: torch.Tensor, k: int) -> torch.Tensor:
    """Put the atoms j (m, q) marked `enter` (a prefix) into free slots with α = 0, in place.

    The active atoms are first moved to the front of the slots (sorted by atom); the new ones go
    right after them. Returns the rows that have no room (m,)."""
    S = idx.shape[1] - 1
    sl, order = idx[:, :-1].sort(1)  # empty slots (atom k) last
    idx[:, :-1] = sl
    alpha[:, :-1] = alpha[:, :-1].gather(1, order)
    pos = (sl < k).sum(1, keepdim=True) + torch.arange(j.shape[1], device=j.device)  # (m, q)
    full = (enter & (pos >= S)).any(1)
    idx.scatter_(1, torch.where(enter, pos.clamp(max=S), S), torch.where(enter, j, k))
    idx[:, S] = k  # the sink slot stays empty
    return full
