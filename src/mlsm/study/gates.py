"""Gates of a study's local subprocesses: how many run at once, and in which order they start.

`runner._chains` holds one gate for pre-training (`executor.jobs`), one for evaluation
(`executor.eval_jobs`) and one for both together (max of the two: the cores' share), and every
subprocess passes through its own gate and the shared one (`through`).
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator


class GateClosed(RuntimeError):
    """A gate was closed while a caller waited for it, or before it came."""


class FairGate:
    """At most `n` holders at once, let through in the order they came. A `threading.Semaphore`
    is not fair: a chain that releases it and asks again at once takes it back from the threads
    already waiting, so whichever chain got a slot first would keep it to its end while the
    others, the longest among them, waited. Arrival order is what
    benchmarks/schedule_projection.py replays (issue #50: v2's seed pair in 1.34 h)."""

    def __init__(self, n: int):
        self._free, self._queue, self._closed = n, collections.deque(), False
        self._cond = threading.Condition()

    def __enter__(self) -> FairGate:
        me = object()
        with self._cond:
            self._queue.append(me)
            self._cond.wait_for(lambda: self._closed or self._free > 0 and self._queue[0] is me)
            if self._closed:
                self._queue.remove(me)
                raise GateClosed("the study is stopping: no stage starts after the stop")
            self._queue.popleft()
            self._free -= 1
            self._cond.notify_all()  # the next in line may fit too
        return self

    def close(self) -> None:
        """Let no one through any more: every waiter, and every later caller, raises
        `GateClosed` (a stopping study starts no subprocess; the running ones end)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._free += 1
            self._cond.notify_all()


@contextlib.contextmanager
def through(*gates: contextlib.AbstractContextManager) -> Iterator[None]:
    """Hold every gate, taken in the order given (every caller takes them in one order, so no
    two wait on each other)."""
    with contextlib.ExitStack() as stack:
        for gate in gates:
            stack.enter_context(gate)
        yield
