"""MAE-LM's encoder/decoder split (Meng et al. 2024, "Representation deficiency in masked language
modeling", §4): selected positions are removed from the encoder input; a shallow bidirectional
decoder sees the encoder outputs scattered back to full length plus a [MASK] embedding at the
removed positions, adds position embeddings and predicts there.

Why the decoder is a small module of `nn.TransformerEncoderLayer`s and not the student's own HF
class with fewer layers: it must work identically behind every encoder family (BERT, RoBERTa,
DeBERTa-v2, ModernBERT have different layer signatures, mask formats and position schemes), it
must not carry an unused |V| x d embedding table, and it is one of the objective's heads, so it is
saved in heads.safetensors (exact resume) and described in heads.json — while the HF folder holds
the encoder only. Its output is projected back to the encoder width d, so the heads on top (the
decoder-owned vocabulary head here, MLSM's latent head) are the usual d-wide ones.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mlsm.data import masking
from mlsm.errors import UserError
from mlsm.models.backbone import Student

STREAM_DELTA = 11  # hash stream of the δ draws (masking.py uses 1-3)
DECODER, LM_HEAD = "mae_decoder", "mae_lm_head"


class MAEDecoder(nn.Module):
    """Encoder states (B, T, d) + removed mask (B, T) -> decoder states (B, T, d)."""

    def __init__(self, d: int, width: int, layers: int, heads: int, max_positions: int,
                 dropout: float = 0.0):
        super().__init__()
        if width % heads:
            raise UserError(f"objective.decoder_width={width} is not divisible by "
                            f"objective.decoder_heads={heads}")
        self.proj_in = nn.Linear(d, width) if width != d else nn.Identity()
        self.mask_embedding = nn.Parameter(torch.zeros(width))
        self.positions = nn.Embedding(max_positions, width)
        self.norm = nn.LayerNorm(width)
        # post-LN, GELU, 4w feed-forward: a BERT layer (Devlin et al. 2019), in plain torch
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(width, heads, 4 * width, dropout, activation="gelu",
                                       batch_first=True)
            for _ in range(layers)
        )
        self.proj_out = nn.Linear(width, d) if width != d else nn.Identity()
        nn.init.normal_(self.mask_embedding, std=0.02)
        nn.init.normal_(self.positions.weight, std=0.02)

    def forward(self, states: torch.Tensor, removed: torch.Tensor,
                attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.proj_in(states)  # (B, T, w)
        x = torch.where(removed[..., None], self.mask_embedding.to(x.dtype), x)
        pos = torch.arange(x.shape[1], device=x.device)
        x = self.norm(x + self.positions(pos)[None])  # absolute positions of the full sequence
        # packed batches have no padding: no mask lets attention take its unmasked fast path
        # (B, T), True = ignore
        pad = None if bool(attention_mask.all()) else ~attention_mask.bool()
        for layer in self.layers:
            x = layer(x, src_key_padding_mask=pad)
        return self.proj_out(x)  # (B, T, d)


class TiedLMHead(nn.Module):
    """Decoder-owned vocabulary head: transform + output matrix tied to the encoder's input
    embeddings (as BERT's head), + its own bias. An objective head, so it is saved and
    restored with the decoder; the HF MLM head of the student is never used by MAE-LM."""

    def __init__(self, d: int, vocab: int):
        super().__init__()
        self.dense = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.bias = nn.Parameter(torch.zeros(vocab))

    # (N, d) -> (N, V)
    def forward(self, h: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(F.gelu(self.dense(h))), embeddings, self.bias)


@dataclass
class EncoderSplit:
    """Kept tokens gathered left-aligned: the encoder's real inputs."""

    input_ids: torch.Tensor  # (B, K) kept tokens, K = max kept per row; pad_id beyond
    attention_mask: torch.Tensor  # (B, K) 1 for kept tokens
    positions: torch.Tensor  # (B, K) original position of each kept token
    removed: torch.Tensor  # (B, T) bool: positions the encoder does not see


def delta_keep(selected: torch.Tensor, samples: torch.Tensor, delta: float,
               seed: int) -> torch.Tensor:
    """Bool (B, T): selected positions kept in the encoder input as [MASK] (fraction δ).

    A pure function of (seed, global sample, position) like the masking itself, so resuming and
    objective-independent batches stay exact."""
    if delta <= 0:
        return torch.zeros_like(selected)
    u = masking.uniform(seed, STREAM_DELTA, samples.cpu().numpy(), selected.shape[1])
    return selected & torch.from_numpy(u < delta).to(selected.device)


def split_encoder_input(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        removed: torch.Tensor, pad_id: int) -> EncoderSplit:
    """Remove `removed` positions and left-align what is kept (original order preserved)."""
    kept = attention_mask.bool() & ~removed  # (B, T)
    n_kept = kept.sum(1)  # (B,)
    k = int(n_kept.max())
    # stable sort on "not kept" puts kept positions first, in their original order
    order = torch.sort((~kept).to(torch.int8), dim=1, stable=True).indices[:, :k]  # (B, K)
    valid = torch.arange(k, device=input_ids.device)[None, :] < n_kept[:, None]  # (B, K)
    ids = torch.where(valid, input_ids.gather(1, order), pad_id)
    return EncoderSplit(ids, valid.long(), order, removed)


def scatter_back(encoded: torch.Tensor, split: EncoderSplit, length: int) -> torch.Tensor:
    """Encoder states (B, K, d) -> (B, T, d) at their original positions; zeros where removed."""
    b, _, d = encoded.shape
    full = encoded.new_zeros(b, length, d)
    src = encoded * split.attention_mask[..., None].to(encoded.dtype)  # padding rows add nothing
    return full.scatter_add(1, split.positions[..., None].expand(-1, -1, d), src)


def _roberta_positions(config: Any, pos: torch.Tensor) -> torch.Tensor:
    return pos + config.pad_token_id + 1  # RoBERTa numbers positions from padding_idx + 1


# model_type -> explicit position ids for the kept tokens' original positions. DeBERTa-v2 is
# absent: its relative positions come from sequence indices and cannot be passed in; ELECTRA too:
# its input embeddings are narrower than the hidden states, so the tied LM head does not fit.
_POSITION_IDS: dict[str, Any] = {
    "bert": lambda c, p: p,
    "modernbert": lambda c, p: p,
    "roberta": _roberta_positions,
    "xlm-roberta": _roberta_positions,
}


def check_mae_support(student: Student) -> None:
    kind = student.config.model_type
    if kind not in _POSITION_IDS:
        raise UserError(f"MAE-LM needs explicit position ids, which model.arch={kind!r} does not "
                        f"take; use one of {', '.join(sorted(_POSITION_IDS))}")


def encoder_inputs(student: Student, split: EncoderSplit) -> dict[str, torch.Tensor]:
    """Student inputs for the kept tokens only, with their original position ids (B, K)."""
    check_mae_support(student)
    pos = _POSITION_IDS[student.config.model_type](student.config, split.positions)
    return {"input_ids": split.input_ids, "attention_mask": split.attention_mask,
            "position_ids": pos}


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Draw module initialisations from `seed` without disturbing the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


BASE_SIZE = 768  # hidden size from which a student counts as base-size (BERT/DeBERTa-base)


def default_decoder_layers(student: Student) -> int:
    """MAE-LM's decoder depth when objective.decoder_layers = 0: 4 for base-size students (Meng
    et al. 2024 use a 4-layer decoder with their base encoders), 2 for smaller ones."""
    return 4 if student.hidden_size >= BASE_SIZE else 2


def build_decoder(student: Student, layers: int, width: int, heads: int, max_len: int, seed: int,
                  dropout: float = 0.0) -> tuple[MAEDecoder, dict[str, Any]]:
    """The decoder for `student` and its heads.json description.

    layers = 0: `default_decoder_layers`. dropout: inside the decoder layers (Meng et al. 2024: 0).
    Initialised from its own seed: the loop seeds the backbone's init but not the global RNG
    before `attach`, and two fresh runs must start from the same decoder."""
    check_mae_support(student)
    d = student.hidden_size
    width = width or d
    heads = heads or int(student.config.num_attention_heads)
    layers = layers or default_decoder_layers(student)
    with seeded(seed):
        decoder = MAEDecoder(d, width, layers, heads, max_len, dropout)
    meta = {"class": "MAEDecoder", "d": d, "width": width, "layers": layers,
            "heads": heads, "max_positions": max_len, "dropout": dropout}
    return decoder, meta


def mae_split(input_ids: torch.Tensor, attention_mask: torch.Tensor, selected: torch.Tensor,
              keep_as_mask: torch.Tensor, mask_id: int, pad_id: int) -> EncoderSplit:
    """The encoder's kept tokens. selected: (B, T) positions to predict; keep_as_mask ⊆ selected
    stay in the encoder input as [MASK] (δ of Meng et al. 2024, §4.2); the rest is removed."""
    removed = selected & ~keep_as_mask  # (B, T)
    ids = torch.where(keep_as_mask, mask_id, input_ids)
    return split_encoder_input(ids, attention_mask, removed, pad_id)


def decode(decoder: MAEDecoder, encoded: torch.Tensor, split: EncoderSplit,
           attention_mask: torch.Tensor) -> torch.Tensor:
    """Encoder states of the kept tokens (B, K, d) -> decoder states (B, T, d) at full length."""
    full = scatter_back(encoded, split, attention_mask.shape[1])  # (B, T, d)
    return decoder(full, split.removed, attention_mask)
