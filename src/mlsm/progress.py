"""Progress of long jobs, visible wherever their output goes.

On a terminal a tqdm bar; otherwise (output redirected to a file, a batch scheduler, CI) one plain
line on stderr every `interval` seconds (default 30, env MLSM_PROGRESS_SECONDS):

    pretrain: 120/1000 step (12.0%) 2.41 step/s ETA 6m05s loss=5.123

so a job is never silent for minutes, and a log file holds no carriage-return bar fragments.
Every long job (prepare, dictionary, targets, pretrain, probe, finetune, PLL/BLiMP, study) reports
through `Progress`.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import time
from collections.abc import Iterator
from typing import IO, Any

DEFAULT_SECONDS = 30.0
ENV = "MLSM_PROGRESS_SECONDS"
_OWNER: contextvars.ContextVar[str] = contextvars.ContextVar("mlsm_progress_owner", default="")


@contextlib.contextmanager
def owned_by(what: str) -> Iterator[None]:
    """Every `Progress` made inside names `what` first (`blimp:mlsm@100% PLL: 120/400 copy`):
    the library's bars know their task, not which model of a study they score. A context
    variable, so stages running at once in threads each name their own."""
    token = _OWNER.set(what)
    try:
        yield
    finally:
        _OWNER.reset(token)


def interval_seconds(value: float | None = None) -> float:
    """The interval between plain lines: `value`, else $MLSM_PROGRESS_SECONDS, else 30 s.

    A value <= 0 turns the plain lines off (the tqdm bar on a terminal is unaffected)."""
    if value is not None:
        return float(value)
    text = os.environ.get(ENV, "").strip()
    if not text:
        return DEFAULT_SECONDS
    try:
        return float(text)
    except ValueError:
        print(f"mlsm: ignoring {ENV}={text!r} (not a number of seconds); using {DEFAULT_SECONDS:g}",
              file=sys.stderr, flush=True)
        return DEFAULT_SECONDS


def format_duration(seconds: float) -> str:
    """1h02m, 6m05s or 42s."""
    s = max(0, round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def _value(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


class Progress:
    """A progress report: `update(n, loss=...)` as work is done, `close()` at the end.

    total: units of work (None when unknown, e.g. documents of a streamed corpus); initial: units
    already done (a resumed job); enabled: False shows nothing (e.g. non-zero DDP ranks), None
    decides by the stream; stream: default sys.stderr; interval: seconds between plain lines;
    leave: False removes the tqdm bar when done (an inner bar under an outer one).
    """

    def __init__(self, total: int | None, desc: str, unit: str = "it", *, initial: int = 0,
                 enabled: bool | None = None, stream: IO[str] | None = None,
                 interval: float | None = None, leave: bool = True) -> None:
        owner = _OWNER.get()
        desc = f"{owner} {desc}" if owner else desc
        self.total, self.desc, self.unit = total, desc, unit
        self.n = self.start_n = initial
        self.stream = stream if stream is not None else sys.stderr
        self.interval = interval_seconds(interval)
        self.postfix: dict[str, Any] = {}
        self.bar: Any = None
        self.lines = 0  # plain lines written
        self.n_line = initial  # the count the last plain line showed
        self.closed = False
        self.t0 = self.t_line = time.monotonic()
        self.enabled = enabled is not False
        if self.enabled and _is_tty(self.stream):
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, file=self.stream,
                            leave=leave)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def set_postfix(self, **values: Any) -> None:
        """Values shown after the counts, e.g. loss=2.31 (the last loss is what users look for)."""
        self.postfix.update(values)
        if self.bar is not None:
            self.bar.set_postfix({k: _value(v) for k, v in self.postfix.items()}, refresh=False)

    def update(self, n: int = 1, **postfix: Any) -> None:
        """Count n more units done; print a plain line if the interval has passed."""
        self.n += n
        if postfix:
            self.set_postfix(**postfix)
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled and self.interval > 0 and time.monotonic() - self.t_line >= self.interval:
            self._line()

    def line(self) -> str:
        """The plain progress line for the current state."""
        elapsed = max(time.monotonic() - self.t0, 1e-9)
        rate = (self.n - self.start_n) / elapsed
        count = f"{self.n}/{self.total} {self.unit}" if self.total else f"{self.n} {self.unit}"
        parts = [f"{self.desc}: {count}"]
        if self.total:
            parts.append(f"({100 * self.n / self.total:.1f}%)")
        slow = f"{1 / max(rate, 1e-9):.3g} s/{self.unit}"  # e.g. 42.1 s/step
        parts.append(f"{rate:.3g} {self.unit}/s" if rate >= 0.1 else slow)
        if self.total and rate > 0:
            parts.append(f"ETA {format_duration(max(0, self.total - self.n) / rate)}")
        parts.append(f"elapsed {format_duration(elapsed)}")
        parts += [f"{k}={_value(v)}" for k, v in self.postfix.items()]
        return " ".join(parts)

    def _line(self) -> None:
        print(self.line(), file=self.stream, flush=True)
        self.lines += 1
        self.n_line = self.n
        self.t_line = time.monotonic()

    def close(self) -> None:
        """End the report; a job that printed plain lines prints a last one with the final count,
        unless its last line showed it already (the same line twice read as a stuck job)."""
        if self.closed:
            return
        self.closed = True
        if self.bar is not None:
            self.bar.close()
        elif self.lines and self.n != self.n_line:
            self._line()


def _is_tty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or not a real stream
        return False
