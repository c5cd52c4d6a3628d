"""MFU on a CPU against the measured GEMM peak of the precision in use (mlsm.train.throughput)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mlsm.train import throughput


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(throughput, "_PEAKS", {})
    return tmp_path / "mlsm" / "cpu_peaks.json"


def test_matmul_rate_counts_2n3_flops_of_the_fastest_product(monkeypatch) -> None:
    """The rate is 2n^3 over the fastest timed product (a fake clock: 3, 1 and 2 s)."""
    ticks = iter([0.0, 3.0, 10.0, 11.0, 20.0, 22.0])
    monkeypatch.setattr("time.perf_counter", lambda: next(ticks))
    assert throughput.matmul_rate(torch.float32, n=8, repeats=3) == pytest.approx(2 * 8**3 / 1.0)


def test_a_measured_peak_is_cached_per_precision_and_keeps_the_highest(cache: Path,
                                                                      monkeypatch) -> None:
    rates = iter([100.0, 50.0, 300.0])
    calls: list = []
    monkeypatch.setattr(throughput, "matmul_rate",
                        lambda dtype: calls.append(dtype) or next(rates))
    assert throughput.cpu_peak("fp32") == 100.0 and calls == [torch.float32]
    monkeypatch.setattr(throughput, "_PEAKS", {})  # a new process reads the file, measures none
    assert throughput.cpu_peak("fp32") == 100.0 and len(calls) == 1
    assert throughput.cpu_peak("fp32", measure=True) == 50.0  # this run's rate...
    assert throughput.cpu_peak("fp32") == 100.0  # ...but a busy machine's lower rate is not kept
    assert throughput.cpu_peak("bf16") == 300.0 and calls[-1] == torch.bfloat16
    saved = json.loads(cache.read_text())
    assert sorted(saved.values()) == [100.0, 300.0]
    assert all(f"{torch.get_num_threads()} threads" in k for k in saved)


def test_a_cpu_run_logs_mfu_against_the_peak_of_its_precision(cache: Path, monkeypatch) -> None:
    monkeypatch.setattr(throughput, "matmul_rate",
                        lambda dtype: 2e9 if dtype == torch.bfloat16 else 1e9)
    cpu = torch.device("cpu")
    assert throughput.device_peak(cpu, 0.0, "fp32") == 1e9
    assert throughput.device_peak(cpu, 0.0, "auto") == 1e9  # auto is fp32 on a CPU
    assert throughput.device_peak(cpu, 0.0, "bf16") == 2e9
    assert throughput.device_peak(cpu, 5e8, "bf16") == 5e8  # train.peak_flops wins
    meter = throughput.FlopMeter(10**9, throughput.device_peak(cpu, 0.0, "bf16"))
    assert meter.metrics(steps=4, seconds=4.0)["mfu"] == pytest.approx(0.5)
