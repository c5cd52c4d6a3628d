"""The fixed-shape solver (what CUDA runs, `active_set_fixed`): its operator sequence does not grow
with the number of rows, it never reads a value on the host, and it gives the codes of the
compiled CPU kernel (the reference) on synthetic and on real all-MiniLM-L6-v2 states.

Counted on CPU tensors with torch.profiler: every aten operator is a kernel launch on a GPU (or a
view), and `_local_scalar_dense` / `item` / `nonzero` / `masked_select` are device→host
synchronisations (`.item()`, `bool(t)`, boolean-mask indexing, linalg error checks)."""

from __future__ import annotations

import gzip
import json
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import mlsm.teacher.sparse_coding as sc
from mlsm.teacher.active_set_cpu import active_set_rows
from mlsm.teacher.active_set_fixed import FIXED_STEPS, active_set_fixed
from mlsm.teacher.slots import padded_gram
from mlsm.teacher.sparse_coding import kkt_violation

from .helpers import SHARED

LAM = 0.05
SYNC_OPS = ("aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::masked_select",
            "aten::_unique2", "aten::is_nonzero")
VIEWS = ("aten::unsqueeze", "aten::reshape", "aten::select", "aten::slice", "aten::expand",
         "aten::mT", "aten::view", "aten::transpose", "aten::as_strided")  # no kernel on a GPU
CORPUS = SHARED / "corpus" / "enwiki_2015_prefix"


def _problem(n: int, d: int = 24, k: int = 96, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit rows that are noisy non-negative mixtures of a few unit atoms (like teacher states)."""
    g = torch.Generator().manual_seed(seed)
    D = torch.randn(d, k, generator=g)
    D /= D.norm(dim=0, keepdim=True)
    mix = (torch.rand(n, k, generator=g) < 0.05) * torch.rand(n, k, generator=g)
    X = mix @ D.T + 0.2 * torch.randn(n, d, generator=g)
    return X / X.norm(dim=1, keepdim=True), D


def _dense(sol: tuple[torch.Tensor, ...], k: int) -> torch.Tensor:
    idx, alpha, _ = sol
    return torch.zeros(idx.shape[0], k + 1, dtype=alpha.dtype).scatter_(1, idx, alpha)[:, :k]


def _profiled(n: int) -> tuple[list[str], list[str]]:
    """Top-level operators and host syncs of one solver call on n rows."""
    X, D = _problem(n)
    c, Gp = X @ D, padded_gram(D=D)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        active_set_fixed(c, Gp, LAM, 1e-6, slots=24)  # d = 24: no code has more atoms
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    # the operators the solver issues (nested ones are the CPU kernels' own business)
    top = [e.name for e in events
           if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    return top, [e.name for e in events if e.name in SYNC_OPS]


def test_launches_do_not_grow_with_rows_and_the_loop_never_syncs() -> None:
    small, syncs_small = _profiled(256)
    large, syncs_large = _profiled(1024)
    assert Counter(small) == Counter(large)  # the same operators, whatever the row count
    assert syncs_small == syncs_large == []  # no host synchronisation, nested ones included
    assert sum(name not in VIEWS for name in small) <= 300  # kernel launches per call


def _profiled_call(n: int, monkeypatch: pytest.MonkeyPatch) -> tuple[list, list]:
    """Top-level operators and host syncs (profiler events) of one `encode_with_gram` call on n
    rows run by the fixed-shape solver, as on CUDA (benchmarks/bench_gpu_proxy.py's "after")."""
    monkeypatch.setattr(sc, "active_set", lambda c, Gp, lam, tol, max_steps, warm=None:
                        active_set_fixed(c, Gp, lam, tol, warm=warm))
    X, D = _problem(n, d=64, k=256, seed=0)  # codes the fixed steps finish: no fallback row
    Gp = padded_gram(D=D)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        sc.encode_with_gram(X, D, Gp, LAM)
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    top = [e for e in events if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    return top, [e for e in events if e.name in SYNC_OPS]


def test_a_whole_coding_call_issues_at_most_300_operators_and_syncs_once_after_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The issue's count: every operator the call issues (solver, KKT check, fallback pick), the
    # view operators (no kernel on a GPU) included
    (small, _), (large, syncs) = _profiled_call(256, monkeypatch), _profiled_call(1024, monkeypatch)
    assert Counter(e.name for e in small) == Counter(e.name for e in large)
    # the one host sync is the caller's pick of rows for the fallback, after the solver's loop
    assert [e.name for e in syncs] == ["aten::nonzero"]
    loop_end = max(e.time_range.end for e in large if e.name == "aten::linalg_solve_triangular")
    assert syncs[0].time_range.start >= loop_end
    assert len(large) <= 300, Counter(e.name for e in large).most_common(8)


def test_matches_the_compiled_kernel_on_synthetic_rows() -> None:
    # codes of ≤ ~20 atoms in d = 64, as on MiniLM states (≤ 43 in d = 384); where codes use most
    # of the d dimensions the method may cycle (see the module doc and the fallback test below)
    X, D = _problem(300, d=64, k=256, seed=3)
    c, Gp, k = X @ D, padded_gram(D=D), D.shape[1]
    ref = _dense(active_set_rows(c, Gp, LAM, 1e-9, 1000, 8, None), k)
    ours = _dense(active_set_fixed(c, Gp, LAM, 1e-9), k)
    assert torch.equal(ours > 0, ref > 0)
    torch.testing.assert_close(ours.float(), ref.float(), rtol=1e-4, atol=1e-7)
    assert kkt_violation(X, D, ours.float(), LAM).max() <= 1e-5


def test_rows_it_cannot_finish_are_solved_by_the_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    # Codes using most of d = 32 (the method cycles on many rows), exact duplicate atoms (G_AA
    # singular) and 2 steps (no row finishes): the caller's KKT check must send those rows to
    # the homotopy, and the codes must still be exact.
    X, D = _problem(120, d=32, k=128, seed=4)
    D = torch.cat([D, D[:, :16]], 1)
    ref = sc.sparse_encode(X, D, LAM)  # CPU kernel
    for steps in (2, FIXED_STEPS):
        monkeypatch.setattr(sc, "active_set", lambda c, Gp, lam, tol, max_steps, warm=None, s=steps:
                            active_set_fixed(c, Gp, lam, tol, s, warm=warm))
        codes = sc.sparse_encode(X, D, LAM)
        assert kkt_violation(X, D, codes, LAM).max() <= 1e-5
        assert ((sc.objective(X, D, codes, LAM) - sc.objective(X, D, ref, LAM)).abs() <= 1e-6).all()


def _states(teacher, split: str, n_docs: int) -> torch.Tensor:
    """ℓ2-normalised layer-5 states (N, 384) of the first 128 tokens of n_docs documents."""
    with gzip.open(CORPUS / f"{split}.jsonl.gz", "rt", encoding="utf-8") as fh:
        docs = [json.loads(next(fh))["text"][:2000] for _ in range(n_docs)]
    enc = teacher.tokenizer(docs, truncation=True, max_length=128, padding=True,
                            return_tensors="pt")
    with torch.no_grad():
        h = teacher.hidden_states(enc["input_ids"], enc["attention_mask"])  # (B, T, d)
    return F.normalize(h[enc["attention_mask"].bool()].float(), dim=-1)


@pytest.mark.skipif(not CORPUS.is_dir(), reason="../shared/data/corpus is absent")
def test_same_codes_as_the_compiled_kernel_on_minilm_states() -> None:
    from mlsm.teacher.teacher import load_teacher

    teacher = load_teacher(None, 5)
    atoms = _states(teacher, "train", 16)  # ~2,000 states
    pick = torch.randperm(len(atoms), generator=torch.Generator().manual_seed(0))[:1536]
    D = atoms[pick].T.contiguous()  # (384, 1536): a real dictionary of the teacher's space
    X = _states(teacher, "valid", 3)[:256]
    c, Gp, k = X @ D, padded_gram(D=D), D.shape[1]
    # At a tight tolerance the optimum is unique: the same support, values to 1e-4 relative.
    ref = _dense(active_set_rows(c, Gp, LAM, 1e-7, 1000, 8, None), k)
    ours = _dense(active_set_fixed(c, Gp, LAM, 1e-7), k)
    assert (ref > 0).sum(1).float().mean() > 5  # real codes, not empty ones
    assert torch.equal(ours > 0, ref > 0)
    assert ((ours - ref).abs().amax(1) <= 1e-4 * ref.abs().amax(1)).all()
    # At the default tolerance every row is exact by the caller's own check (no fallback needed).
    _, viol = sc._checked(active_set_fixed(c, Gp, LAM, sc.TOL), c, Gp, LAM)
    assert (viol <= sc.TOL).all()


def test_warm_start_only_saves_steps() -> None:
    X, D = _problem(200, d=64, k=256, seed=5)
    c, Gp, k = X @ D, padded_gram(D=D), D.shape[1]
    ref = _dense(active_set_rows(c, Gp, LAM, 1e-9, 1000, 8, None), k)
    vals, atoms = ref.topk(int((ref > 0).sum(1).max()), dim=1)
    exact = torch.where(vals > 0, atoms, -1)  # the supports, largest first
    # from the exact supports one step finishes every row, from scratch none
    one = _dense(active_set_fixed(c, Gp, LAM, 1e-9, 1, warm=exact), k)
    assert torch.equal(one > 0, ref > 0)
    torch.testing.assert_close(one, ref, rtol=1e-4, atol=1e-6)
    assert (_dense(active_set_fixed(c, Gp, LAM, 1e-9, 1), k) > 0).sum(1).max() <= 16
    # bad guesses (repeats, "none" markers, out-of-range atoms) cost steps, not exactness
    g = torch.Generator().manual_seed(5)
    junk = torch.randint(-2, k + 3, (X.shape[0], 24), generator=g)
    junk[:, 1] = junk[:, 0]
    ours = _dense(active_set_fixed(c, Gp, LAM, 1e-9, warm=junk), k)
    assert torch.equal(ours > 0, ref > 0)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-7)
