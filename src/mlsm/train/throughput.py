"""Achieved FLOP/s and model FLOPs utilisation (MFU) of a pre-training run.

FLOPs per optimizer step are the analytic count of `mlsm.train.flops` (`mlsm flops`, the
"mlsm" accounting: matmuls of the student's forward + backward and of the teacher's forward, the
global batch); sparse coding is not counted, as MFU conventionally counts model FLOPs only
(Chowdhery et al. 2022, PaLM, Appendix B). Over a logging window of n steps taking t seconds:

    flops_per_s = flops_per_step · n / t        mfu = flops_per_s / (peak_per_device · world)

The peak is `train.peak_flops` when set, else the dense (no-sparsity) BF16/FP16 tensor-core peak
of the GPU from the vendor's datasheet (`GPU_PEAK_FLOPS`), else, on a CPU, the *measured* GEMM
rate of the precision in use at the run's thread count (`cpu_peak`: a 2048^3 matmul, best of five,
measured once per CPU model, torch version, thread count and dtype and cached; no datasheet gives
a CPU's attainable rate, which depends on its vector units, AMX included, and on the VM).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Any

import torch

from mlsm.train.flops import flops_for_run

# (regex on torch.cuda.get_device_name, dense BF16/FP16 tensor FLOP/s, source); first match wins.
# NVIDIA datasheets list "with sparsity" figures too: those are 2x the dense ones used here.
GPU_PEAK_FLOPS: list[tuple[str, float, str]] = [
    (r"H100.*PCIe", 756e12, "NVIDIA H100 datasheet: BF16 1,513 TFLOPS with sparsity (PCIe)"),
    (r"H100.*NVL", 835e12, "NVIDIA H100 datasheet: BF16 1,671 TFLOPS with sparsity (NVL)"),
    (r"H100|H200|GH200", 989e12, "NVIDIA H100/H200 datasheets: BF16 1,979 TFLOPS w/ sparsity, SXM"),
    (r"A100", 312e12, "NVIDIA A100 datasheet: BF16 312 TFLOPS"),
    (r"\bA10\b", 125e12, "NVIDIA A10 datasheet: BF16 125 TFLOPS"),
    (r"\bL4\b", 121e12, "NVIDIA L4 datasheet: BF16 242 TFLOPS with sparsity"),
    (r"L40S", 362e12, "NVIDIA L40S datasheet: BF16 733 TFLOPS with sparsity"),
    (r"V100", 125e12, "NVIDIA V100 datasheet: 125 tensor TFLOPS (SXM2, FP16)"),
    (r"\bT4\b", 65e12, "NVIDIA T4 datasheet: FP16 65 TFLOPS (mixed precision)"),
    (r"RTX 4090", 165.2e12, "NVIDIA Ada whitepaper: RTX 4090 FP16/BF16 tensor, FP32 accumulate"),
]



def peak_from_name(name: str) -> float | None:
    """Dense BF16/FP16 peak FLOP/s of a GPU by its name, or None when it is not in the table."""
    for pattern, peak, _ in GPU_PEAK_FLOPS:
        if re.search(pattern, name):
            return peak
    return None


def device_peak(device: torch.device, configured: float,
                precision: str = "fp32") -> float | None:
    """Peak FLOP/s of one device: `configured` if > 0, else the GPU table, else on a CPU the
    measured GEMM rate of `precision` (bf16: bf16, else fp32), else None."""
    if configured > 0:
        return float(configured)
    if device.type == "cuda":
        return peak_from_name(torch.cuda.get_device_name(device))
    if device.type == "cpu":
        return cpu_peak("bf16" if precision == "bf16" else "fp32")
    return None


PEAK_N = 2048
"""Size of the square matmul whose rate is the CPU peak: big enough to reach the GEMM's plateau on
2-16 cores (4096 gives the same rate within a few % here, at 8x the time)."""
_PEAKS: dict[str, float] = {}


def matmul_rate(dtype: torch.dtype, n: int = PEAK_N, repeats: int = 5) -> float:
    """FLOP/s of the fastest of `repeats` (n x n) @ (n x n) products in `dtype` on the CPU (2n^3
    FLOPs each), after one warm-up product (kernel selection, page faults)."""
    import time

    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen).to(dtype) for _ in range(2))
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def _peak_cache() -> Any:
    import os
    from pathlib import Path

    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mlsm" / "cpu_peaks.json"


def peak_key(precision: str) -> str:
    """What a measured CPU peak holds for: CPU model, torch version, threads, precision."""
    from mlsm.provenance import machine_description

    cpu = machine_description().split(", ")[0]
    return f"{cpu} | torch {torch.__version__} | {torch.get_num_threads()} threads | {precision}"


MAX_CPU_PEAK = 1e16
"""FLOP/s no CPU reaches (10 PFLOP/s): a cached peak beyond it, like NaN, inf, zero or a negative
one (JSON reads `NaN` and `1e999`), is a damaged or forged cache, measured again."""


def _plausible_peak(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and \
        0 < value <= MAX_CPU_PEAK


def cpu_peak(precision: str, measure: bool = False) -> float:
    """The CPU's GEMM peak for `precision` ("fp32" or "bf16") at the current thread count, from
    the cache (~/.cache/mlsm/cpu_peaks.json, XDG_CACHE_HOME respected) or measured once and
    cached. measure=True measures again (a benchmark measures in its own run) and the cache keeps
    the highest rate seen: a measurement on a busy machine is low, never high."""
    import json

    from mlsm.fileio import atomic_write_text

    key, path = peak_key(precision), _peak_cache()
    if key in _PEAKS and not measure:
        return _PEAKS[key]
    try:
        cached = json.loads(path.read_text())
        cached = cached if isinstance(cached, dict) else {}
    except (OSError, ValueError):
        cached = {}
    known = cached.get(key) if _plausible_peak(cached.get(key)) else None  # a forged one: measured
    if known is None or measure:
        rate = matmul_rate(torch.bfloat16 if precision == "bf16" else torch.float32)
        known = max(rate, known or 0.0)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps({**cached, key: known}, indent=1) + "\n")
        except OSError:  # a read-only home: the rate still serves this process
            pass
        if measure:
            _PEAKS[key] = known
            return rate
    _PEAKS[key] = float(known)
    return float(known)


def flops_label(objective: str) -> str | None:
    """The `flops_table` row an objective runs, as its class declares (`flops_row`)."""
    from mlsm.objectives import objective_class

    cls = objective_class(objective)
    return cls.flops_row if cls is not None else None


def flops_row_of(rows: list[Any], objective: str) -> Any:
    """The row of `rows` (a `flops_table`) that `objective` runs; None when it has none. Rows
    are named by their label, some with a parenthesis after it (`MLSM_l (l=3)`)."""
    label = flops_label(objective)
    return next((r for r in rows if label is not None
                 and (r.objective == label or r.objective.split(" (")[0] == label)), None)


def flops_per_step(cfg: Any, student_config: Any) -> int | None:
    """Analytic FLOPs of one optimizer step of this run (None for objectives `flops_table` does
    not cover: those whose class declares no `flops_row`)."""
    if flops_label(cfg.objective.name) is None:
        return None
    vocab = int(student_config.vocab_size)
    rows = flops_for_run(cfg, vocab_size=vocab, student_config=student_config)
    row = flops_row_of(rows, cfg.objective.name)
    assert row is not None, f"flops_table has no {flops_label(cfg.objective.name)!r} row"
    # MLSM from a target store: no teacher runs during training
    if getattr(cfg.objective, "targets", ""):
        return row.student
    return row.total


@dataclass
class FlopMeter:
    """FLOP/s (and MFU) metrics of one logging window."""

    flops_per_step: int | None
    peak: float | None = None  # FLOP/s of all devices together

    def metrics(self, steps: int, seconds: float) -> dict[str, float]:
        if not self.flops_per_step or steps <= 0:
            return {}
        achieved = self.flops_per_step * steps / max(seconds, 1e-9)
        out = {"flops_per_step": float(self.flops_per_step), "flops_per_s": achieved}
        if self.peak:
            out["mfu"] = achieved / self.peak
        return out


def flop_meter(cfg: Any, student_config: Any, device: torch.device, world: int) -> FlopMeter:
    """The meter of a run; FLOPs that cannot be counted (e.g. an unreachable hub teacher) cost
    one line on stderr and leave FLOP/s out of the metrics, never the run."""
    from mlsm.errors import UserError

    try:
        per_step = flops_per_step(cfg, student_config)
    except (UserError, OSError, ValueError, KeyError, StopIteration) as exc:
        print(f"mlsm: FLOP/s not logged: cannot count this run's FLOPs ({exc})",
              file=sys.stderr, flush=True)
        per_step = None
    peak = device_peak(device, cfg.train.peak_flops, cfg.train.precision)
    return FlopMeter(per_step, peak * world if peak else None)
