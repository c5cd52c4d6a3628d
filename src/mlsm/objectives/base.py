"""The objective contract, and the training module that runs it.

An objective is an `nn.Module` built from its own typed `Config` and a `Context`. `attach(student)`
builds the heads it trains (its own modules, in `self.heads`) and binds what it reads of the
student (e.g. the vocabulary head). One training step on a micro-batch is

    targets = objective.targets(batch)                   # teacher / labels, no grad
    hidden  = student(**objective.student_inputs(student, batch, targets))   # (B, T, d)
    out     = objective.loss(hidden, targets, batch)     # ObjectiveOutput

`TrainModule` does exactly that (and is what DDP wraps); the student's forward stays a plain
encoder forward. `loss` returns the *sum* of the loss over its targets and the number of targets;
the loop divides by the global number of targets (summed over accumulation steps and ranks), so
accumulation and DDP give exactly the full-batch gradient.

What a checkpoint holds is declared, not set by side effect: `exports_vocab_head` (class-level:
does the HF folder keep the student's masked-LM head?) and `exported_heads()` (name -> module,
saved in heads.safetensors, described by `head_meta()` in heads.json). What the rest of mlsm needs
to know about an objective is declared on its class too (`uses_teacher`, `predicts_latent`,
`latent_head`, `scored_by_pll`, `flops_row`; `reads_dictionary` and `scored_through_probe` follow
from them and its Config), so no other module keeps a list of objective names: adding an
objective touches its module, the registry and its test.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch
from torch import nn
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
    store: Any = None
    """The opened token store (`TokenStore`) when the caller has one; else opened from
    store_path."""

    def token_store(self) -> Any:
        """The run's token store, opened once."""
        if self.store is None and self.store_path:
            from mlsm.data.corpus import TokenStore

            self.store = TokenStore.open(self.store_path)
        return self.store


class Objective(nn.Module):
    """Base class: default student inputs (the corrupted sequence), no targets, no heads."""

    Config: ClassVar[type]
    exports_vocab_head: ClassVar[bool] = False
    """Whether the checkpoint's HF folder is the masked LM (encoder + the vocabulary head this
    objective trains) rather than the bare encoder."""
    trains_student: ClassVar[bool] = True
    """False: the student is frozen (eval mode, no grad) and only the objective's heads learn."""
    uses_teacher: ClassVar[bool] = False
    """Its targets come from a frozen teacher model (its Config has a `teacher` option; empty =
    the packaged MiniLM): `mlsm export` names the teacher and its layer in the model card."""
    predicts_latent: ClassVar[bool] = False
    """It trains a head over the k latent properties of MLSM (Berend 2023): a study fits the
    k -> |V| probe on its checkpoints to score words and compares it as a latent arm."""
    latent_head: ClassVar[str] = "latent"
    """The exported head (its name in heads.json) whose output holds the k latent logits, where
    `mlsm.models.heads.read_latent_head` finds it for the probe (when predicts_latent; a probe
    keeps the head it reads under this default name)."""
    scored_by_pll: ClassVar[bool] = True
    """Whether a checkpoint can be scored word by word through its encoder (pseudo-log-likelihood:
    `mlsm blimp`, `load_scorer`, the k -> |V| probe of `mlsm probe`, a study's probe and blimp
    stages). False when the head that predicts words or latents reads a decoder that evaluation
    does not run (MAE-LM, Meng et al. 2024, who drop the decoder and evaluate by fine-tuning):
    that head on encoder states, or the untrained vocabulary head, would score noise. Nor when
    the encoder learnt under a causal mask (CLM): PLL asks position t for its own masked token
    with the whole sentence visible. Those refuse the checkpoint and a study skips those stages
    for its arm."""
    pll_refusal: ClassVar[str] = ""
    """Why not (when scored_by_pll is False): the clause the one-line refusal and a study's skip
    record give."""
    flops_row: ClassVar[str | None] = None
    """The row of `flops_table` (`mlsm flops`) whose step this objective runs; None = not
    modelled (no FLOP/s or MFU in its logs)."""

    @classmethod
    def reads_dictionary(cls) -> bool:
        """Whether its Config has a `dictionary` option: the atoms its latent targets are coded
        against, which must exist before it trains (`mlsm pretrain --text` learns them)."""
        return "dictionary" in {f.name for f in fields(cls.Config)}

    @classmethod
    def scored_through_probe(cls) -> bool:
        """Whether PLL scores its checkpoints only through a k -> |V| probe fitted after training
        (it predicts latents, keeps no vocabulary head, and can be scored at all): `mlsm pretrain
        --text` trains that probe at the end."""
        return cls.predicts_latent and not cls.exports_vocab_head and cls.scored_by_pll

    @classmethod
    def pll_refusal_at(cls, objective: dict[str, Any], step: int, total_steps: int) -> str | None:
        """Why the checkpoint this objective (its saved config `objective`) wrote after `step` of
        `total_steps` optimizer steps cannot be scored by PLL, or None if it can. The class-level
        declaration unless an objective's answer depends on the step (CLM -> MLM) or on another
        checkpoint (the probe)."""
        return None if cls.scored_by_pll else cls.pll_refusal

    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleDict()  # the heads this objective trains (built by attach)
        self._head_meta: dict[str, dict[str, Any]] = {}

    def attach(self, student: Student) -> None:
        """Build this objective's heads for `student` and bind what it reads of the student."""

    def add_head(self, name: str, module: nn.Module, meta: dict[str, Any]) -> None:
        self.heads[name] = module
        self._head_meta[name] = meta

    def exported_heads(self) -> dict[str, nn.Module]:
        """name -> head saved in heads.safetensors (compositions add their members')."""
        return dict(self.heads)

    def head_meta(self) -> dict[str, dict[str, Any]]:
        """name -> JSON description of each exported head (heads.json)."""
        return dict(self._head_meta)

    def targets(self, batch: Batch) -> Any:
        """What the loss compares with (teacher codes, labels, ...) and any grad-free data derived
        from the batch that the student inputs need; computed under no_grad."""
        return None

    def target_count(self, batch: Batch, targets: Any) -> torch.Tensor:
        """The n_targets `loss` will return for this batch, known before the student runs: a
        trainer that divides each micro-batch's loss sum by the count of the whole accumulated
        batch before its backward pass needs it (`mlsm.integrations.transformers`, which checks
        it against `loss`). Default: every selected position."""
        return batch.selected.sum()

    def student_inputs(self, student: Student, batch: Batch, targets: Any) -> dict[str, Any]:
        """Keyword arguments of `student.forward`; default: the corrupted sequence."""
        return {"input_ids": batch.corrupted_ids, "attention_mask": batch.attention_mask}

    def loss(self, hidden: torch.Tensor, targets: Any, batch: Batch) -> ObjectiveOutput:
        raise NotImplementedError


def forward_step(student: Student, objective: Objective, batch: Batch,
                 targets: Any = None) -> ObjectiveOutput:
    """One micro-batch through the data flow: batch -> targets -> student -> loss. targets:
    objective.targets(batch) computed beforehand (by `mlsm.integrations.transformers`'s data
    collator); None computes them here."""
    if targets is None:
        with torch.no_grad():
            targets = objective.targets(batch)
    inputs = objective.student_inputs(student, batch, targets)
    with torch.set_grad_enabled(torch.is_grad_enabled() and objective.trains_student):
        hidden = student(**inputs)  # (B, T', d); T' < T for MAE's kept tokens
    return objective.loss(hidden, targets, batch)


class TrainModule(nn.Module):
    """Student + objective: batch -> targets -> student -> loss. DDP wraps this module."""

    def __init__(self, student: Student, objective: Objective):
        super().__init__()
        self.student = student  # registered first: parameter order = student, then heads
        self.objective = objective

    def forward(self, batch: Batch) -> ObjectiveOutput:
        return forward_step(self.student, self.objective, batch)

    def train(self, mode: bool = True) -> TrainModule:
        super().train(mode)
        if not self.objective.trains_student:
            self.student.eval()  # a frozen model is used as it is evaluated: without dropout
        return self

    def exported_model(self) -> nn.Module:
        """The HF model saved in the checkpoint folder, as the objective declares."""
        return self.student.hf if self.objective.exports_vocab_head else self.student.backbone

    def exported_heads(self) -> nn.ModuleDict:
        return nn.ModuleDict(self.objective.exported_heads())
