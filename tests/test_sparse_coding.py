"""Non-negative LASSO: parity with scikit-learn and SPAMS, KKT optimality, edge cases, errors."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.decomposition import sparse_encode as sk_sparse_encode

import mlsm.teacher.active_set_cpu as compiled
import mlsm.teacher.sparse_coding as sc
from mlsm.errors import UserError
from mlsm.teacher.active_set import WARM_MAX, active_set_batched
from mlsm.teacher.active_set_cpu import active_set_rows
from mlsm.teacher.homotopy import homotopy
from mlsm.teacher.slots import padded_gram
from mlsm.teacher.sparse_coding import (
    fista,
    kkt_violation,
    objective,
    sparse_encode,
    top_nnz,
)

LAM = 0.05
# The two implementations of the active-set method: compiled per row (what CPUs run) and
# batched in lock-step (what CUDA runs; here on CPU tensors).
SOLVERS = pytest.mark.parametrize("solver", [active_set_rows, active_set_batched],
                                  ids=["rows", "batched"])


def _problem(n: int = 120, d: int = 32, k: int = 128, seed: int = 0, dtype=torch.float64):
    """Unit-norm rows that are noisy non-negative mixtures of a few atoms (like teacher states)."""
    g = torch.Generator().manual_seed(seed)
    D = torch.randn(d, k, generator=g, dtype=dtype)
    D /= D.norm(dim=0, keepdim=True)
    mix = ((torch.rand(n, k, generator=g, dtype=dtype) < 0.05)
           * torch.rand(n, k, generator=g, dtype=dtype))
    X = mix @ D.T + 0.2 * torch.randn(n, d, generator=g, dtype=dtype)
    return X / X.norm(dim=1, keepdim=True), D


def _codes(idx, alpha, k):
    """Dense (n, k) codes from a solver's slots (idx = k marks an empty slot)."""
    return torch.zeros(idx.shape[0], k + 1, dtype=alpha.dtype).scatter_(1, idx, alpha)[:, :k]


def _rel_gap(X, D, ours, ref):
    o, r = objective(X, D, ours, LAM), objective(X, D, ref, LAM)
    return ((o - r) / r).double()


def _sklearn_codes(X, D):
    # Lasso (lasso_cd) minimises 1/(2 d)‖x − Dα‖² + a‖α‖₁; sparse_encode passes a = alpha / d,
    # so alpha = λ is our problem exactly.
    ref = sk_sparse_encode(X.numpy(), D.T.numpy(), algorithm="lasso_cd", alpha=LAM, positive=True,
                           max_iter=50_000)
    return torch.from_numpy(ref)


def test_matches_sklearn_lasso_cd():
    X, D = _problem()
    ours = sparse_encode(X, D, LAM)
    gap = _rel_gap(X, D, ours, _sklearn_codes(X, D))
    assert gap.abs().mean() <= 1e-6 and gap.abs().max() <= 1e-5
    assert (ours >= 0).all()
    assert 0 < (ours > 0).sum(1).float().mean() < D.shape[1] / 4  # a genuinely sparse problem


def test_matches_spams_lasso():
    # SPAMS' solution of a fixed problem, shipped as a fixture (tests/fixtures/make_spams_lasso.py
    # regenerates it where SPAMS is installed): the test runs everywhere
    from safetensors.torch import load_file

    fixture = load_file(Path(__file__).with_name("fixtures") / "spams_lasso.safetensors")
    X, D, ref = fixture["X"], fixture["D"], fixture["codes"]
    ours = sparse_encode(X, D, LAM)
    gap = _rel_gap(X, D, ours, ref)
    assert gap.mean() <= 1e-4 and gap.max() <= 1e-3
    # Same problem, same unique solution (generic D): supports agree almost everywhere.
    assert ((ours > 1e-6) == (ref > 1e-6)).float().mean() > 0.99
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kkt_holds(dtype):
    X, D = _problem(seed=2, dtype=dtype)
    codes = sparse_encode(X, D, LAM, tol=1e-5)
    assert kkt_violation(X, D, codes, LAM).max() <= 1e-4
    assert codes.dtype == dtype


def test_coherent_data_dictionary_with_duplicates():
    # Atoms drawn from the data (as dictionary learning starts), some of them exact duplicates:
    # paths with many near-ties, atoms leaving the active set, and singular G_AA candidates.
    X, _ = _problem(n=150, seed=8)
    g = torch.Generator().manual_seed(8)
    D = X[torch.randint(0, X.shape[0], (96,), generator=g)].T.contiguous()  # repeats likely
    D = torch.cat([D, D[:, :8]], 1)  # and certainly
    codes = sparse_encode(X, D, LAM)
    assert kkt_violation(X, D, codes, LAM).max() <= 1e-4
    gap = _rel_gap(X, D, codes, _sklearn_codes(X, D))
    assert gap.abs().max() <= 1e-5


def test_homotopy_alone_is_exact_and_reports_the_step_cap():
    X, D = _problem(seed=9)
    c, Gp = X @ D, padded_gram(D.T @ D)
    idx, alpha, fail = homotopy(c, Gp, LAM, max_steps=10_000)
    k = D.shape[1]
    codes = _codes(idx, alpha, k)
    assert not fail.any()
    assert kkt_violation(X, D, codes, LAM).max() <= 1e-8  # float64: exact to rounding
    # A row needs at least nnz steps (nnz − 1 entries, then μ reaches λ): with a cap at the
    # median, the longer paths are flagged and some short ones finish.
    nnz = (codes > 0).sum(1)
    cap = int(nnz.median())
    _, _, fail_cap = homotopy(c, Gp, LAM, max_steps=cap)
    assert fail_cap[nnz > cap].all() and fail_cap.any() and not fail_cap.all()


@SOLVERS
def test_active_set_alone_matches_sklearn_and_reports_the_step_cap(solver):
    X, D = _problem(n=60, seed=10)
    c, Gp = X @ D, padded_gram(D.T @ D)
    k = D.shape[1]
    idx, alpha, fail = solver(c, Gp, LAM, tol=1e-9, max_steps=1000)
    codes = _codes(idx, alpha, k)
    assert not fail.any()
    assert kkt_violation(X, D, codes, LAM).max() <= 1e-8
    assert _rel_gap(X, D, codes, _sklearn_codes(X, D)).abs().max() <= 1e-6
    _, _, fail1 = solver(c, Gp, LAM, tol=1e-9, max_steps=1)  # one step cannot finish a row
    assert fail1.all()


def test_rows_the_active_set_fails_are_solved_by_the_homotopy(monkeypatch):
    X, D = _problem(seed=11)
    ref = sparse_encode(X, D, LAM)
    real = sc.active_set
    _, _, crippled_fail = real(X @ D, padded_gram(D.T @ D), LAM, 1e-5, max_steps=2)
    assert crippled_fail.float().mean() > 0.5  # the injected fault really hands rows over
    monkeypatch.setattr(sc, "active_set", lambda c, Gp, lam, tol, max_steps, warm=None:
                        real(c, Gp, lam, tol, max_steps=2))
    codes = sparse_encode(X, D, LAM)
    assert kkt_violation(X, D, codes, LAM).max() <= 1e-4
    assert _rel_gap(X, D, codes, ref).abs().max() <= 1e-6


def _support(codes: torch.Tensor) -> torch.Tensor:
    vals, atoms = codes.topk(int((codes > 0).sum(1).max()), dim=1)
    return torch.where(vals > 0, atoms, -1)


@SOLVERS
def test_warm_start_only_saves_steps(solver):
    X, D = _problem(seed=12)
    k = D.shape[1]
    cold = sparse_encode(X, D, LAM)
    # From the exact supports nearly every row is done after the first step (not all: atoms
    # in the span of the ones before them in the guess are left out), from scratch none.
    c, Gp = X @ D, padded_gram(D.T @ D)
    idx, alpha, _ = solver(c, Gp, LAM, tol=1e-9, max_steps=1000)
    exact = _support(_codes(idx, alpha, k))
    fits = (alpha > 0).sum(1) <= WARM_MAX  # only the first WARM_MAX atoms of a guess are used
    assert fits.sum() >= 20
    counts = solver(c, Gp, LAM, tol=1e-9, max_steps=1, warm=exact[:, :WARM_MAX])[2]
    assert counts[fits].float().mean() < 0.05
    assert solver(c, Gp, LAM, tol=1e-9, max_steps=1)[2].all()
    # Realistic guesses (codes under a perturbed dictionary) and bad ones: random atoms with
    # repeats, "none" markers, out-of-range values, more than WARM_MAX columns.
    g = torch.Generator().manual_seed(12)
    D2 = D + 0.05 * torch.randn(D.shape, generator=g, dtype=D.dtype)
    junk = torch.randint(-2, k + 3, (X.shape[0], 40), generator=g)
    junk[:, 1] = junk[:, 0]
    for warm in (_support(sparse_encode(X, D2 / D2.norm(dim=0), LAM)), junk):
        codes = sparse_encode(X, D, LAM, warm_start=warm, batch_size=50)
        assert kkt_violation(X, D, codes, LAM).max() <= 1e-5
        assert _rel_gap(X, D, codes, cold).abs().max() <= 1e-8


def test_warm_start_on_duplicate_atoms():
    # Both copies of duplicated atoms in the guess: the second must be left out of G_AA.
    X, D = _problem(n=80, seed=13)
    D = torch.cat([D, D[:, :20]], 1)
    k0 = D.shape[1] - 20
    cold = sparse_encode(X, D, LAM)
    warm = _support(cold)
    twins = torch.where((warm >= 0) & (warm < 20), warm + k0, -1)  # the copy of each support atom
    codes = sparse_encode(X, D, LAM, warm_start=torch.cat([warm, twins], 1))
    assert kkt_violation(X, D, codes, LAM).max() <= 1e-5
    assert _rel_gap(X, D, codes, cold).abs().max() <= 1e-8


def test_internal_kkt_check_matches_kkt_violation():
    # The solvers' outputs are checked from their slots (support rows of G only); that must be
    # the public definition, also for slots holding a zero coefficient and for empty slots.
    X, D = _problem(n=40, seed=14)
    k = D.shape[1]
    dense = sparse_encode(X, D, LAM)
    exact = top_nnz(dense)
    idle = (dense == 0).int().argmax(1, keepdim=True)  # an atom off every support
    idx = torch.cat([torch.where(exact.values > 0, exact.indices, k), idle,
                     torch.full_like(idle, k)], 1)
    alpha = torch.cat([exact.values, torch.zeros(40, 2, dtype=X.dtype)], 1)
    alpha[:5, 0] = 0.0  # a support atom loses its coefficient but keeps its slot: now violating
    fail = torch.zeros(40, dtype=torch.bool)
    fail[7] = True
    codes, viol = sc._checked((idx, alpha, fail), X @ D, padded_gram(D.T @ D), LAM)
    ref = kkt_violation(X, D, codes, LAM)
    torch.testing.assert_close(viol[~fail], ref[~fail])
    assert viol[7] == float("inf")
    assert (ref[:5] > 1e-3).all() and (ref[5:] < 1e-4).all()


def test_degenerate_dictionary():
    # Duplicate and zero atoms make G singular; zero rows have the zero code.
    X, D = _problem(n=60, seed=4)
    D = torch.cat([D, D[:, :10], torch.zeros(D.shape[0], 3, dtype=D.dtype)], 1)
    X[0] = 0
    codes = sparse_encode(X, D, LAM)
    assert kkt_violation(X, D, codes, LAM).max() <= 1e-4
    assert codes[0].abs().sum() == 0 and codes[:, -3:].abs().sum() == 0


def test_fista_is_the_inexact_reference():
    X, D = _problem(seed=5)
    exact = sparse_encode(X, D, LAM)
    f100 = fista(X, D, LAM, n_iter=100)
    f5000 = fista(X, D, LAM, n_iter=5000)
    assert (_rel_gap(X, D, f100, exact) >= -1e-9).all()  # ours is never worse than FISTA
    assert _rel_gap(X, D, f5000, exact).abs().max() <= 1e-6  # FISTA converges to our solution


def test_batches_and_gram_do_not_change_result():
    X, D = _problem(seed=6)
    a = sparse_encode(X, D, LAM)
    b = sparse_encode(X, D, LAM, gram=D.T @ D, batch_size=7)
    torch.testing.assert_close(a, b)
    assert sparse_encode(X[:0], D, LAM).shape == (0, D.shape[1])


def test_top_nnz_round_trip():
    X, D = _problem(seed=7)
    codes = sparse_encode(X, D, LAM)
    compact = top_nnz(codes)
    assert compact.indices.shape[1] == int((codes > 0).sum(1).max())
    back = codes.new_zeros(codes.shape).scatter_add_(1, compact.indices, compact.values)
    torch.testing.assert_close(back, codes)
    assert (compact.values[:, :-1] >= compact.values[:, 1:]).all()  # sorted by value
    short = top_nnz(codes, 2)
    assert short.values.shape == (X.shape[0], 2)
    torch.testing.assert_close(short.values, compact.values[:, :2])


@pytest.mark.parametrize(
    ("X", "D", "lam", "match"),
    [
        (torch.ones(2, 3), torch.ones(4, 5), LAM, "dimension"),
        (torch.ones(2, 3), torch.ones(3, 0), LAM, "k >= 1"),
        (torch.ones(2, 3), torch.ones(3, 5), 0.0, "lambda"),
        (torch.tensor([[1.0, float("nan"), 0.0]]), torch.ones(3, 5), LAM, "NaN"),
    ],
)
def test_bad_input(X, D, lam, match):
    with pytest.raises(UserError, match=match):
        sparse_encode(X, D, lam)


def test_bad_warm_start():
    X, D = _problem(n=10)
    for warm in (torch.zeros(10, 3), torch.zeros(9, 3, dtype=torch.long),
                 torch.zeros(10, dtype=torch.long)):
        with pytest.raises(UserError, match="warm_start"):
            sparse_encode(X, D, LAM, warm_start=warm)


def _dense(sol, k):
    idx, alpha, fail = sol
    assert not fail.any()
    return _codes(idx, alpha, k)


@pytest.mark.parametrize("coherent", [False, True])
def test_compiled_rows_and_batched_loop_agree(coherent):
    # Same method, two implementations: on a generic and on a coherent dictionary with exact
    # duplicates (degenerate candidates, atoms leaving), both reach the same unique codes.
    X, D = _problem(n=150, seed=16)
    if coherent:
        D = torch.cat([X[:96].T, X[:8].T], 1)
    c, Gp, k = X @ D, padded_gram(D.T @ D), D.shape[1]
    rows = _dense(active_set_rows(c, Gp, LAM, 1e-9, 1000), k)
    batched = _dense(active_set_batched(c, Gp, LAM, 1e-9, 1000), k)
    assert kkt_violation(X, D, rows, LAM).max() <= 1e-8
    assert _rel_gap(X, D, rows, batched).abs().max() <= 1e-10


def test_rows_needing_more_slots_run_again(monkeypatch):
    X, D = _problem(seed=17)
    c, Gp, k = X @ D, padded_gram(D.T @ D), D.shape[1]
    ref = _dense(active_set_rows(c, Gp, LAM, 1e-9, 1000), k)
    assert ((ref > 0).sum(1) > 3).float().mean() > 0.5  # most rows overflow 3 slots below
    monkeypatch.setattr(compiled, "SLOTS", 3)
    torch.testing.assert_close(_dense(active_set_rows(c, Gp, LAM, 1e-9, 1000), k), ref, rtol=0,
                               atol=1e-12)


def test_codes_do_not_depend_on_the_thread_count():
    # Every row is solved by one thread alone: the split over threads must not show in the codes.
    X, D = _problem(n=101, seed=18, dtype=torch.float32)
    # computed once: a GEMM may round differently per thread count
    c, Gp = X @ D, padded_gram(D.T @ D)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = active_set_rows(c, Gp, LAM, 1e-5, 1000)
        torch.set_num_threads(2)
        two = active_set_rows(c, Gp, LAM, 1e-5, 1000)
    finally:
        torch.set_num_threads(before)
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a, b)


def _encode_numpy(X, D):
    # as a DataLoader worker does: torch's own OpenMP pool does not survive fork(), so PyTorch
    # runs workers on one thread; what this test guards is that our kernel adds no such pool
    torch.set_num_threads(1)
    return sparse_encode(X, D, LAM).numpy()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")
def test_a_forked_child_can_encode_after_the_parent():
    # DataLoader workers are forked: the CPU kernel's threads must not break a later fork()
    # (an OpenMP thread pool, e.g. numba's prange on GNU OpenMP, kills such a child).
    X, D = _problem(n=64, seed=19, dtype=torch.float32)
    ref = sparse_encode(X, D, LAM)  # the parent runs the kernel (and its threads) first
    with mp.get_context("fork").Pool(1) as pool:
        child = pool.apply_async(_encode_numpy, (X, D)).get(timeout=120)
    assert np.array_equal(child, ref.numpy())
