"""Selection of positions to predict and their corruption, as pure functions of (seed, sample).

Randomness comes from a counter-based hash (SplitMix64 finaliser) of (seed, stream, global sample
index, position) rather than from a stateful generator. The draws for a sequence therefore do not
depend on which batch, rank or accumulation step it lands in, nor on what ran before: two runs
with the same data seed select the same positions whatever their objective, resuming needs no
replay, and DDP with any number of ranks sees the same masks as one process.
"""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)

# Independent streams of draws for one position.
STREAM_SELECT, STREAM_CORRUPT, STREAM_RANDOM_ID = 1, 2, 3


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser (Steele et al. 2014): a bijective avalanche on uint64."""
    with np.errstate(over="ignore"):
        x = x + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def uniform(seed: int, stream: int, samples: np.ndarray, length: int) -> np.ndarray:
    """Uniform [0, 1) draws of shape (len(samples), length), one per (sample, position)."""
    base = _mix(np.uint64(seed) * np.uint64(1000003) + np.uint64(stream) + np.zeros(1, np.uint64))
    keys = _mix(base ^ samples.astype(np.uint64))  # (B,)
    pos = np.arange(length, dtype=np.uint64) * _GOLDEN  # (T,)
    bits = _mix(keys[:, None] ^ pos[None, :])  # (B, T)
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def select_positions(
    seed: int, samples: np.ndarray, special: np.ndarray, rate: float, exact_count: bool
) -> np.ndarray:
    """Bool (B, T): positions chosen for prediction; special (incl. padding) never chosen.

    Bernoulli(rate) per eligible position (BERT's sampling; also the official MLSM code's current
    ``pretrainer.py``: ``rand < learning_fraction`` on non-special tokens), or, with exact_count,
    the ⌊rate · T⌋ eligible positions with the smallest draws (T = row length, special tokens
    included; rows are packed, so every row has T tokens): the count of the official repository's
    2023 ``mlsm_pretrainer.py``, since deleted (``int(num_tokens * .15)`` positions among the
    non-[CLS]/[SEP] tokens), the same in every row.
    """
    if not 0.0 < rate < 1.0:
        raise ValueError(f"mask rate must be in (0, 1), got {rate}")
    u = uniform(seed, STREAM_SELECT, samples, special.shape[1])
    u[special] = np.inf
    if not exact_count:
        return u < rate
    k = max(1, int(np.floor(rate * special.shape[1] + 1e-9)))  # + eps: 0.15 * 100 must give 15
    k = min(k, int((~special).sum(1).min()))
    idx = np.argpartition(u, k - 1, axis=1)[:, :k]  # (B, k): the k smallest draws
    chosen = np.zeros_like(special)
    np.put_along_axis(chosen, idx, True, axis=1)
    return chosen


def corrupt(
    seed: int,
    samples: np.ndarray,
    ids: np.ndarray,
    selected: np.ndarray,
    split: tuple[float, float, float],
    mask_id: int,
    normal_ids: np.ndarray,
) -> np.ndarray:
    """Copy of ids (B, T) with the selected positions replaced as BERT does (Devlin et al. 2019):
    split[0] of them by [MASK], split[1] by a random non-special token, split[2] left unchanged."""
    p_mask, p_random, _ = split
    u = uniform(seed, STREAM_CORRUPT, samples, ids.shape[1])
    r = uniform(seed, STREAM_RANDOM_ID, samples, ids.shape[1])
    out = ids.copy()
    to_mask = selected & (u < p_mask)
    to_random = selected & (u >= p_mask) & (u < p_mask + p_random)
    out[to_mask] = mask_id
    random_ids = normal_ids[np.minimum((r * len(normal_ids)).astype(np.int64), len(normal_ids) - 1)]
    out[to_random] = random_ids[to_random]
    return out
