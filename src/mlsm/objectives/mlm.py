"""Masked language modelling (Devlin et al. 2019): cross-entropy over the vocabulary at the
selected positions, with the logits computed at those positions only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from mlsm.data.batches import Batch
from mlsm.models.backbone import Student
from mlsm.objectives.base import Context, Objective, ObjectiveOutput


@dataclass
class MLMConfig:
    name: Literal["mlm"] = "mlm"
    """Objective name (the tag of the objective group)."""


def vocab_loss(logits: torch.Tensor, labels: torch.Tensor, loss_name: str = "mlm_loss",
               accuracy_name: str = "accuracy") -> ObjectiveOutput:
    """Summed cross-entropy of (N, V) logits against (N,) labels, with accuracy."""
    loss = F.cross_entropy(logits.float(), labels, reduction="sum")
    with torch.no_grad():
        correct = (logits.argmax(-1) == labels).sum().float()
    metrics = {loss_name: loss.detach(), accuracy_name: correct}
    return ObjectiveOutput(loss, labels.new_tensor(labels.numel()), metrics)


class MLM(Objective):
    Config = MLMConfig
    exports_vocab_head = True  # the student's masked-LM head is what MLM trains
    flops_row = "MLM"

    def __init__(self, cfg: MLMConfig, ctx: Context):
        super().__init__()
        self.cfg = cfg

    def attach(self, student: Student) -> None:
        self.vocab_logits = student.vocab_logits  # a bound method: the head stays the student's

    def targets(self, batch: Batch) -> Any:
        return batch.input_ids[batch.selected]  # (N,) original tokens

    def loss(self, hidden: torch.Tensor, targets: Any, batch: Batch) -> ObjectiveOutput:
        logits = self.vocab_logits(hidden[batch.selected])  # (N, V)
        return vocab_loss(logits, targets)
