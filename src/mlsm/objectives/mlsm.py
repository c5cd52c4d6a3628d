"""Masked Latent Semantic Modeling (Berend 2023, "Masked Latent Semantic Modeling: an Efficient
Pre-training Alternative to Masked Language Modeling"; as the Hitchhikers' Guide to Masked Latent
Semantic Modeling describes it, §3).

For every selected position i the target is a distribution over k latent semantic properties:
the frozen teacher reads the *unmasked* sequence, its layer-l state h_i is ℓ2-normalised and
sparse-coded against the dictionary D (non-negative LASSO, λ), and p_i = α_i / ‖α_i‖₁. The
student predicts z_i = latent_head(student(masked input)_i) ∈ R^k and the loss is
KL(p_i ‖ softmax(z_i)). The output layer over the k properties is the Hitchhikers' Guide's d × k
(its §3.1; Berend 2023 used d × (|V| + k), as `mlsm_naive` does): no vocabulary logits are ever
computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from mlsm.config import NON_NEGATIVE, POSITIVE, ranged
from mlsm.data.batches import Batch
from mlsm.data.corpus import require_same_tokenizer, tokenizer_hash
from mlsm.defaults import lam_range
from mlsm.errors import UserError
from mlsm.models.backbone import Student
from mlsm.models.heads import LatentHead
from mlsm.objectives.base import Context, Objective, ObjectiveOutput
from mlsm.teacher.dictionary import load_dictionary
from mlsm.teacher.dictionary_config import TEACHER_INITS, TeacherInit
from mlsm.teacher.sparse_coding import fista, sparse_encode
from mlsm.teacher.targets import StoredTargets
from mlsm.teacher.teacher import load_teacher


@dataclass
class MLSMConfig:
    name: Literal["mlsm"] = "mlsm"
    """Objective name (the tag of the objective group)."""
    dictionary: str = ""
    """Dictionary file from `mlsm dictionary` (PATH.safetensors + PATH.json)."""
    teacher: str = ""
    """Teacher model folder or hub id; empty = the packaged all-MiniLM-L6-v2."""
    teacher_init: TeacherInit = "pretrained"
    """The teacher's weights: pretrained (its own), or random (its architecture randomly
    initialised, seeded by teacher_seed: the random-teacher control); must be what the
    dictionary was learned on."""
    teacher_seed: int = ranged(0, NON_NEGATIVE)
    """Seed of the random teacher's weights (teacher_init=random; not read otherwise)."""
    layer: int = -1
    """Teacher layer l (0 = embeddings); -1 = the layer the dictionary was learned on."""
    lam: float = ranged(0.0, lam_range("the dictionary's λ"))
    """Sparse-coding λ; 0 = the λ the dictionary was learned with."""
    targets: str = ""
    """Target store from `mlsm targets`; when set, codes are read from it and no teacher is
    loaded."""
    solver: Literal["exact", "fista"] = "exact"
    """Sparse coder of the online targets: `exact` (active set, KKT-checked) or `fista` (a fixed
    `fista_iters` iterations, as the official code: FISTA-100), to reproduce or measure
    exactness."""
    fista_iters: int = ranged(100, POSITIVE)
    """FISTA iterations when solver=fista (the official code uses 100)."""
    zero_codes: Literal["drop", "count"] = "drop"
    """Positions whose code is all zero: `drop` (no target, not in the mean) or `count` (loss 0 but
    counted in the denominator, as the official KLDivLoss(reduction="batchmean") does)."""

    def check(self) -> None:
        """One-line errors for the fidelity switches (solver, targets, zero_codes)."""
        check_mlsm_options(self)


def check_mlsm_options(cfg: MLSMConfig) -> None:
    """One-line errors for the fidelity switches (solver, targets, zero_codes) and the teacher's
    init that span fields or guard a Config built in Python (ranges: beside the fields)."""
    if cfg.solver not in ("exact", "fista"):
        raise UserError(f"objective.solver={cfg.solver!r}; use exact or fista")
    if cfg.solver == "fista" and cfg.targets:
        raise UserError("objective.solver=fista codes online; drop objective.targets "
                        "(a target store holds exact codes)")
    if cfg.zero_codes not in ("drop", "count"):
        raise UserError(f"objective.zero_codes={cfg.zero_codes!r}; use drop or count")
    if cfg.teacher_init not in TEACHER_INITS:
        raise UserError(f"objective.teacher_init={cfg.teacher_init!r}; use "
                        f"{' or '.join(TEACHER_INITS)}")


class TargetCoder:
    """Teacher (early exit at layer l) + dictionary: unmasked batch -> target distributions."""

    def __init__(self, cfg: MLSMConfig, ctx: Context):
        if not cfg.dictionary:
            raise UserError("objective.dictionary is not set; learn one with `mlsm dictionary` "
                            "and pass objective.dictionary=PATH")
        self.dictionary = load_dictionary(cfg.dictionary, device=ctx.device)
        layer = cfg.layer if cfg.layer >= 0 else self.dictionary.layer
        self.teacher = load_teacher(cfg.teacher or None, layer, device=ctx.device,
                                    init=cfg.teacher_init, seed=cfg.teacher_seed)
        self.dictionary.check_teacher(self.teacher)
        self.teacher.check_length(ctx.max_len, "data.max_len")
        store_hash = tokenizer_hash(ctx.tokenizer)
        require_same_tokenizer(self.teacher.tokenizer, store_hash, ctx.store_path)
        self.lam = cfg.lam or self.dictionary.lam
        self.atoms = self.dictionary.atoms.float()  # (d, k)
        self.gram = self.atoms.T @ self.atoms  # (k, k), reused by every call
        self.k = self.dictionary.k
        self.solver, self.fista_iters = cfg.solver, cfg.fista_iters

    @torch.no_grad()
    def codes(self, batch: Batch) -> torch.Tensor:
        """Non-negative codes (N, k) of the teacher's states at the selected positions."""
        # The teacher runs in the run's precision (train.precision: its forward is most of the
        # extra cost of online MLSM); its states are normalised and coded in fp32: the solver's
        # KKT tolerance (1e-5) is far below bf16's resolution (2^-8), so a bf16 solve would not
        # find the support the fp32 dictionary defines.
        h = self.teacher.hidden_states(batch.input_ids, batch.attention_mask)  # (B, T, d)
        with torch.autocast(batch.input_ids.device.type, enabled=False):  # its matmuls too
            x = F.normalize(h[batch.selected].float(), dim=-1)  # (N, d), fp32
            if self.solver == "fista":
                return fista(x, self.atoms, self.lam, n_iter=self.fista_iters)
            return sparse_encode(x, self.atoms, self.lam, gram=self.gram)


def latent_kl(head: nn.Module, hidden: torch.Tensor, codes: torch.Tensor,
              count_zero: bool = False) -> ObjectiveOutput:
    """KL(p ‖ softmax(z)) summed over targets, p = codes / ‖codes‖₁ (MLSM's loss, Berend 2023).

    head: the latent head (N, d) -> (N, k); hidden: (N, d) student states at the selected
    positions; codes: (N, k). Positions whose code is all zero carry no target and are dropped
    (counted in the `dropped` metric); with count_zero they still count in n_targets (the
    official batchmean divides by all N).
    """
    mass = codes.sum(1)  # (N,)
    keep = mass > 0
    p = codes[keep] / mass[keep, None]  # (M, k)
    z = head(hidden[keep]).float()  # (M, k)
    log_q = F.log_softmax(z, dim=-1)
    kl = (torch.xlogy(p, p) - p * log_q).sum(1)  # (M,): p log p - p log q, with 0 log 0 = 0
    with torch.no_grad():
        metrics = {
            "kl": kl.sum().detach(),
            "target_entropy": -torch.xlogy(p, p).sum(),
            "nnz": (p > 0).sum().float(),
            "top1_agreement": (z.argmax(1) == p.argmax(1)).sum().float(),
            "dropped": (~keep).sum().float(),
        }
    n_targets = torch.tensor(len(codes), device=codes.device) if count_zero else keep.sum()
    return ObjectiveOutput(kl.sum(), n_targets, metrics)


def latent_head(d: int, k: int) -> tuple[LatentHead, dict[str, Any]]:
    """MLSM's latent head d -> k and its heads.json description."""
    return LatentHead(d, k), {"class": "LatentHead", "d": d, "k": k}


def stored_targets(cfg: MLSMConfig, ctx: Context) -> StoredTargets:
    """The target store of `cfg.targets`, checked against this run's token store and options."""
    store = ctx.token_store()
    if store is None:
        raise UserError("objective.targets needs data.store to be set "
                        "(the targets belong to one token store)")
    return StoredTargets(cfg.targets, store, ctx.tokenizer, ctx.max_len,
                         dictionary=cfg.dictionary, layer=cfg.layer, lam=cfg.lam,
                         teacher_init=(cfg.teacher_init, cfg.teacher_seed))


class MLSM(Objective):
    Config = MLSMConfig
    uses_teacher = predicts_latent = True  # the teacher's codes, stored or computed online
    flops_row = "MLSM_l"

    def __init__(self, cfg: MLSMConfig, ctx: Context):
        super().__init__()
        check_mlsm_options(cfg)
        # Same targets either way: stored codes were computed by the same teacher + solver.
        self.coder = stored_targets(cfg, ctx) if cfg.targets else TargetCoder(cfg, ctx)
        self.count_zero = cfg.zero_codes == "count"

    def attach(self, student: Student) -> None:
        self.add_head("latent", *latent_head(student.hidden_size, self.coder.k))

    def targets(self, batch: Batch) -> torch.Tensor:
        return self.coder.codes(batch)  # (N, k), teacher on the unmasked sequence

    def target_count(self, batch: Batch, targets: Any) -> torch.Tensor:
        """Positions with a nonzero code (all selected ones with zero_codes=count): latent_kl's."""
        n = torch.tensor(len(targets), device=targets.device)
        return n if self.count_zero else (targets.sum(1) > 0).sum()

    def loss(self, hidden: torch.Tensor, targets: Any, batch: Batch) -> ObjectiveOutput:
        return latent_kl(self.heads["latent"], hidden[batch.selected], targets, self.count_zero)
