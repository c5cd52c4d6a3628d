"""Heads evaluated only where there is something to predict (sparse prediction).

The HF masked-LM classes compute vocabulary logits at every position, (B, T, |V|); with 15 %
masking that wastes ~85 % of the largest matmul. Here the backbone output is gathered at the
selected positions first, (N, d), and the head runs on those rows only.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from mlsm.artifacts.checkpoint import Checkpoint
from mlsm.errors import UserError
from mlsm.hf import first_line

# model_type -> how that family's AutoModelForMaskedLM maps hidden states (N, d) to logits (N, V).
# One line per family; the functions call the HF modules themselves, so the weights (and any
# tying) are exactly those that `AutoModelForMaskedLM.from_pretrained` restores.
_MLM_HEADS: dict[str, Callable[[PreTrainedModel, torch.Tensor], torch.Tensor]] = {
    "bert": lambda m, h: m.cls(h),
    "roberta": lambda m, h: m.lm_head(h),
    "xlm-roberta": lambda m, h: m.lm_head(h),
    "distilbert": lambda m, h: m.vocab_projector(
        m.vocab_layer_norm(m.activation(m.vocab_transform(h)))
    ),
    "deberta-v2": lambda m, h: (m.cls(h) if hasattr(m, "cls")
                                else m.lm_predictions(h, m.deberta.embeddings.word_embeddings)),
    "modernbert": lambda m, h: m.decoder(m.head(h)),
    "electra": lambda m, h: m.generator_lm_head(m.generator_predictions(h)),
}


def mlm_head_fn(model: PreTrainedModel) -> Callable[[torch.Tensor], torch.Tensor]:
    """Return f(h) -> logits for an HF masked-LM model; h is (N, d), the result (N, |V|)."""
    kind = model.config.model_type
    if kind not in _MLM_HEADS:
        known = ", ".join(sorted(_MLM_HEADS))
        raise ValueError(f"no sparse MLM head for model_type {kind!r}; supported: {known}")
    fn = _MLM_HEADS[kind]
    return lambda h: fn(model, h)


class LatentHead(nn.Module):
    """MLSM's output layer: transform + d x k projection, no vocabulary: the Hitchhikers' Guide's
    change (its §3.1; Berend 2023 used an output layer of d x (|V| + k), `mlsm_naive`)."""

    def __init__(self, d: int, k: int, eps: float = 1e-12):
        super().__init__()
        self.dense = nn.Linear(d, d)
        self.act = nn.GELU()
        self.norm = nn.LayerNorm(d, eps=eps)
        self.proj = nn.Linear(d, k)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # (N, d) -> (N, k)
        return self.proj(self.norm(self.act(self.dense(h))))


def read_heads(folder: Path | Checkpoint) -> dict[str, torch.Tensor]:
    """The tensors of `folder/heads.safetensors` (loaded once per `Checkpoint`); a missing or
    damaged file is one line."""
    return _opened(folder).head_tensors


def _opened(folder: Path | str | Checkpoint) -> Checkpoint:
    return folder if isinstance(folder, Checkpoint) else Checkpoint.at(folder)


def checkpoint_objective(folder: Path) -> str | None:
    """The name of the objective that trained `folder`: the one checkpoint.json names (a
    checkpoint) or mlsm.json (an `mlsm export` folder; "probe" when it ships the probe's heads);
    None for a folder naming none (an HF folder that is not ours)."""
    return _opened(folder).objective


def latent_head_name(folder: Path) -> str:
    """The heads.json name of the latent head in `folder`, as the checkpoint records it (the
    objective that trained it declares it: `Objective.latent_head`)."""
    return _opened(folder).latent_head


def pll_refusal(folder: Path) -> str | None:
    """Why `folder` cannot be scored word by word through its encoder (recorded at save time from
    `Objective.pll_refusal_at`), or None; an HF folder that is not ours can be."""
    return _opened(folder).pll_refusal


def check_scored_by_pll(folder: Path) -> None:
    """Refuse, in one line, a checkpoint that cannot be scored word by word through its encoder
    (MAE-LM, MAE-MLSM, CLM, CLM -> MLM before its MLM phase, a probe of one)."""
    _opened(folder).require_pll()


def _last_k(weights: dict[str, torch.Tensor], d: int, k: int) -> nn.Linear:
    """The latent block of a d -> (|V| + k) linear head: its last k outputs, as a d -> k map."""
    head = nn.Linear(d, k)
    head.load_state_dict({"weight": weights["weight"][-k:], "bias": weights["bias"][-k:]})
    return head


def read_latent_head(folder: Path | Checkpoint) -> tuple[nn.Module, dict[str, Any]]:
    """The latent head saved in a checkpoint folder, (N, d) -> (N, k) latent logits, and its
    heads.json entry (the one loader: the probe objective and `ProbeScorer` both use it).

    The head is the one the checkpoint's objective declares (`latent_head_name`); heads.json says
    which class it is and its sizes, heads.safetensors holds its weights. MLSM's `LatentHead` is
    rebuilt as it is; of the naive recipe's d -> (|V| + k) `Linear` (entry `"latent": "last k"`)
    only the last k outputs are latent logits, so that block is returned as a d -> k `Linear`
    whose entry still says "last k" (of k: all of it), as a probe checkpoint saves it.
    """
    opened = _opened(folder)
    folder, name, heads = opened.folder, opened.latent_head, opened.heads_meta
    meta_path = folder / "heads.json"
    latent = heads.get(name) if isinstance(heads, dict) else None
    if not isinstance(latent, dict):
        raise UserError(f"{folder} has no latent head (no {name!r} in heads.json); "
                        "pass a checkpoint of an objective that predicts latent properties "
                        "(an mlsm run, for example)")
    kind = latent.get("class", "LatentHead")
    if kind == "SharedTransformLatent":
        raise UserError(f"{folder} holds an MTL latent head that shares the vocabulary head's "
                        f"transform ({kind}); score it through its vocabulary head, "
                        "it needs no probe")
    if kind not in ("LatentHead", "Linear") or (kind == "Linear"
                                                 and latent.get("latent") != "last k"):
        raise UserError(f"{meta_path} describes the latent head {name!r} as {kind}, which mlsm "
                        "cannot rebuild; pass a checkpoint written by this version of mlsm")
    weights = {k.removeprefix(f"{name}."): v for k, v in opened.head_tensors.items()
               if k.startswith(f"{name}.")}
    try:
        d, k = int(latent["d"]), int(latent["k"])
        if kind == "Linear":
            return _last_k(weights, d, k), {"class": "Linear", "d": d, "out": k, "k": k,
                                             "latent": "last k"}
        head = LatentHead(d, k)
        head.load_state_dict(weights)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise UserError(f"the latent head {name!r} of {folder} does not match its heads.json "
                        f"entry ({first_line(exc)}); restore the checkpoint from a copy or use "
                        "another one") from None
    return head, latent
