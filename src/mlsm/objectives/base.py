"""The objective contract: the only thing the training loop knows about an objective.

An objective is built from its own `Config` dataclass and a `Context`; `attach` adds whatever
trainable heads it needs to the student; calling it on a batch returns the *sum* of its loss over
its targets and the number of targets. The loop divides by the global number of targets (summed
over accumulation steps and ranks), so accumulation and DDP give exactly the full-batch gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch
from transformers import PreTrainedTokenizerBase

from mlsm.data.batches import Batch
from mlsm.models.backbone import Student


@dataclass
class ObjectiveOutput:
    loss_sum: torch.Tensor  # scalar: loss summed over this micro-batch's targets
    n_targets: torch.Tensor  # scalar: number of targets that loss_sum sums over
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-target sums; the loop logs each divided by the step's total n_targets."""


@dataclass
class Context:
    """What an objective may need to know about the run, besides its own options."""

    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    total_steps: int
    store_path: str = ""
    max_len: int = 128


class Objective(Protocol):
    Config: ClassVar[type]

    def attach(self, student: Student) -> None: ...

    def __call__(self, student: Student, batch: Batch) -> ObjectiveOutput: ...


def options_of(spec: dict[str, Any]) -> dict[str, Any]:
    """The objective's own options: the spec without its name."""
    return {k: v for k, v in spec.items() if k != "name"}
