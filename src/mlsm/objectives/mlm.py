"""Masked language modelling (Devlin et al. 2019): cross-entropy over the vocabulary at the
selected positions, with the logits computed at those positions only."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mlsm.data.batches import Batch
from mlsm.models.backbone import Student
from mlsm.objectives.base import Context, ObjectiveOutput


@dataclass
class MLMConfig:
    pass


class MLM:
    Config = MLMConfig

    def __init__(self, cfg: MLMConfig, ctx: Context):
        self.cfg = cfg

    def attach(self, student: Student) -> None:
        student.exports_vocab_head = True

    def __call__(self, student: Student, batch: Batch) -> ObjectiveOutput:
        hidden = student.encode(batch.corrupted_ids, batch.attention_mask)  # (B, T, d)
        logits = student.vocab_logits(hidden[batch.selected])  # (N, V)
        labels = batch.input_ids[batch.selected]  # (N,)
        loss = F.cross_entropy(logits.float(), labels, reduction="sum")
        with torch.no_grad():
            correct = (logits.argmax(-1) == labels).sum().float()
        return ObjectiveOutput(loss, labels.new_tensor(labels.numel()), {"mlm_loss": loss.detach(), "accuracy": correct})
