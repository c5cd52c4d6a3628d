"""Crash safety: SIGKILL at random moments, SIGTERM, non-finite loss, failed writes."""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mlsm.artifacts.checkpoint import list_checkpoints
from mlsm.artifacts.run_spec import resume_command
from mlsm.errors import UserError
from mlsm.run_config import load_config
from mlsm.train import checkpoint as ckpt
from mlsm.train.loop import pretrain

from .helpers import tiny_overrides

STEPS = 10


def _overrides(store: Path, out: Path, **extra: object) -> list[str]:
    # one thread so the subprocess and in-process runs do identical float arithmetic
    return tiny_overrides(
        store, out, **{"train.steps": STEPS, "train.save_every": 1, "train.threads": 1, **extra}
    )


def _cli(store: Path, out: Path, **extra: object) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "mlsm", "pretrain", "--resume", "auto",
        *_overrides(store, out, **extra),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _final(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / f"step-{STEPS:07d}" / "model.safetensors")


def _logged(run: Path) -> int:
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _wait_for_progress(
    run: Path, proc: subprocess.Popen, steps: int = 1, timeout: float = 120
) -> None:
    """Wait until `steps` metrics lines exist (or the process ends); independent of machine
    speed."""
    start = time.time()
    while _logged(run) < steps and proc.poll() is None and time.time() - start < timeout:
        time.sleep(0.005)


def test_sigkill_at_random_moments_then_resume_is_bit_identical(
    store_dir: Path, tmp_path: Path
) -> None:
    reference = pretrain(load_config(None, _overrides(store_dir, tmp_path / "ref")))
    run, rng, kills = tmp_path / "killed", random.Random(0), 0
    for _ in range(12):
        proc = _cli(store_dir, run)
        if kills < 4:
            # kill shortly after a random later step was logged:
            # mid-step, mid-checkpoint or mid-prune
            _wait_for_progress(run, proc, min(STEPS - 1, _logged(run) + rng.randint(1, 3)))
            time.sleep(rng.uniform(0.0, 0.05))
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                kills += 1
        out, _ = proc.communicate(timeout=300)
        if proc.returncode == 0:
            break
        assert proc.returncode == -signal.SIGKILL, out
    assert kills >= 2 and proc.returncode == 0
    a, b = _final(reference), _final(run)
    assert all(torch.equal(a[k], b[k]) for k in a)
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))  # lines after a crash were truncated, not duplicated
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("signum,zero,status", [
    (signal.SIGTERM, False, 143), (signal.SIGINT, False, 130), (signal.SIGTERM, True, 0),
    (signal.SIGINT, True, 0)], ids=["SIGTERM", "SIGINT", "SIGTERM-exit-zero", "SIGINT-exit-zero"])
def test_a_signal_saves_a_checkpoint_and_exits_with_its_status(
    store_dir: Path, tmp_path: Path, signum: int, zero: bool, status: int
) -> None:
    """SIGTERM or Ctrl-C (SIGINT) ends a real `mlsm pretrain` after the step with a checkpoint
    and how to resume, then exits 128 + the signal as the shell does: a `set -e` script stops
    there (the run used to exit 0, as if it had finished). train.signal_exit_zero=true gives the
    0 a scheduler's requeue may need."""
    run = tmp_path / "stopped"
    extra = {"train.signal_exit_zero": "true"} if zero else {}
    proc = _cli(store_dir, run, **{"train.save_every": 0, "train.steps": 400,
                                   "train.readiness": "[1.0]", **extra})
    _wait_for_progress(run, proc)
    proc.send_signal(signum)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == status, out
    assert f"stopped by signal {signal.Signals(signum).name} after step" in out
    assert "continue with --resume auto" in out and "Traceback" not in out
    assert resume_command(run) in out  # the command test_fix_hints.py runs for a stopped run
    found = list_checkpoints(run)
    assert found and 0 < found[-1][0] < 400 and found[-1][0] == _logged(run)


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(
    store_dir: Path, tmp_path: Path
) -> None:
    cfg = load_config(
        None,
        _overrides(
            store_dir, tmp_path / "nan", **{"optim.lr": 1e30, "optim.clip": 0, "optim.warmup": 0}
        ),
    )
    with pytest.raises(UserError, match="non-finite loss at step") as info:
        pretrain(cfg)
    assert "\n" not in str(info.value)
    found = list_checkpoints(tmp_path / "nan")
    assert found, "at least the first step's checkpoint was written before the blow-up"
    state = load_file(found[-1][1] / "model.safetensors")
    assert all(torch.isfinite(v).all() for v in state.values())


def test_failed_write_leaves_previous_checkpoint_intact(
    store_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    real_save, calls = torch.save, {"n": 0}

    def disk_full_on_third(obj, path, *a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, path, *a, **k)

    monkeypatch.setattr(ckpt.torch, "save", disk_full_on_third)
    run = tmp_path / "full"
    with pytest.raises(UserError, match="No space left on device"):
        pretrain(load_config(None, _overrides(store_dir, run)))
    found = list_checkpoints(run)
    assert [s for s, _ in found] == [1, 2]
    for _, folder in found:
        assert all(
            torch.isfinite(v).all() for v in load_file(folder / "model.safetensors").values()
        )
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]
    monkeypatch.setattr(ckpt.torch, "save", real_save)
    pretrain(load_config(None, _overrides(store_dir, run)), resume="auto")  # and the run continues
    assert list_checkpoints(run)[-1][0] == STEPS
