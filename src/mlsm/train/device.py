"""Where and how a training step runs: the device, autocast precision, fp16 loss scaling,
torch.compile, the optimizer's kernel and the host-to-device input path."""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from typing import Any

import torch

from mlsm.errors import UserError
from mlsm.train.distributed import DistInfo


def resolve_device(pref: str, info: DistInfo) -> torch.device:
    """The torch device of `train.device` (auto: CUDA when visible); one GPU per DDP rank."""
    if pref == "auto":
        pref = "cuda" if torch.cuda.is_available() else "cpu"
    if pref == "cuda" and info.world > 1:
        pref = f"cuda:{info.local_rank}"
    if pref.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("train.device=cuda but no CUDA device is visible; use train.device=cpu")
    return torch.device(pref)


def resolve_precision(precision: str, device: torch.device) -> str:
    """The precision a run trains in: `train.precision`, with auto resolved (bf16 on CUDA that
    has it, else fp32). Printed at a run's start and recorded in its run.json, so two runs
    compared side by side never differ in precision unseen."""
    if precision == "auto":
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        precision = "bf16" if bf16 else "fp32"
    if precision == "fp16" and device.type != "cuda":
        raise UserError("train.precision=fp16 needs CUDA; use bf16 or fp32 on CPU")
    if precision not in ("fp32", "bf16", "fp16"):
        raise UserError(f"train.precision={precision!r} is unknown; use auto, fp32, bf16 or fp16")
    return precision


def autocast_for(precision: str, device: torch.device) -> Any:
    """The autocast context of `train.precision` (`resolve_precision`). Weights, optimizer state
    and gradients stay fp32; matmuls run in bf16/fp16."""
    precision = resolve_precision(precision, device)
    if precision == "fp32":
        return nullcontext()
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    return torch.autocast(device.type, dtype=dtypes[precision])


def to_device(batch: Any, device: torch.device) -> Any:
    """A batch on `device`. To CUDA through pinned (page-locked) host memory, so that the
    non-blocking copies of `Batch.to` overlap with the GPU's work instead of waiting for it;
    elsewhere the batch moves as it is."""
    if device.type != "cuda":
        return batch.to(device)
    pinned = {f.name: getattr(batch, f.name).pin_memory() for f in dataclasses.fields(batch)
              if isinstance(getattr(batch, f.name), torch.Tensor)}
    return dataclasses.replace(batch, **pinned).to(device)


def needs_loss_scaling(precision: str, device: torch.device) -> bool:
    """fp16 gradients underflow without loss scaling; bf16 has fp32's exponent range and needs
    none (fp16 runs only on CUDA: `autocast_for` refuses it elsewhere)."""
    return precision == "fp16" and device.type == "cuda"


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    """A GradScaler where `needs_loss_scaling`, else a disabled one (its step is a plain
    optimizer step)."""
    return torch.amp.GradScaler(device.type, enabled=needs_loss_scaling(precision, device))


def compile_student(module: Any) -> None:
    """torch.compile the student's encoder in place (`nn.Module.compile`: the state_dict keys
    stay those of the eager model, so checkpoints are unchanged). The heads, teacher and solver
    stay eager: their inputs are the selected positions, a shape that changes every batch."""
    module.student.compile()


def adamw_options(device: torch.device) -> dict[str, Any]:
    """AdamW options that depend on the device: torch's fused kernel on CUDA (one launch for
    all parameters instead of several per tensor) and on CPU, where torch's default is a loop
    over the tensors: 0.031 s a step against the fused kernel's 0.004 s at BERT 4 x 256, 5 % of
    a bf16 step (benchmarks/bench_precision.py). The default elsewhere."""
    return {"fused": True} if device.type in ("cuda", "cpu") else {}
