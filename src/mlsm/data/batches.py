"""Deterministic, resumable, shardable batches packed from a token store.

Packing (RoBERTa's FULL-SENTENCES policy, Liu et al. 2019): documents are read as one stream in
which every document is followed by a separator token; the stream is cut into chunks of
max_len - 2 tokens, and each chunk becomes `[CLS] chunk [SEP]`. A sequence may therefore span a
document boundary, marked by the inner separator; no padding is ever needed and no token is
wasted except the final partial chunk.

Order: global sample g (the g-th sequence the run consumes) is chunk perm_e[g mod N] of epoch
e = g div N, where perm_e is a permutation seeded by (data.seed, e). Step s of a run with global
batch G consumes samples s*G ... (s+1)*G - 1. Selected positions and their corruption are pure
functions of (data.seed, g) (see masking.py). So the batches depend only on data.seed and the step,
are byte-identical across objectives, cost O(1) to resume at any step, and split across ranks and
accumulation steps without changing their contents.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, fields

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from mlsm.config import DataConfig
from mlsm.data import masking
from mlsm.data.corpus import TokenStore, require_mask_token
from mlsm.errors import UserError


@dataclass
class Batch:
    """One micro-batch. Every tensor is (B, T) unless noted."""

    input_ids: torch.Tensor  # original tokens, special tokens included
    attention_mask: torch.Tensor  # 1 for real tokens (always all ones with packing)
    special_mask: torch.Tensor  # bool: [CLS], [SEP], padding
    selected: torch.Tensor  # bool: positions to predict (data.mask_rate)
    corrupted_ids: torch.Tensor  # input_ids with selected positions corrupted per data.mask_split
    samples: torch.Tensor  # (B,) global sample indices
    chunks: torch.Tensor  # (B,) which packed chunk of the store each row is (fixed contents)
    step: int  # optimizer step this batch belongs to

    def digest(self) -> int:
        """Sum of per-sequence CRC32s of (ids, selection, corruption): equal for equal contents
        however the global batch is split into micro-batches and ranks."""
        rows = torch.cat([self.input_ids, self.selected.long(), self.corrupted_ids],
                         1).cpu().numpy()
        return sum(zlib.crc32(row.tobytes()) for row in rows)

    def to(self, device: torch.device | str) -> Batch:
        moved = {
            f.name: getattr(self, f.name).to(device, non_blocking=True)
            if isinstance(getattr(self, f.name), torch.Tensor) else getattr(self, f.name)
            for f in fields(self)
        }
        return Batch(**moved)


def _special_ids(tok: PreTrainedTokenizerBase) -> tuple[int, int, int]:
    cls_id = tok.cls_token_id if tok.cls_token_id is not None else tok.bos_token_id
    sep_id = tok.sep_token_id if tok.sep_token_id is not None else tok.eos_token_id
    if cls_id is None or sep_id is None:
        raise UserError("tokenizer has no [CLS]/<s> or [SEP]/</s> token; "
                        "train one with `mlsm train-tokenizer`")
    require_mask_token(tok)
    return cls_id, sep_id, tok.mask_token_id


class Masker:
    """Selection and corruption of token rows, as pure functions of (data.seed, sample index).

    What `BatchSource` does to its packed chunks, for rows from anywhere (an HF dataset read by
    `mlsm.integrations.transformers.MLSMCollator`): equal (ids, sample indices, seed) give equal
    batches. [CLS], [SEP] and padding are never selected.
    """

    def __init__(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase):
        if abs(sum(cfg.mask_split) - 1.0) > 1e-6 or len(cfg.mask_split) != 3:
            raise UserError(f"data.mask_split={cfg.mask_split} must be 3 fractions summing to 1, "
                            "e.g. [0.8, 0.1, 0.1]")
        if not 0.0 < cfg.mask_rate < 1.0:
            raise UserError(f"data.mask_rate={cfg.mask_rate} must be in (0, 1), e.g. 0.15")
        self.cfg = cfg
        self.cls_id, self.sep_id, self.mask_id = _special_ids(tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.sep_id
        specials = set(tokenizer.all_special_ids)
        self.normal_ids = np.array([i for i in range(len(tokenizer)) if i not in specials],
                                   dtype=np.int64)

    def batch(self, ids: np.ndarray, samples: np.ndarray, step: int,
              chunks: np.ndarray | None = None,
              attention_mask: np.ndarray | None = None) -> Batch:
        """The Batch of rows `ids` (B, T) that are global samples `samples` (B,); chunks: which
        packed chunk of a token store each row is (-1: none); attention_mask: 1 for real tokens
        (default all ones: packed rows have no padding)."""
        cfg = self.cfg
        special = (ids == self.cls_id) | (ids == self.sep_id) | (ids == self.pad_id)
        if attention_mask is None:
            attention_mask = np.ones(ids.shape, dtype=np.int64)
        special |= attention_mask == 0
        selected = masking.select_positions(cfg.seed, samples, special, cfg.mask_rate,
                                            cfg.exact_count)
        corrupted = masking.corrupt(
            cfg.seed, samples, ids, selected, tuple(cfg.mask_split), self.mask_id, self.normal_ids
        )
        chunks = np.full(len(ids), -1, dtype=np.int64) if chunks is None else chunks
        return Batch(
            input_ids=torch.from_numpy(ids),
            attention_mask=torch.from_numpy(attention_mask.astype(np.int64)),
            special_mask=torch.from_numpy(special),
            selected=torch.from_numpy(selected),
            corrupted_ids=torch.from_numpy(corrupted),
            samples=torch.from_numpy(samples.astype(np.int64)),
            chunks=torch.from_numpy(chunks.astype(np.int64)),
            step=step,
        )


class BatchSource:
    """Maps (step, slice of the global batch) to a Batch.

    Stateless apart from a permutation cache.
    """

    def __init__(self, store: TokenStore, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase):
        if cfg.max_len < 8:
            raise UserError(f"data.max_len={cfg.max_len} is too short; use at least 8")
        self.masker = Masker(cfg, tokenizer)
        self.store, self.cfg = store, cfg
        self.cls_id, self.sep_id, self.mask_id = (self.masker.cls_id, self.masker.sep_id,
                                                  self.masker.mask_id)
        self.chunk = cfg.max_len - 2
        # Virtual stream = documents each followed by [SEP]; doc j starts at offsets[j] + j in it.
        self.vstart = store.offsets[:-1] + np.arange(store.n_docs, dtype=np.int64)
        self.n_sequences = (store.n_tokens + store.n_docs) // self.chunk
        if self.n_sequences == 0:
            raise UserError(f"token store {store.path} has fewer than {self.chunk} tokens; "
                            "add text or lower data.max_len")
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            rng = np.random.Generator(np.random.PCG64([self.cfg.seed, epoch]))
            self._perm, self._perm_epoch = rng.permutation(self.n_sequences), epoch
        return self._perm

    def chunk_ids(self, samples: np.ndarray) -> np.ndarray:
        """Which packed chunk each global sample index reads, (B,)."""
        chunks = np.empty(len(samples), dtype=np.int64)
        for epoch in np.unique(samples // self.n_sequences):  # usually one epoch per batch
            here = samples // self.n_sequences == epoch
            chunks[here] = self._permutation(int(epoch))[samples[here] % self.n_sequences]
        return chunks

    def chunk_tokens(self, chunks: np.ndarray) -> np.ndarray:
        """Token ids (B, max_len) of packed chunks: [CLS] + max_len - 2 stream tokens + [SEP]."""
        vpos = chunks[:, None] * self.chunk + np.arange(self.chunk)[None, :]  # (B, C)
        doc = np.searchsorted(self.vstart, vpos, side="right") - 1
        real = vpos - doc  # position in the token array, if not a separator
        is_sep = real >= self.store.offsets[doc + 1]
        body = np.where(is_sep, self.sep_id,
                        self.store.tokens[np.minimum(real, self.store.n_tokens - 1)])
        ids = np.empty((len(chunks), self.cfg.max_len), dtype=np.int64)
        ids[:, 0], ids[:, -1], ids[:, 1:-1] = self.cls_id, self.sep_id, body
        return ids

    def batch(self, samples: np.ndarray, step: int) -> Batch:
        chunks = self.chunk_ids(samples)
        return self.masker.batch(self.chunk_tokens(chunks), samples, step, chunks)

    def micro_batches(self, step: int, batch_size: int, micro: int, rank: int = 0,
                      world: int = 1) -> list[Batch]:
        """This rank's micro-batches of global step `step` (global batch `batch_size`)."""
        if batch_size % (world * micro):
            raise UserError(
                f"train.batch_size={batch_size} is not divisible by world size {world} x "
                f"train.micro_batch_size={micro}; change one of them"
            )
        per_rank = batch_size // world
        start = step * batch_size + rank * per_rank
        samples = np.arange(start, start + per_rank, dtype=np.int64)
        return [self.batch(samples[i : i + micro], step) for i in range(0, per_rank, micro)]
