"""The linear probe that gives an MLSM model a vocabulary.

The probe of §4.3.1 of the *Hitchhikers' Guide to Masked Latent Semantic Modeling* (anonymous, under
review).

The MLSM student predicts latent properties, not words. To score text by pseudo-log-likelihood,
a linear layer k -> |V| is trained on top of the frozen model's latent distribution
softmax(latent_head(h)) with the MLM loss, for ~10 % of the pre-training steps. Backbone and latent
head stay frozen (eval mode, no grad); only the probe learns.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from mlsm.data.batches import Batch
from mlsm.defaults import PROBE_INPUTS
from mlsm.errors import UserError
from mlsm.models.backbone import Student
from mlsm.models.heads import checkpoint_objective, pll_refusal, read_latent_head
from mlsm.objectives.base import Context, Objective, ObjectiveOutput


@dataclass
class ProbeConfig:
    name: Literal["probe"] = "probe"
    """Objective name (the tag of the objective group)."""
    checkpoint: str = ""
    """MLSM checkpoint folder whose latent head the probe reads (also set model.init_from to it)."""
    input: Literal["probs", "logprobs", "logits"] = "probs"
    """What the probe reads: `probs` = softmax(z) (the Hitchhikers' Guide's wording),
    `logprobs` = log_softmax(z) or `logits` = z (see docs/study.md, "The probe", for which
    trains best)."""


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




class Probe(Objective):
    Config = ProbeConfig
    trains_student = False  # backbone and latent head frozen (eval, no grad); only the probe learns

    @classmethod
    def pll_refusal_at(cls, objective: dict[str, Any], step: int, total_steps: int) -> str | None:
        """The probed checkpoint decides (a probe written before its objective was refused, e.g.
        on a MAE-MLSM checkpoint, is refused now); a probed checkpoint that is gone passes, and so
        does one that is itself a probe (mlsm never probes a probe; a hand-edited config naming
        the probe's own folder would otherwise recurse without end)."""
        source = objective.get("checkpoint")
        if not isinstance(source, str) or not source or not Path(source).is_dir():
            return None
        return None if checkpoint_objective(Path(source)) == "probe" else pll_refusal(Path(source))

    def __init__(self, cfg: ProbeConfig, ctx: Context):
        super().__init__()
        if not cfg.checkpoint:
            raise UserError("objective.checkpoint is not set; pass the MLSM checkpoint folder "
                            "(mlsm probe CHECKPOINT)")
        self.folder = Path(cfg.checkpoint)
        self.vocab = len(ctx.tokenizer)
        self.input = cfg.input
        probe_input(torch.zeros(1, 1), cfg.input)  # a bad name fails before any work

    def attach(self, student: Student) -> None:
        student.requires_grad_(False)  # everything frozen but the probe added below
        head, latent = read_latent_head(self.folder)  # MLSM's LatentHead, or the naive block
        self.add_head("latent", head, latent)
        self.heads["latent"].requires_grad_(False)
        k = int(latent["k"])
        meta = {"class": "Linear", "in": k, "out": self.vocab, "input": self.input}
        self.add_head("probe", nn.Linear(k, self.vocab), meta)

    def head_meta(self) -> dict[str, dict[str, Any]]:
        meta = super().head_meta()
        return {**meta, "probe": {**meta["probe"], "input": self.input}}  # the input it reads now

    def train(self, mode: bool = True) -> Probe:
        super().train(mode)
        self.heads["latent"].eval()  # a frozen head is used as it is evaluated
        return self

    def targets(self, batch: Batch) -> torch.Tensor:
        return batch.input_ids[batch.selected]  # (N,) original tokens

    def loss(self, hidden: torch.Tensor, targets: Any, batch: Batch) -> ObjectiveOutput:
        with torch.no_grad():
            latent = probe_input(self.heads["latent"](hidden[batch.selected]), self.input)  # (N, k)
        logits = self.heads["probe"](latent)  # (N, V)
        loss = F.cross_entropy(logits.float(), targets, reduction="sum")
        correct = (logits.detach().argmax(-1) == targets).sum().float()
        metrics = {"mlm_loss": loss.detach(), "accuracy": correct}
        return ObjectiveOutput(loss, targets.new_tensor(targets.numel()), metrics)
