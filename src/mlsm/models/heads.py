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
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn
from transformers import PreTrainedModel

from mlsm.errors import UserError
from mlsm.hf import first_line, read_json

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
    """MLSM's output layer: transform + d x k projection (Berend 2023, §3), no vocabulary."""

    def __init__(self, d: int, k: int, eps: float = 1e-12):
        super().__init__()
        self.dense = nn.Linear(d, d)
        self.act = nn.GELU()
        self.norm = nn.LayerNorm(d, eps=eps)
        self.proj = nn.Linear(d, k)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # (N, d) -> (N, k)
        return self.proj(self.norm(self.act(self.dense(h))))


def read_heads(folder: Path) -> dict[str, torch.Tensor]:
    """The tensors of `folder/heads.safetensors`; a missing or damaged file is one line."""
    path = Path(folder) / "heads.safetensors"
    try:
        return load_file(path)
    except (OSError, SafetensorError, ValueError, RuntimeError) as exc:
        raise UserError(f"{path} is missing or damaged ({first_line(exc)}); restore it from a "
                        "copy or use another checkpoint of the run") from None


def read_latent_head(folder: Path) -> tuple[LatentHead, dict[str, Any]]:
    """The MLSM latent head saved in a checkpoint folder and its heads.json entry (the one loader:
    the probe objective and `ProbeScorer` both use it).

    heads.json says which class each head is and its sizes; the latent head is rebuilt from
    that entry and its weights from heads.safetensors.
    """
    meta_path = folder / "heads.json"
    latent = read_json(meta_path).get("latent") if meta_path.is_file() else None
    if not isinstance(latent, dict):
        raise UserError(f"{folder} has no MLSM latent head (heads.json); "
                        "pass a checkpoint of an mlsm/mtl run")
    if latent.get("class", "LatentHead") != "LatentHead":
        raise UserError(f"{folder} holds an MTL latent head that shares the vocabulary head's "
                        f"transform ({latent['class']}); score it through its vocabulary head, "
                        "it needs no probe")
    head = LatentHead(int(latent["d"]), int(latent["k"]))
    state = read_heads(folder)
    head.load_state_dict({k.removeprefix("latent."): v for k, v in state.items()
                          if k.startswith("latent.")})
    return head, latent
