"""What learning a dictionary will cost on this machine, said before the work starts.

The defaults are paper scale (2,000,000 teacher states): hours on a laptop CPU, minutes on a GPU.
Rather than a formula whose constants would be wrong on the next machine, the cost is measured:
the teacher runs on a small sample of the store (after a warm-up batch) and the online learner
runs one update and then four, whose difference is the cost of an update without the start-up;
the whole is extrapolated linearly (the teacher is linear in the states collected, the learner in
its mini-batches).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from mlsm.progress import format_duration
from mlsm.teacher.dictionary_config import DictionaryConfig
from mlsm.teacher.online_dictionary import learn_atoms
from mlsm.teacher.states import collect_vectors
from mlsm.teacher.teacher import Teacher

WORTH_MEASURING = 100_000
"""Below this many states the work takes minutes at most: no measurement, no line."""


@dataclass(frozen=True)
class Rates:
    """Measured seconds per teacher state, per update of the online learner, and the learner's
    start-up (its initial atoms)."""

    per_state: float
    per_update: float
    start_up: float = 0.0


def measure_rates(store: Any, teacher: Teacher, c: DictionaryConfig) -> Rates:
    """Time the teacher on a sample of the store and the learner on it (see the module doc)."""
    k = c.k or 4 * teacher.hidden_size
    n = max(2 * c.batch_size, k)  # the learner starts from k of the sample's vectors
    collect_vectors(teacher, store, 32, max_len=c.max_len, seed=c.seed, sampling=c.sampling)
    start = time.perf_counter()
    X = collect_vectors(teacher, store, n, max_len=c.max_len, seed=c.seed, sampling=c.sampling)
    per_state = (time.perf_counter() - start) / n
    X = X.to(teacher.device)
    took = []
    for updates in (1, 1, 4):  # the first warms the thread pools up, untimed
        start = time.perf_counter()
        learn_atoms(X, k, c.lam, n_iter=updates, batch_size=c.batch_size, seed=c.seed,
                    progress=False)
        took.append(time.perf_counter() - start)
    # a busy machine can make the difference of two timings near zero: an update costs at least
    # half of its share of the 4-update run
    per_update = max((took[2] - took[1]) / 3, took[2] / 8)
    return Rates(per_state, per_update, max(0.0, took[1] - per_update))


def estimate_seconds(rates: Rates, c: DictionaryConfig) -> float:
    """Seconds for `c`: its states through the teacher, then its updates of the learner."""
    updates = c.n_iter or math.ceil(c.n_vectors / c.batch_size)
    return rates.per_state * c.n_vectors + rates.start_up + rates.per_update * updates


def cost_line(rates: Rates, c: DictionaryConfig, device: str, n_vectors_given: bool) -> str:
    """The line `mlsm dictionary` prints before it starts."""
    seconds = estimate_seconds(rates, c)
    line = (f"mlsm dictionary: about {format_duration(seconds)} on this {device.upper()} for "
            f"{c.n_vectors:,} teacher states"
            + ("" if n_vectors_given else " (the paper-scale default of --n-vectors)")
            + f" and {c.n_iter or math.ceil(c.n_vectors / c.batch_size):,} learner updates "
            f"(measured on a sample of this store)")
    if seconds > 600 and not n_vectors_given:
        line += "; a first try: --n-vectors 100000 (a study's default is 200000)"
    return line


def announce(store: Any, teacher: Teacher, c: DictionaryConfig, device: str,
             n_vectors_given: bool) -> str | None:
    """The cost line for a learned dictionary of at least `WORTH_MEASURING` states on a CPU (a
    GPU takes minutes), or on any device when --n-vectors was left at its paper-scale default;
    None when there is nothing worth saying."""
    big = c.atoms == "learned" and c.n_vectors >= WORTH_MEASURING
    if not big or (device != "cpu" and n_vectors_given):
        return None
    return cost_line(measure_rates(store, teacher, c), c, device.split(":")[0], n_vectors_given)
