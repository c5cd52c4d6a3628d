"""MAE-MLSM: the MAE-LM encoder/decoder split (Meng et al. 2024, §4) with MLSM targets
(Berend 2023).

New in this toolkit (none of the anchors has it). The encoder never sees the selected positions;
the shallow decoder rebuilds the full length from the encoder outputs plus [MASK] embeddings, and
MLSM's latent head on the *decoder* output predicts the sparse-code distribution of the frozen
teacher's layer-l state at each selected position; loss = KL(p ‖ softmax(z)) (MLSM's, Berend 2023).
As for MAE-LM, the decoder is not part of the evaluated model, so the checkpoint is evaluated by
fine-tuning only: a k -> |V| probe on encoder states would read them with a head trained on
decoder states (`scored_by_pll = False`).

A composition of two parts: the MAE split (`MAEDecoderPass`: which tokens the encoder keeps, the
decoder) and an `MLSM` member, whose own `targets` (online teacher with early exit, or the target
store with `objective.targets`) and `loss` (latent head + KL) run on the decoder states. The
options are MLSM's plus MAE-LM's, by inheritance, so options added to MLSM are accepted here too.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

import torch
from torch import nn

from mlsm.data.batches import Batch
from mlsm.models.backbone import Student
from mlsm.models.mae import seeded
from mlsm.objectives.base import Context, Objective, ObjectiveOutput
from mlsm.objectives.mae_lm import MAEDecoderPass, MAELMConfig
from mlsm.objectives.mlsm import MLSM, MLSMConfig


@dataclass
class MAEMLSMConfig(MLSMConfig, MAELMConfig):
    """MLSM's options (dictionary, teacher, layer, λ, ...) and MAE-LM's (δ, decoder shape)."""

    name: Literal["mae_mlsm"] = "mae_mlsm"  # type: ignore[assignment]
    """Objective name (the tag of the objective group)."""
    # check(): MLSMConfig's (the fidelity switches); MAE-LM's options have ranges only


def _part(cls: type, cfg: Any) -> Any:
    """The `cls` config holding cfg's values of cls's own options (its default name)."""
    return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls) if f.name != "name"})


class MAEMLSM(Objective):
    Config = MAEMLSMConfig
    uses_teacher = predicts_latent = True  # its MLSM member's
    scored_by_pll = False  # the latent head reads the decoder: a probe on the encoder is noise
    pll_refusal = ("its latent head reads the MAE decoder, which the evaluated encoder drops "
                   "(Meng et al. 2024), so a probe on encoder states would score noise")

    def __init__(self, cfg: MAEMLSMConfig, ctx: Context):
        super().__init__()
        self.split = MAEDecoderPass(_part(MAELMConfig, cfg), ctx)  # first: decoder params lead
        self.mlsm = MLSM(_part(MLSMConfig, cfg), ctx)

    def attach(self, student: Student) -> None:
        self.split.attach(student)
        with seeded(self.split.cfg.seed + 1):  # reproducible fresh runs (the loop seeds no heads)
            self.mlsm.attach(student)

    def exported_heads(self) -> dict[str, nn.Module]:
        return {**self.split.exported_heads(), **self.mlsm.exported_heads()}

    def head_meta(self) -> dict[str, dict[str, Any]]:
        return {**self.split.head_meta(), **self.mlsm.head_meta()}

    def targets(self, batch: Batch) -> Any:
        return self.split.targets(batch), self.mlsm.targets(batch)  # split, codes (N, k)

    def student_inputs(self, student: Student, batch: Batch, targets: Any) -> dict[str, Any]:
        return self.split.student_inputs(student, batch, targets[0])

    def loss(self, hidden: torch.Tensor, targets: Any, batch: Batch) -> ObjectiveOutput:
        states = self.split.decode(hidden, targets[0], batch)  # (B, T, d) decoder output
        return self.mlsm.loss(states, targets[1], batch)
