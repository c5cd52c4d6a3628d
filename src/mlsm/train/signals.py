"""Graceful stop: SIGTERM (what schedulers and torchrun send) and SIGINT (Ctrl-C) end the run
after the current step, with a checkpoint, instead of killing it mid-step. A second SIGINT
aborts at once (KeyboardInterrupt), for a user who does not want to wait for the step. The
command then exits with the shell's status for that signal (`exit_status`), not 0: a `set -e`
script or a scheduler must not take the stopped run for a finished one."""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType

import torch

from mlsm.train.distributed import DistInfo, all_reduce_sum

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_status(signum: int, zero: bool = False) -> int:
    """The exit status of a command that a signal stopped after its checkpoint: the shell's
    128 + the signal's number (130 for SIGINT, 143 for SIGTERM), or 0 when the run's
    `train.signal_exit_zero` asks for it (a wrapper that requeues only what exits 0)."""
    return 0 if zero else 128 + int(signum)


class StopOnSignal:
    """Context manager; `requested(info, device)` is True on every rank once any rank got one of
    `signals` (SIGTERM, SIGINT); `signum` is the first this process got (None: none, or only
    another rank did)."""

    def __init__(self, signals: tuple[int, ...] = STOP_SIGNALS):
        self.signals, self.flag, self._old = signals, False, {}
        self.signum: int | None = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            if self.flag:
                raise KeyboardInterrupt  # the second Ctrl-C: stop now, without a checkpoint
            print("mlsm: stopping after this step with a checkpoint (Ctrl-C again to abort now)",
                  file=sys.stderr, flush=True)
        self.flag = True
        self.signum = signum if self.signum is None else self.signum

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():  # handlers only work there
            self._old = {s: signal.signal(s, self._handle) for s in self.signals}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)

    def requested(self, info: DistInfo, device: torch.device) -> bool:
        if info.world == 1:
            return self.flag
        return bool(all_reduce_sum(torch.tensor(float(self.flag), device=device), info) > 0)
