"""Paired tests over a handful of pre-training seeds: the test, its CI, Holm's correction and the
smallest effect the seeds can detect.

With 3-5 seeds per arm the unit of replication is the pre-training seed (not the fine-tuning
cell), so each comparison has n = number of seeds pairs. A Wilcoxon signed-rank test over n pairs
cannot reach p < 2 / 2**n two-sided (0.25 at n = 3, 0.0625 at n = 5), so below 6 pairs only the
paired t-test can reject at 0.05; it assumes the seed-to-seed differences are roughly normal.
The power of the paired t-test is the non-central t computation of Cohen (1988, ch. 2):
under a true mean difference delta with SD s of the differences, T = mean / (s / sqrt(n)) follows
a non-central t with n - 1 degrees of freedom and non-centrality delta * sqrt(n) / s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from mlsm.inputs import is_number

Alternative = Literal["greater", "less", "two-sided"]
Test = Literal["paired-t", "wilcoxon"]
TESTS = ("paired-t", "wilcoxon")
ALTERNATIVES = ("greater", "less", "two-sided")
WILCOXON_ARE = 3 / math.pi
"""Asymptotic relative efficiency of the signed-rank test to the t-test under normal data
(Hodges & Lehmann 1956): n signed-rank pairs are worth about 0.955 n t-test pairs."""


def p_text(p: Any) -> str:
    """A p-value for a table: 3 significant digits, so 8.2e-6 prints as 8.2e-06 and never as a
    0.0000 that reads as p = 0; '—' when missing."""
    return f"{p:.3g}" if is_number(p) and math.isfinite(p) else "—"


def too_few(n_pairs: float) -> str | None:
    """'n/a (1 pair)' for a paired p-value or interval with fewer than two pairs to stand on (one
    pair: Wilcoxon's p is 0.5 or 1 whatever the scores, the bootstrap interval NaN), so a table
    never prints such a p or "+nan"; None when there are enough."""
    n = int(n_pairs)
    return f"n/a ({n} pair{'' if n == 1 else 's'})" if n < 2 else None


def paired_p(a: Sequence[float], b: Sequence[float], test: Test,
             alternative: Alternative) -> float:
    """p of `test` on the pairs (a_i, b_i), alternative about a - b (greater: a > b). NaN with
    fewer than 2 pairs, or a t-test whose differences are all equal (no variance)."""
    from scipy.stats import ttest_rel, wilcoxon

    x, y = np.asarray(a, float), np.asarray(b, float)
    if len(x) < 2:
        return math.nan
    if test == "paired-t":
        return float(ttest_rel(x, y, alternative=alternative).pvalue)
    d = x - y
    if not np.any(d):
        return 1.0
    return float(wilcoxon(d, alternative=alternative, method="exact"
                          if np.all(d != 0) else "auto").pvalue)


def mean_ci(d: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): the two-sided t interval of the mean of the differences `d`."""
    from scipy.stats import t

    x = np.asarray(d, float)
    n = len(x)
    if n == 0:
        return math.nan, math.nan, math.nan
    m = float(x.mean())
    if n < 2:
        return m, math.nan, math.nan
    half = float(t.ppf(0.5 + level / 2, n - 1) * x.std(ddof=1) / math.sqrt(n))
    return m, m - half, m + half


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's (1979) step-down adjusted p-values: the k-th smallest p times (m - k + 1), made
    monotone and capped at 1. A NaN p (an untested hypothesis) still counts in m (the family is
    what was registered) and stays NaN."""
    p = np.asarray(pvalues, float)
    m = len(p)
    order = np.argsort(np.where(np.isnan(p), np.inf, p), kind="stable")
    adjusted = np.full(m, math.nan)
    running = 0.0
    for rank, i in enumerate(order):
        if math.isnan(p[i]):
            continue
        running = max(running, min(1.0, (m - rank) * p[i]))
        adjusted[i] = running
    return adjusted.tolist()


def t_power(effect: float, n: float, alpha: float, alternative: Alternative) -> float:
    """Power of a paired t-test over n pairs at standardised effect dz = mean / SD of the
    differences (sign matters for one-sided alternatives)."""
    from scipy.stats import nct, t

    df, nc = n - 1, effect * math.sqrt(n)
    if alternative == "two-sided":
        crit = t.ppf(1 - alpha / 2, df)
        far = nct.cdf(-crit, df, nc)  # NaN where SciPy underflows at a large nc: it is ~0 there
        return float(nct.sf(crit, df, nc) + (0.0 if math.isnan(far) else far))
    crit = t.ppf(1 - alpha, df)
    return float(nct.sf(crit, df, nc) if alternative == "greater" else nct.cdf(-crit, df, nc))


def detectable_dz(n: float, alpha: float, alternative: Alternative = "two-sided",
                  power: float = 0.8) -> float:
    """Smallest standardised effect |dz| a paired t-test over n pairs detects with `power` at
    level alpha (solved on `t_power`; "less" is the mirror of "greater"). inf when n < 2."""
    from scipy.optimize import brentq

    if n < 2:
        return math.inf
    side: Alternative = "two-sided" if alternative == "two-sided" else "greater"
    return float(brentq(lambda e: t_power(e, n, alpha, side) - power, 1e-6, 50.0))


def min_detectable_effect(sd: float, n: int, alpha: float, test: Test,
                          alternative: Alternative, power: float = 0.8) -> float:
    """Smallest true mean difference detected with `power` by `test` over n pairs whose
    differences have SD `sd` (the measured seed-to-seed SD). Wilcoxon: inf when no arrangement of
    n pairs reaches alpha (smallest p: 2**-n one-sided, twice that two-sided), else the t-test's
    at n x 3/pi pairs (its asymptotic relative efficiency; an approximation at small n)."""
    if not (sd >= 0) or n < 2:
        return math.inf
    if test == "wilcoxon":
        smallest = 0.5 ** n * (2 if alternative == "two-sided" else 1)
        if smallest > alpha:
            return math.inf
        return sd * detectable_dz(n * WILCOXON_ARE, alpha, alternative, power)
    return sd * detectable_dz(n, alpha, alternative, power)
