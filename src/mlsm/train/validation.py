"""Validation during pre-training (`train.eval_every`): the held-out loss of the run's own
objective, and its metrics (MLM: masked top-1 `accuracy`; MLSM: `top1_agreement` of the latent
argmax), every N steps, in metrics.jsonl and the trackers as `val_loss`, `val_<metric>`.

The held-out batches are the chunks right after the run's last batch: steps `train.steps`,
`train.steps + 1`, ... of the run's own data order and masking, the samples the study's
held-out readouts use (`mlsm.evaluate.zeroshot.heldout.heldout_steps`); held out only while the
run stays within its store's first epoch. Validation changes no weight and no later batch: the
model is read in eval mode without gradients, the masking is a pure function of the step, and
every training step reseeds dropout itself.
"""

from __future__ import annotations

from typing import Any

import torch

from mlsm.data.batches import BatchSource
from mlsm.train import device as dev
from mlsm.train.distributed import DistInfo, all_reduce_sum


def validation_steps(total_steps: int, n_batches: int) -> list[int]:
    """The held-out batches of a run of `total_steps` steps: the `n_batches` after its last."""
    return [total_steps + j for j in range(n_batches)]


def due(step: int, every: int, total_steps: int) -> bool:
    """Whether step `step` (1-based, just done) validates: every `every` steps and at the last
    one; never when `every` is 0."""
    return every > 0 and (step % every == 0 or step == total_steps)


@torch.no_grad()
def validate(module: torch.nn.Module, source: BatchSource, steps: list[int],
             sizes: tuple[int, int], autocast: Any, device: torch.device,
             info: DistInfo) -> dict[str, float]:
    """`val_loss` (the objective's summed loss over its targets / their number) and `val_<m>`
    for each metric the objective reports, over the held-out `steps`; sizes: (global batch,
    micro-batch). Every rank runs it (the sums are all-reduced)."""
    batch_size, micro = sizes
    module.eval()
    totals: dict[str, torch.Tensor] = {}
    try:
        for step in steps:
            for batch in source.micro_batches(step, batch_size, micro, info.rank, info.world):
                with autocast:
                    out = module(dev.to_device(batch, device))
                parts = {"loss_sum": out.loss_sum, "n_targets": out.n_targets,
                         **out.metrics}
                for key, value in parts.items():
                    value = value.detach().float()
                    totals[key] = totals[key] + value if key in totals else value
    finally:
        module.train()  # as the loop built it
    totals = {k: all_reduce_sum(v.to(device), info) for k, v in totals.items()}
    n = totals.pop("n_targets").clamp(min=1)
    return {"val_loss": (totals.pop("loss_sum") / n).item(),
            **{f"val_{k}": (v / n).item() for k, v in totals.items()}}
