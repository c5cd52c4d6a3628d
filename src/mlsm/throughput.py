"""Achieved FLOP/s and model FLOPs utilisation (MFU) of a pre-training run.

FLOPs per optimizer step are the analytic count of `mlsm.flops` (`mlsm flops`, the
"mlsm" accounting: matmuls of the student's forward + backward and of the teacher's forward, the
global batch); sparse coding is not counted, as MFU conventionally counts model FLOPs only
(Chowdhery et al. 2022, PaLM, Appendix B). Over a logging window of n steps taking t seconds:

    flops_per_s = flops_per_step · n / t        mfu = flops_per_s / (peak_per_device · world)

The peak is `train.peak_flops` when set, else the dense (no-sparsity) BF16/FP16 tensor-core peak
of the GPU from the vendor's datasheet (`GPU_PEAK_FLOPS`); on a CPU there is no MFU unless
`train.peak_flops` is given.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Any

import torch

from mlsm.flops import flops_for_run

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


def device_peak(device: torch.device, configured: float) -> float | None:
    """Peak FLOP/s of one device: `configured` if > 0, else the GPU table, else None."""
    if configured > 0:
        return float(configured)
    if device.type == "cuda":
        return peak_from_name(torch.cuda.get_device_name(device))
    return None


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
    peak = device_peak(device, cfg.train.peak_flops)
    return FlopMeter(per_step, peak * world if peak else None)
