"""Per-row active sets as padded slots, shared by the two batched solvers.

Both `active_set.py` and `homotopy.py` keep, for every row, atoms in slots (idx (m, S), with k
marking an empty slot), coefficients alpha (m, S) and G_AA⁻¹ (m, S, S) in float64 with zero
rows/columns on empty slots. The Gram matrix is padded with a zero row k, so an empty slot
gathers zeros, and with zero columns up to a multiple of BLOCK for blocked reductions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

BLOCK = 64  # column padding of the Gram matrix (blocked reductions over atoms)


def padded_gram(G: torch.Tensor | None = None, D: torch.Tensor | None = None) -> torch.Tensor:
    """(k+1, K) Gram matrix: zero row k (empty slots), zero columns up to K = 64·⌈(k+1)/64⌉.

    From a given G (k, k), or straight from the atoms D (d, k), written into place by one GEMM.
    """
    k = G.shape[0] if G is not None else D.shape[1]
    K = -(-(k + 1) // BLOCK) * BLOCK
    if G is not None:
        Gp = G.new_zeros(k + 1, K)
        Gp[:k, :k] = G
        return Gp
    Gp = D.new_zeros(k + 1, K)
    torch.mm(D.T, F.pad(D, (0, K - k)), out=Gp[:k])  # (k, K) = Dᵀ[D, 0]
    return Gp


@dataclass
class SlotCodes:
    """A solver's output: row i has alpha[i, s] at atom idx[i, s] (idx = k on empty slots)."""

    idx: torch.Tensor  # (n, S_out)
    alpha: torch.Tensor  # (n, S_out) float64
    fail: torch.Tensor  # (n,) bool

    @staticmethod
    def empty(n: int, k: int, device: torch.device, failed: bool) -> SlotCodes:
        return SlotCodes(torch.full((n, 1), k, dtype=torch.long, device=device),
                         torch.zeros(n, 1, dtype=torch.float64, device=device),
                         torch.full((n,), failed, dtype=torch.bool, device=device))

    def store(self, rows: torch.Tensor, idx: torch.Tensor, alpha: torch.Tensor, k: int) -> None:
        """Write rows (r,) of a solver's slots (r, S), widening the outputs when needed."""
        S, S_out = idx.shape[1], self.idx.shape[1]
        if S_out < S:
            self.idx = F.pad(self.idx, (0, S - S_out), value=k)
            self.alpha = F.pad(self.alpha, (0, S - S_out))
        self.idx[rows, :S] = idx
        self.alpha[rows, :S] = alpha

    def result(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.idx, self.alpha, self.fail


def pad_slots(state: Any, extra: int, k: int) -> None:
    """Append `extra` empty slots to a solver state with fields Ginv, idx, ok, alpha."""
    m = state.idx.shape[0]
    state.Ginv = F.pad(state.Ginv, (0, extra, 0, extra))
    state.idx = F.pad(state.idx, (0, extra), value=k)
    state.ok = torch.cat([state.ok, state.ok.new_zeros(m, extra)], 1)
    state.alpha = F.pad(state.alpha, (0, extra))


def remove_slot(
    Ginv: torch.Tensor, rows: torch.Tensor, s: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop slot s (r,) of rows (r,) from G_AA⁻¹ in place.

    G⁻¹ ← G⁻¹ − G⁻¹[:, s] G⁻¹[s, :] / G⁻¹[s, s].

    Returns the removed column G⁻¹[:, s] (r, S) and pivot G⁻¹[s, s] (r,), as they were.
    """
    ar = torch.arange(rows.numel(), device=rows.device)
    col = Ginv[rows, :, s]  # (r, S)
    piv = col[ar, s]
    Ginv.index_put_((rows,), col[:, :, None] * (col / -piv[:, None])[:, None, :], accumulate=True)
    Ginv[rows, s] = 0.0  # exact zeros in the freed slot
    Ginv[rows, :, s] = 0.0
    return col, piv
