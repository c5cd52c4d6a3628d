"""FLOP/s and MFU in the pre-training metrics: analytic FLOPs over the logged window."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlsm.models.backbone import build_student
from mlsm.run_config import load_config
from mlsm.train.flops import flops_for_run
from mlsm.train.loop import pretrain
from mlsm.train.throughput import FlopMeter, peak_from_name

from .helpers import tiny_overrides


@given(st.integers(1, 10**15), st.integers(1, 1000), st.floats(1e-3, 1e5), st.floats(1e9, 1e16))
def test_flops_per_s_is_flops_per_step_times_steps_over_seconds(
    per_step: int, steps: int, seconds: float, peak: float
) -> None:
    m = FlopMeter(per_step, peak).metrics(steps, seconds)
    assert math.isclose(m["flops_per_s"] * seconds, per_step * steps, rel_tol=1e-12)
    assert math.isclose(m["mfu"], m["flops_per_s"] / peak, rel_tol=1e-12)
    assert "mfu" not in FlopMeter(per_step, None).metrics(steps, seconds)  # unknown peak: no MFU
    assert FlopMeter(None, peak).metrics(steps, seconds) == {}  # uncounted objective: nothing


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("Tesla V100-SXM2-16GB", 125e12),
        ("NVIDIA A10", 125e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA L40S", 362e12),
        ("Tesla T4", 65e12),
        ("NVIDIA GeForce RTX 4090", 165.2e12),
        ("NVIDIA A10G", None),
        ("NVIDIA GeForce GTX 1080", None),
    ],
)
def test_gpu_peak_table_matches_names_not_prefixes(name: str, peak: float | None) -> None:
    assert peak_from_name(name) == peak


def test_logged_flops_match_the_analytic_count_and_the_window(
    store_dir: Path, tmp_path: Path
) -> None:
    overrides = tiny_overrides(
        store_dir, tmp_path / "r", **{"train.peak_flops": 2.5e11, "train.log_every": 2}
    )
    cfg = load_config(None, overrides)
    run = pretrain(cfg)
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4, 6]
    student = build_student(cfg.model, _tokenizer(store_dir), cfg.data.max_len, 0)
    table = flops_for_run(cfg, vocab_size=student.config.vocab_size, student_config=student.config)
    mlm = next(r for r in table if r.objective == "MLM").total
    tokens_per_step = cfg.train.batch_size * cfg.data.max_len
    for r in rows:
        assert r["flops_per_step"] == mlm
        # same window as tokens_per_s: FLOPs per token of the step, exactly
        assert math.isclose(
            r["flops_per_s"] / r["tokens_per_s"], mlm / tokens_per_step, rel_tol=1e-9
        )
        assert math.isclose(r["mfu"], r["flops_per_s"] / 2.5e11, rel_tol=1e-12)


def test_cpu_run_without_peak_logs_mfu_against_the_measured_peak(
        store_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """No train.peak_flops on a CPU: the measured GEMM rate of the run's precision (patched here
    to 1e12 so that the claim is exact) is the peak."""
    from mlsm.train import throughput

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(throughput, "_PEAKS", {})
    monkeypatch.setattr(throughput, "matmul_rate", lambda dtype: 1e12)
    run = pretrain(
        load_config(None, tiny_overrides(store_dir, tmp_path / "r", **{"train.steps": 2}))
    )
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isclose(r["mfu"], r["flops_per_s"] / 1e12, rel_tol=1e-12) for r in rows)


def _tokenizer(store: Path):
    from mlsm.data.corpus import TokenStore

    return TokenStore.open(store).load_tokenizer()
