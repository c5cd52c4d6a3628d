"""GPU-cost proxy of the batched solver (what CUDA runs): the operator sequence of one call does
not grow with the number of rows, and the loop never reads a value on the host.

Counted on CPU tensors with torch.profiler: every aten operator is a kernel launch on a GPU (or a
view), and `_local_scalar_dense` / `nonzero` / `masked_select` are device→host synchronisations
(`.item()`, `bool(t)`, boolean-mask indexing)."""

from __future__ import annotations

from collections import Counter

import torch

from mlsm.teacher.active_set import active_set_batched
from mlsm.teacher.slots import padded_gram
from mlsm.teacher.sparse_coding import kkt_violation

LAM = 0.05
SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique2", "aten::is_nonzero")


def _problem(n: int, d: int = 24, k: int = 96, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit rows that are noisy non-negative mixtures of a few unit atoms (like teacher states)."""
    g = torch.Generator().manual_seed(seed)
    D = torch.randn(d, k, generator=g)
    D /= D.norm(dim=0, keepdim=True)
    mix = (torch.rand(n, k, generator=g) < 0.05) * torch.rand(n, k, generator=g)
    X = mix @ D.T + 0.2 * torch.randn(n, d, generator=g)
    return X / X.norm(dim=1, keepdim=True), D


def _ops(n: int, steps: int) -> tuple[list[str], list[str], tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]:
    X, D = _problem(n)
    c, Gp = X @ D, padded_gram(D=D)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = active_set_batched(c, Gp, LAM, 1e-6, steps, slots=24)  # d = 24: no code has more atoms
    # the operators the solver issues (nested ones are the CPU kernels' own business)
    top = [e.name for e in prof.events() if e.name.startswith("aten::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    syncs = [e.name for e in prof.events() if e.name in SYNC_OPS]
    return top, syncs, out, X, D


def test_launches_do_not_grow_with_rows_and_the_loop_never_syncs() -> None:
    small, syncs_small, out_small, X, D = _ops(64, steps=24)
    large, syncs_large, *_ = _ops(256, steps=24)
    assert Counter(small) == Counter(large)  # the same operators, whatever the row count
    assert syncs_small == syncs_large == []  # no host synchronisation at all, nested ones included
    one, *_ = _ops(64, steps=1)
    two, *_ = _ops(64, steps=2)
    assert len(small) - len(one) == 23 * (len(two) - len(one))  # every step issues the same operators
    idx, alpha, fail = out_small
    assert fail.float().mean() < 0.05  # 24 steps finish (almost) every row of this problem
    codes = torch.zeros(idx.shape[0], D.shape[1] + 1, dtype=alpha.dtype).scatter_(1, idx, alpha)[:, :-1]
    assert kkt_violation(X.double(), D.double(), codes, LAM)[~fail].max() <= 1e-5  # finished rows are exact
