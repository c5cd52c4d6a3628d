"""Learning-rate schedules: warmup, linear decay and WSD (warmup-stable-decay) against
transformers' own schedules, and the factor the training loop really applies."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import get_linear_schedule_with_warmup, get_wsd_schedule

from mlsm.config import OptimConfig
from mlsm.errors import UserError
from mlsm.run_config import load_config
from mlsm.train.loop import pretrain
from mlsm.train.schedule import lr_factor

from .helpers import read_metrics, tiny_overrides


def _hf(make, **kw) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    fn = make(opt, **kw).lr_lambdas[0]
    return [fn(s) for s in range(kw.get("num_training_steps", 0) or 200)]


def test_warmup_rises_linearly_to_one_without_a_zero_step() -> None:
    cfg = OptimConfig(warmup=4, schedule="linear")
    got = [lr_factor(s, 100, cfg) for s in range(5)]
    assert got == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])  # step 0 already trains (no lr = 0)
    assert lr_factor(0, 100, OptimConfig(warmup=0.1)) == pytest.approx(
        1 / 10
    )  # a fraction of steps


@pytest.mark.parametrize("floor", [0.0, 0.1])
def test_linear_decay_matches_transformers(floor: float) -> None:
    total, warmup = 50, 5
    cfg = OptimConfig(warmup=warmup, schedule="linear", min_lr_ratio=floor)
    ref = _hf(get_linear_schedule_with_warmup, num_warmup_steps=warmup, num_training_steps=total)
    got = [lr_factor(s, total, cfg) for s in range(total)]
    assert got[warmup:] == pytest.approx(
        [floor + (1 - floor) * r for r in ref[warmup:total]], abs=1e-12
    )
    assert got[-1] == pytest.approx(
        floor + (1 - floor) / (total - warmup)
    )  # one step before the floor


@pytest.mark.parametrize("floor", [0.0, 0.1])
def test_wsd_plateau_and_decay_match_transformers(floor: float) -> None:
    total, warmup, decay = 40, 4, 10
    cfg = OptimConfig(warmup=warmup, schedule="wsd", decay=decay, min_lr_ratio=floor)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    fn = get_wsd_schedule(
        opt,
        num_warmup_steps=warmup,
        num_decay_steps=decay,
        num_training_steps=total,
        decay_type="linear",
        min_lr_ratio=floor,
    ).lr_lambdas[0]
    got = [lr_factor(s, total, cfg) for s in range(total)]
    assert got[warmup : total - decay] == [1.0] * (total - decay - warmup)  # the plateau
    assert got[warmup:] == pytest.approx([fn(s) for s in range(warmup, total)], abs=1e-12)
    assert got[total - decay + 1] < 1.0 and got[-1] == pytest.approx(floor + (1 - floor) / decay)
    # fractions of the run
    frac = OptimConfig(warmup=0.1, schedule="wsd", decay=0.25)
    assert [lr_factor(s, 40, frac) for s in (3, 4, 29, 30, 31)] == pytest.approx(
        [1.0, 1.0, 1.0, 1.0, 0.9]
    )
    with pytest.raises(UserError, match="optim.schedule"):
        lr_factor(10, 40, OptimConfig(schedule="cosine"))


def test_loop_logs_the_scheduled_lr(store_dir: Path, tmp_path: Path) -> None:
    extra = {
        "optim.schedule": "wsd",
        "optim.warmup": 2,
        "optim.decay": 2,
        "optim.lr": 1e-3,
        "train.steps": 6,
        "train.readiness": "[1.0]",
    }
    run = pretrain(load_config(None, tiny_overrides(store_dir, tmp_path / "r", **extra)))
    # step s (1-based in the log) trained with the factor of 0-based step s-1
    assert [m["lr"] for m in read_metrics(run)] == pytest.approx(
        [5e-4, 1e-3, 1e-3, 1e-3, 1e-3, 5e-4]
    )
