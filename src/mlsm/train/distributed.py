"""Process-group helpers for torchrun/DDP (gloo on CPU, nccl on CUDA); no-ops in one process."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    owns_group: bool = False  # this run started the process group, so it ends it

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_pref: str) -> DistInfo:
    """Join the process group torchrun describes in the environment, if any."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return DistInfo()
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and device_pref != "cpu"
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("nccl" if use_cuda else "gloo")
    if use_cuda:
        torch.cuda.set_device(local)
    return DistInfo(rank=rank, world=world, local_rank=local, owns_group=owns)


def end_distributed(info: DistInfo) -> None:
    """End the process group this run started. Gloo's worker threads outlive a process that exits
    without it and can abort it at interpreter exit (SIGABRT, "terminate called without an active
    exception": pytorch/pytorch#190489), which failed a finished two-process run under load."""
    if info.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum over ranks into a new tensor: reducing in place would reduce twice any tensor that
    shares storage with another one being reduced (an objective's `loss.detach()` metric is a view
    of its loss sum), which doubled the logged DDP loss."""
    if info.world > 1:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def barrier(info: DistInfo) -> None:
    if info.world > 1:
        dist.barrier()
