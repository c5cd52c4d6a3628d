"""Masking statistics and determinism (properties of mlsm.data.masking)."""

from __future__ import annotations

import numpy as np
import pytest

from mlsm.data import masking


def _special(b: int, t: int) -> np.ndarray:
    special = np.zeros((b, t), dtype=bool)
    special[:, 0] = special[:, -1] = True
    special[:, t // 2] = True  # an inner document separator
    return special


@pytest.mark.parametrize("rate", [0.15, 0.3, 0.5])
def test_selection_rate_and_specials(rate: float) -> None:
    special = _special(512, 128)
    sel = masking.select_positions(7, np.arange(512), special, rate, exact_count=False)
    assert not sel[special].any()
    observed = sel.sum() / (~special).sum()
    # 62k Bernoulli draws: 5 standard deviations is < 0.01
    assert abs(observed - rate) < 5 * np.sqrt(rate * (1 - rate) / (~special).sum())


@pytest.mark.parametrize("rate", [0.15, 0.4])
def test_exact_count_is_constant(rate: float) -> None:
    special = _special(64, 128)
    sel = masking.select_positions(3, np.arange(64), special, rate, exact_count=True)
    counts = sel.sum(1)
    # the official MLSM code's count: int(num_tokens * rate) of the 128 tokens of a full row
    assert (counts == int(np.floor(rate * 128))).all()
    assert not sel[special].any()


def test_selection_depends_only_on_seed_and_sample() -> None:
    special = _special(16, 64)
    samples = np.arange(100, 116)
    a = masking.select_positions(1, samples, special, 0.15, False)
    # the same samples in another order and split: same rows
    b = masking.select_positions(1, samples[::-1], special, 0.15, False)[::-1]
    assert np.array_equal(a, b)
    assert np.array_equal(a[:4], masking.select_positions(1, samples[:4], special[:4], 0.15, False))
    c = masking.select_positions(2, samples, special, 0.15, False)
    assert not np.array_equal(a, c)


@pytest.mark.parametrize("split", [(0.8, 0.1, 0.1), (1.0, 0.0, 0.0), (0.5, 0.25, 0.25)])
def test_corruption_split(split: tuple[float, float, float]) -> None:
    rng = np.random.default_rng(0)
    ids = rng.integers(10, 1000, size=(400, 128))
    special = _special(400, 128)
    samples = np.arange(400)
    sel = masking.select_positions(5, samples, special, 0.3, False)
    normal = np.arange(10, 1000)
    out = masking.corrupt(5, samples, ids, sel, split, mask_id=3, normal_ids=normal)
    assert np.array_equal(out[~sel], ids[~sel])  # only selected positions change
    n = sel.sum()
    masked = (out[sel] == 3).mean()
    changed = ((out[sel] != 3) & (out[sel] != ids[sel])).mean()
    kept = (out[sel] == ids[sel]).mean()
    tol = 5 * np.sqrt(0.25 / n)
    assert abs(masked - split[0]) < tol
    # a random replacement equals the original with probability 1/990: counted as kept
    assert abs(changed - split[1] * (1 - 1 / 990)) < tol
    assert abs(kept - split[2] - split[1] / 990) < tol
    assert set(np.unique(out[sel & (out != 3)])) <= set(normal.tolist())


def test_uniform_draws_look_uniform() -> None:
    u = masking.uniform(0, 1, np.arange(200), 256).ravel()
    hist, _ = np.histogram(u, bins=10, range=(0, 1))
    expected = len(u) / 10
    chi2 = ((hist - expected) ** 2 / expected).sum()
    assert chi2 < 30  # 9 dof: p ~ 4e-4
    assert u.min() >= 0 and u.max() < 1
