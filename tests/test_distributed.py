"""DDP on CPU (gloo): two processes with the same global batch give the weights of one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mlsm.run_config import load_config
from mlsm.train.loop import pretrain

from .helpers import tiny_overrides

NODROP = (
    "{hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 2, intermediate_size: 64, "
    "hidden_dropout_prob: 0.0, attention_probs_dropout_prob: 0.0}"
)


def _overrides(store: Path, out: Path, **extra: object) -> list[str]:
    return tiny_overrides(
        store, out, **{"model.overrides": NODROP, "train.steps": 4, "train.threads": 1, **extra}
    )


def _torchrun(n: int, args: list[str]) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={n}",
        "-m", "mlsm", "pretrain",
        *args,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("micro", [0, 2])  # no accumulation, and 2 accumulation steps per rank
def test_two_processes_match_one(store_dir: Path, tmp_path: Path, micro: int) -> None:
    _check_two_match_one(store_dir, tmp_path, **{"train.micro_batch_size": micro})


def test_two_processes_match_one_with_a_target_store(
    store_dir: Path, target_dir: Path, tmp_path: Path
) -> None:
    # MLSM drops positions whose code is all zero: the ranks see unequal target counts
    _check_two_match_one(
        store_dir, tmp_path, **{"objective.name": "mlsm", "objective.targets": str(target_dir)}
    )


def _check_two_match_one(store_dir: Path, tmp_path: Path, **extra: object) -> None:
    one = pretrain(load_config(None, _overrides(store_dir, tmp_path / "one", **extra)))
    two = tmp_path / "two"
    proc = _torchrun(2, _overrides(store_dir, two, **extra))
    assert proc.returncode == 0, proc.stderr[-3000:]
    a = load_file(one / "checkpoints" / "step-0000004" / "model.safetensors")
    b = load_file(two / "checkpoints" / "step-0000004" / "model.safetensors")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-6)
    lines = lambda run: [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert [m["batch_digest"] for m in lines(one)] == [m["batch_digest"] for m in lines(two)]
    assert [m["n_targets"] for m in lines(one)] == [m["n_targets"] for m in lines(two)]
    # per step: the global mean loss and the pre-clip gradient norm (clipping and AdamW hide a
    # gradient that is off by a constant factor, e.g. DDP's average over ranks left in)
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in lines(two)] == pytest.approx(
            [m[key] for m in lines(one)], rel=1e-5
        ), key
    assert json.loads((two / "run.json").read_text())["world_size"] == 2


def test_resume_on_another_world_size(store_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "mixed"
    proc = _torchrun(
        2, _overrides(store_dir, run, **{"train.steps": 4, "train.readiness": "[0.5, 1.0]"})
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = load_file(run / "checkpoints" / "step-0000004" / "model.safetensors")
    # drop the final checkpoint and finish the run in one process from step 2
    import shutil

    shutil.rmtree(run / "checkpoints" / "step-0000004")
    pretrain(
        load_config(
            None, _overrides(store_dir, run, **{"train.steps": 4, "train.readiness": "[0.5, 1.0]"})
        ),
        resume="auto",
    )
    b = load_file(run / "checkpoints" / "step-0000004" / "model.safetensors")
    for key in ref:
        torch.testing.assert_close(ref[key], b[key], rtol=1e-4, atol=1e-6)
    # a resume, not a restart: each step logged once, steps 3-4 by the resumed process
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    fresh = pretrain(
        load_config(
            None,
            _overrides(
                store_dir, tmp_path / "fresh", **{"train.steps": 4, "train.readiness": "[0.5, 1.0]"}
            ),
        ),
        resume=str(run / "checkpoints" / "step-0000002"),
    )
    assert [json.loads(x)["step"] for x in (fresh / "metrics.jsonl").read_text().splitlines()] == [
        3,
        4,
    ]
