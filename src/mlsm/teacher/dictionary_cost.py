"""What learning a dictionary will cost on this machine, said before the work starts.

The defaults are paper scale (2,000,000 teacher states): hours on a laptop CPU, minutes on a GPU.
Rather than a formula whose constants would be wrong on the next machine, the cost is measured:
the teacher runs on a small sample of the store and the online learner makes a few updates on it,
each timed, and the whole is extrapolated linearly (both stages are linear in their counts: the
teacher in the states collected, the learner in its mini-batches).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from mlsm.dictionary_config import DictionaryConfig
from mlsm.progress import format_duration
from mlsm.teacher.online_dictionary import learn_atoms
from mlsm.teacher.states import collect_vectors
from mlsm.teacher.teacher import Teacher

WORTH_MEASURING = 100_000
"""Below this many states the work takes minutes at most: no measurement, no line."""
SAMPLE_UPDATES = 2


@dataclass(frozen=True)
class Rates:
    """Measured seconds per teacher state and per update of the online learner."""

    per_state: float
    per_update: float


def measure_rates(store: Any, teacher: Teacher, c: DictionaryConfig) -> Rates:
    """Time the teacher on a sample of the store and `SAMPLE_UPDATES` updates of the learner."""
    k = c.k or 4 * teacher.hidden_size
    n = max(2 * c.batch_size, k)  # the learner starts from k of the sample's vectors
    start = time.perf_counter()
    X = collect_vectors(teacher, store, n, max_len=c.max_len, seed=c.seed, sampling=c.sampling)
    per_state = (time.perf_counter() - start) / n
    start = time.perf_counter()
    learn_atoms(X.to(teacher.device), k, c.lam, n_iter=SAMPLE_UPDATES, batch_size=c.batch_size,
                seed=c.seed, progress=False)
    return Rates(per_state, (time.perf_counter() - start) / SAMPLE_UPDATES)


def estimate_seconds(rates: Rates, c: DictionaryConfig) -> float:
    """Seconds for `c`: its states through the teacher, then its updates of the learner."""
    updates = c.n_iter or math.ceil(c.n_vectors / c.batch_size)
    return rates.per_state * c.n_vectors + rates.per_update * updates


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
