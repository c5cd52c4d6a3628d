"""MAE-MLSM: the MAE-LM encoder/decoder split (Meng et al. 2024, §4) with MLSM targets (Berend 2023).

New in this toolkit (none of the anchors has it). The encoder never sees the selected positions;
the shallow decoder rebuilds the full length from the encoder outputs plus [MASK] embeddings, and
MLSM's latent head on the *decoder* output predicts the sparse-code distribution of the frozen
teacher's layer-l state at each selected position; loss = KL(p ‖ softmax(z)) (Berend 2023, Eq. 2).

Targets, the KL and the latent head are MLSM's own: the target source is the one `MLSM` picks
(online teacher with early exit, or the target store with `objective.targets`), and `latent_kl`
/ `attach_latent_head` come from objectives/mlsm.py. The options are MLSM's plus MAE-LM's, by
inheritance, so options added to MLSM are accepted here too.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlsm.data.batches import Batch
from mlsm.models.backbone import Student
from mlsm.models.mae import seeded
from mlsm.objectives.base import Context, ObjectiveOutput
from mlsm.objectives.mae_lm import MAEDecoderPass, MAELMConfig
from mlsm.objectives.mlsm import MLSM, MLSMConfig, attach_latent_head, latent_kl


@dataclass
class MAEMLSMConfig(MLSMConfig, MAELMConfig):
    """MLSM's options (dictionary, teacher, layer, λ, ...) and MAE-LM's (δ, decoder shape)."""


class MAEMLSM:
    Config = MAEMLSMConfig

    def __init__(self, cfg: MAEMLSMConfig, ctx: Context):
        self.split = MAEDecoderPass(cfg, ctx)
        mlsm = MLSM(cfg, ctx)
        self.coder, self.count_zero = mlsm.coder, mlsm.count_zero  # exactly as MLSM chooses

    def attach(self, student: Student) -> None:
        self.split.attach(student)
        with seeded(self.split.cfg.seed + 1):  # reproducible fresh runs (the loop seeds no heads)
            attach_latent_head(student, self.coder.k)

    def __call__(self, student: Student, batch: Batch) -> ObjectiveOutput:
        codes = self.coder.codes(batch)  # (N, k), teacher on the unmasked sequence
        states = self.split(student, batch)  # (B, T, d) decoder output
        return latent_kl(student, states[batch.selected], codes, self.count_zero)
