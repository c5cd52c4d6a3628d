"""MLSM as the official implementation does it — kept as the comparison point for speed.

Same targets and loss as `mlsm` (MLSM's, Berend 2023), computed the straightforward way:
- the teacher is loaded whole (AutoModelForMaskedLM when its checkpoint has an MLM head, else
  AutoModel) and runs every layer, its vocabulary logits included, with output_hidden_states;
  layer l is then picked out of the tuple (no early exit);
- codes come from FISTA with a fixed iteration count (100), not an exact solver;
- the student's output layer is one linear map d → |V| + k applied at *every* position; the last k
  outputs at the selected positions are the latent logits (the first |V| are computed and unused).
Use `mlsm` for real runs; this objective exists for benchmarks/bench_step_time.py and `mlsm flops`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModel, AutoModelForMaskedLM

from mlsm.config import POSITIVE, ranged
from mlsm.data.batches import Batch
from mlsm.data.corpus import require_same_tokenizer, tokenizer_hash
from mlsm.defaults import lam_range
from mlsm.errors import UserError
from mlsm.hf import first_line, load_model, load_tokenizer
from mlsm.models.backbone import Student
from mlsm.objectives.base import Context, Objective, ObjectiveOutput
from mlsm.objectives.kd import has_mlm_head
from mlsm.teacher.dictionary import load_dictionary
from mlsm.teacher.sparse_coding import fista
from mlsm.teacher.teacher import default_teacher_path, load_teacher


@dataclass
class MLSMNaiveConfig:
    name: Literal["mlsm_naive"] = "mlsm_naive"
    """Objective name (the tag of the objective group)."""
    dictionary: str = ""
    """Dictionary file from `mlsm dictionary` (PATH.safetensors + PATH.json)."""
    teacher: str = ""
    """Teacher model folder or hub id; empty = the packaged all-MiniLM-L6-v2."""
    layer: int = -1
    """Teacher layer l (0 = embeddings); -1 = the layer the dictionary was learned on."""
    lam: float = ranged(0.0, lam_range("the dictionary's λ"))
    """Sparse-coding λ; 0 = the λ the dictionary was learned with."""
    fista_iters: int = ranged(100, POSITIVE)
    """FISTA iterations per batch (the official code uses 100)."""


def load_full_teacher(path: str) -> tuple[nn.Module, object]:
    """(model, tokenizer) of the whole teacher, with its MLM head when the checkpoint has one."""
    try:
        tokenizer = load_tokenizer(path)
        cls = AutoModelForMaskedLM if has_mlm_head(path) else AutoModel
        model = load_model(cls, path)
    except Exception as exc:  # HF raises OSError, ValueError, HTTP errors, ...
        raise UserError(f"cannot load teacher {path!r} ({first_line(exc)}); "
                        "pass a local HF model folder") from None
    return model.eval().requires_grad_(False), tokenizer


class MLSMNaive(Objective):
    Config = MLSMNaiveConfig
    uses_teacher = predicts_latent = True
    latent_head = "naive"  # one d -> |V| + k map; its last k outputs are the latent logits
    flops_row = "MLSM (naive)"

    def __init__(self, cfg: MLSMNaiveConfig, ctx: Context):
        super().__init__()
        if not cfg.dictionary:
            raise UserError("objective.dictionary is not set; learn one with `mlsm dictionary` "
                            "and pass objective.dictionary=PATH")
        if cfg.fista_iters < 1:
            raise UserError(f"objective.fista_iters must be >= 1 (got {cfg.fista_iters}); "
                            "the official code uses 100")
        self.cfg = cfg
        self.dictionary = load_dictionary(cfg.dictionary, device=ctx.device)
        self.layer = cfg.layer if cfg.layer >= 0 else self.dictionary.layer
        model, tokenizer = load_full_teacher(cfg.teacher or str(default_teacher_path()))
        require_same_tokenizer(tokenizer, tokenizer_hash(ctx.tokenizer), ctx.store_path)
        n_layers = int(model.config.num_hidden_layers)
        if not 0 <= self.layer <= n_layers:
            raise UserError(f"teacher layer {self.layer} does not exist: the teacher has layers "
                            f"0..{n_layers}; set objective.layer")
        # the checks of every other latent objective (d, layer, init, the teacher's weights):
        # the truncated Teacher is loaded once more for them, then dropped
        teacher = load_teacher(cfg.teacher or None, self.layer)
        self.dictionary.check_teacher(teacher)
        teacher.check_length(ctx.max_len, "data.max_len")
        self._teacher = (model.to(ctx.device),)  # a tuple: frozen, not a submodule of the objective
        self.lam = cfg.lam or self.dictionary.lam
        self.atoms = self.dictionary.atoms.float()  # (d, k)
        self.k = self.dictionary.k
        self.vocab = len(ctx.tokenizer)

    @property
    def teacher(self) -> nn.Module:
        return self._teacher[0]

    def attach(self, student: Student) -> None:
        d = student.hidden_size  # d → |V| + k, as the official code
        self.add_head(self.latent_head, nn.Linear(d, self.vocab + self.k),
                      {"class": "Linear", "d": d, "out": self.vocab + self.k, "k": self.k,
                       "latent": "last k"})

    def targets(self, batch: Batch) -> torch.Tensor:
        """FISTA codes (N, k) of the full teacher's layer-l states at the selected positions."""
        with torch.autocast(batch.input_ids.device.type, enabled=False):
            out = self.teacher(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                               output_hidden_states=True)  # all L layers (+ (B, T, |V|) logits)
            x = F.normalize(out.hidden_states[self.layer][batch.selected].float(), dim=-1)  # (N, d)
            return fista(x, self.atoms, self.lam, n_iter=self.cfg.fista_iters)

    def codes(self, batch: Batch) -> torch.Tensor:
        with torch.no_grad():
            return self.targets(batch)

    def loss(self, hidden: torch.Tensor, targets: Any, batch: Batch) -> ObjectiveOutput:
        codes = targets  # (N, k)
        z_all = self.heads[self.latent_head](hidden)  # (B, T, |V| + k): every position, as HF
        z = z_all[batch.selected][:, -self.k :].float()  # (N, k): the latent part
        mass = codes.sum(1)  # (N,)
        keep = mass > 0  # all-zero codes carry no target
        p = codes[keep] / mass[keep, None]  # (M, k)
        kl = (torch.xlogy(p, p) - p * F.log_softmax(z[keep], dim=-1)).sum(1)  # (M,) KL(p ‖ q)
        metrics = {"kl": kl.sum().detach(), "dropped": (~keep).sum().float()}
        return ObjectiveOutput(kl.sum(), keep.sum(), metrics)
