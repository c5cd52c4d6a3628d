"""The linear probe that gives an MLSM model a vocabulary (Berend 2023, §4.3.1).

The MLSM student predicts latent properties, not words. To score text by pseudo-log-likelihood,
a linear layer k -> |V| is trained on top of the frozen model's latent distribution
softmax(latent_head(h)) with the MLM loss, for ~10 % of the pre-training steps. Backbone and latent
head stay frozen (eval mode, no grad); only the probe learns.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mlsm.data.batches import Batch
from mlsm.errors import UserError
from mlsm.models.backbone import Student
from mlsm.models.heads import read_latent_head
from mlsm.objectives.base import Context, ObjectiveOutput

PROBE_INPUTS = ("probs", "logprobs", "logits")


@dataclass
class ProbeConfig:
    checkpoint: str = ""
    """MLSM checkpoint folder whose latent head the probe reads (also set model.init_from to it)."""
    input: str = "probs"
    """What the probe reads: `probs` = softmax(z) (Berend 2023's wording), `logprobs` = log_softmax(z)
    or `logits` = z (see docs/evaluation.md for which trains best)."""


def probe_input(latent_logits: torch.Tensor, kind: str) -> torch.Tensor:
    """The probe's input from the latent head's output z (N, k), in float32."""
    z = latent_logits.float()
    if kind == "probs":
        return torch.softmax(z, -1)
    if kind == "logprobs":
        return torch.log_softmax(z, -1)
    if kind == "logits":
        return z
    raise UserError(f"objective.input={kind!r} is not one of {', '.join(PROBE_INPUTS)}")


def load_latent_head(student: Student, folder: Path) -> None:
    """Attach the latent head saved in an MLSM checkpoint folder to `student`."""
    student.heads["latent"], student.head_meta["latent"] = read_latent_head(folder)


class Probe:
    Config = ProbeConfig

    def __init__(self, cfg: ProbeConfig, ctx: Context):
        if not cfg.checkpoint:
            raise UserError("objective.checkpoint is not set; pass the MLSM checkpoint folder (mlsm probe CHECKPOINT)")
        self.folder = Path(cfg.checkpoint)
        self.vocab = len(ctx.tokenizer)
        self.input = cfg.input
        probe_input(torch.zeros(1, 1), cfg.input)  # a bad name fails before any work

    def attach(self, student: Student) -> None:
        load_latent_head(student, self.folder)
        student.requires_grad_(False)  # everything frozen but the probe added below
        k = student.heads["latent"].proj.out_features
        student.heads["probe"] = nn.Linear(k, self.vocab)
        student.head_meta["probe"] = {"class": "Linear", "in": k, "out": self.vocab, "input": self.input}

    def __call__(self, student: Student, batch: Batch) -> ObjectiveOutput:
        frozen = [student.backbone, student.heads["latent"]]
        modes = [m.training for m in frozen]
        for m in frozen:
            m.eval()  # a frozen model is probed as it is used: without dropout
        with torch.no_grad():
            hidden = student.encode(batch.corrupted_ids, batch.attention_mask)[batch.selected]  # (N, d)
            latent = probe_input(student.heads["latent"](hidden), self.input)  # (N, k)
        for m, mode in zip(frozen, modes, strict=True):
            m.train(mode)
        logits = student.heads["probe"](latent)  # (N, V)
        labels = batch.input_ids[batch.selected]
        loss = F.cross_entropy(logits.float(), labels, reduction="sum")
        correct = (logits.detach().argmax(-1) == labels).sum().float()
        return ObjectiveOutput(loss, labels.new_tensor(labels.numel()), {"mlm_loss": loss.detach(), "accuracy": correct})
