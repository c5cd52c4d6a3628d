"""The probe that gives a frozen model a (fresh) vocabulary head.

The probe of §4.3.1 of the *Hitchhikers' Guide to Masked Latent Semantic Modeling* (anonymous, under
review): the MLSM student predicts latent properties, not words; to score text by
pseudo-log-likelihood, a linear layer k -> |V| is trained on top of the frozen model's latent
distribution softmax(latent_head(h)) with the MLM loss, for ~10 % of the pre-training steps.
Backbone and latent head stay frozen (eval mode, no grad); only the probe learns (`head: latent`).

The same recipe fits the *readout controls* on a frozen checkpoint of any objective, so that every
arm of a study gets the same extra supervised steps on the same batches (`head`):
- `vocab`: a fresh, untied d -> |V| linear head on the encoder's last hidden state (rank <= d);
- `factored`: a fresh head of MLSM's readout shape, d -> k -> |V|: a `LatentHead(d, k)` (trained,
  not frozen) whose output goes through the same input kind (softmax, log-softmax or none) into
  a k -> |V| linear layer, so its logits have the rank MLSM's probe has (k, not d).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from mlsm.config import NON_NEGATIVE, ranged
from mlsm.data.batches import Batch
from mlsm.defaults import PROBE_HEADS, PROBE_INPUTS, default_k
from mlsm.errors import UserError
from mlsm.models.backbone import Student
from mlsm.models.heads import checkpoint_objective, pll_refusal, read_latent_head
from mlsm.objectives.base import Context, Objective, ObjectiveOutput
from mlsm.objectives.mlsm import latent_head


@dataclass
class ProbeConfig:
    name: Literal["probe"] = "probe"
    """Objective name (the tag of the objective group)."""
    checkpoint: str = ""
    """MLSM checkpoint folder whose latent head the probe reads (also set model.init_from to it)."""
    input: Literal["probs", "logprobs", "logits"] = "probs"
    """What the probe reads: `probs` = softmax(z) (the Hitchhikers' Guide's wording),
    `logprobs` = log_softmax(z) or `logits` = z (see docs/study.md, "The probe", for which
    trains best). A `vocab` head reads the hidden state itself (`logits`, the identity)."""
    head: Literal["latent", "vocab", "factored"] = "latent"
    """Which head is fitted: `latent` = k -> |V| on the checkpoint's frozen latent head (MLSM's
    probe); `vocab` = a fresh untied d -> |V| linear head; `factored` = a fresh d -> k -> |V| head
    of MLSM's readout shape (a trained LatentHead, then `input`, then k -> |V|). The last two work
    on a checkpoint of any objective: the readout controls (docs/readouts.md)."""
    rank: int = ranged(0, NON_NEGATIVE)
    """Width k of a `factored` head; 0 = the checkpoint's latent k, or 4 x d for a checkpoint
    without a latent head."""


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


def _latent_k(folder: Path) -> int | None:
    """The k of the checkpoint's latent head, or None when it has none (an MLM checkpoint)."""
    from mlsm.artifacts.checkpoint import Checkpoint

    ck = Checkpoint.at(folder)
    entry = (ck.heads_meta or {}).get(ck.latent_head)
    k = entry.get("k") if isinstance(entry, dict) else None
    return int(k) if isinstance(k, int) and k > 0 else None


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
        self.input, self.head, self.rank = cfg.input, cfg.head, cfg.rank
        probe_input(torch.zeros(1, 1), cfg.input)  # a bad name fails before any work
        if cfg.head not in PROBE_HEADS:
            raise UserError(f"objective.head={cfg.head!r}; use one of {', '.join(PROBE_HEADS)}")
        if cfg.head == "vocab" and cfg.input != "logits":
            self.input = "logits"  # a vocab head reads the hidden state as it is

    def attach(self, student: Student) -> None:
        student.requires_grad_(False)  # everything frozen but the heads added below
        d = student.hidden_size
        if self.head == "vocab":
            meta = {"class": "Linear", "in": d, "out": self.vocab, "input": "logits",
                    "features": "hidden"}
            self.add_head("probe", nn.Linear(d, self.vocab), meta)
            return
        if self.head == "factored":  # fresh and trained: MLSM's readout shape, no MLSM training
            k = self.rank or _latent_k(self.folder) or default_k(d)
            self.add_head("latent", *latent_head(d, k))
        else:
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
        if self.head == "latent":
            self.heads["latent"].eval()  # a frozen head is used as it is evaluated
        return self

    def targets(self, batch: Batch) -> torch.Tensor:
        return batch.input_ids[batch.selected]  # (N,) original tokens

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the k -> |V| (or d -> |V|) layer reads, from the states (N, d) at the targets."""
        if self.head == "vocab":
            return hidden
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.head == "factored"):
            return probe_input(self.heads["latent"](hidden), self.input)  # (N, k)

    def loss(self, hidden: torch.Tensor, targets: Any, batch: Batch) -> ObjectiveOutput:
        logits = self.heads["probe"](self.features(hidden[batch.selected]))  # (N, V)
        loss = F.cross_entropy(logits.float(), targets, reduction="sum")
        correct = (logits.detach().argmax(-1) == targets).sum().float()
        metrics = {"mlm_loss": loss.detach(), "accuracy": correct}
        return ObjectiveOutput(loss, targets.new_tensor(targets.numel()), metrics)
