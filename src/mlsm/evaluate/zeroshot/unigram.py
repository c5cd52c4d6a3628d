"""The unigram-frequency control: a context-free model every minimal-pair and masked-token score
is read against.

p(w) = (c(w) + 1) / (N + |V|)   (add-one / Laplace smoothing over the whole vocabulary)

with c(w) the count of token id w in the text the model was pre-trained on: the chunks its run
consumes (`consumed_by`: the first steps x batch samples of its data order, so every arm of a seed
shares it), or a whole token store when one is named; N the number of tokens counted. One estimate
serves every control of a checkpoint (the probe's starting point, the held-out masked-token
baseline, the minimal-pair control), so they are read against the same unigram. A sentence's
score is the sum of log p(w) over its tokens (the tokenizer's ids without special tokens), so it
depends only on which tokens the sentence has, never on their order: on word-order pairs it ties
by construction, and on BLiMP it prefers the sentence made of more frequent (and fewer) tokens. A
pair is scored like a model's (`pair_credit`): right when good > bad, half right on a tie.

Why it matters (issue #32): at 10M tokens per arm this control scored 56.0 % on 6,700 BLiMP pairs,
above both trained students, so a BLiMP score is evidence of syntax only where it beats it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

_CHUNK = 1 << 24  # tokens per bincount: bounded memory on a store larger than RAM


def store_counts(store: Any, vocab: int, max_tokens: int | None = None) -> np.ndarray:
    """Count of every token id in the first max_tokens (None = all) of a TokenStore: (V,) int64."""
    tokens = store.tokens
    end = len(tokens) if max_tokens is None else min(len(tokens), max_tokens)
    counts = np.zeros(vocab, dtype=np.int64)
    for start in range(0, end, _CHUNK):
        chunk = np.asarray(tokens[start:min(end, start + _CHUNK)], dtype=np.int64)
        counts += np.bincount(chunk, minlength=vocab)[:vocab]
    return counts


def smoothed_log_probs(counts: np.ndarray) -> np.ndarray:
    """log (c + 1) / (N + V) of every id: (V,) float64."""
    c = counts.astype(np.float64) + 1.0
    return np.log(c / c.sum())


def consumed_counts(source: Any, n_samples: int, vocab: int, block: int = 4096) -> np.ndarray:
    """Counts (V,) int64 of the tokens in the chunks that global samples 0 .. n_samples - 1 of a
    `BatchSource` read: the text a run of n_samples sequences trains on, repeats included. The
    [CLS] / [SEP] framing and the separators between documents are not counted (a store's own
    tokens hold neither)."""
    counts = np.zeros(vocab, dtype=np.int64)
    for start in range(0, n_samples, block):
        chunks = source.chunk_ids(np.arange(start, min(n_samples, start + block), dtype=np.int64))
        body = source.chunk_tokens(chunks)[:, 1:-1]  # (b, max_len - 2)
        counts += np.bincount(body.ravel(), minlength=vocab)[:vocab]
    counts[[source.cls_id, source.sep_id]] = 0
    return counts


def run_unigram(checkpoint: str | Path) -> tuple[np.ndarray, Any, str]:
    """(counts (V,), tokenizer, description) of the tokens the pre-training run of `checkpoint`
    consumes over all its planned steps (its data config, store and order): the same for every
    readiness checkpoint of the run, and for every arm that shares its data seed and budget."""
    from mlsm.artifacts.checkpoint import Checkpoint
    from mlsm.artifacts.fingerprint import folder_fingerprint
    from mlsm.data.batches import BatchSource
    from mlsm.data.corpus import TokenStore
    from mlsm.run_config import config_from_dict

    cfg = config_from_dict(Checkpoint.at(checkpoint).config)
    store = TokenStore.open(cfg.data.store)
    tok = store.load_tokenizer()
    vocab = max(len(tok), int(store.meta.get("vocab_size") or 0))
    n = cfg.train.steps * cfg.train.batch_size
    # one count per run and store contents: a study's BLiMP stage asks for it once for the
    # control, once for the held-out baseline and once per readout control
    key = (folder_fingerprint(store.path), repr(cfg.data), n, vocab)  # by content, not by name
    if key not in _RUN_COUNTS:
        _RUN_COUNTS[key] = consumed_counts(BatchSource(store, cfg.data, tok), n, vocab)
    desc = f"{n:,} pre-training sequences of {store.path} (data.seed {cfg.data.seed})"
    return _RUN_COUNTS[key].copy(), tok, desc


_RUN_COUNTS: dict[tuple, np.ndarray] = {}


def unigram_log_probs(checkpoint: str | Path, vocab: int | None = None) -> torch.Tensor:
    """log p(token), add-one smoothed over `vocab` ids (default: all the counts cover), of the
    tokens the checkpoint's pre-training run consumes: (V,) float32 (the probe's starting point
    and the held-out masked-token baseline)."""
    counts = run_unigram(checkpoint)[0]
    if vocab is not None:
        counts = np.pad(counts[:vocab], (0, max(0, vocab - len(counts))))
    return torch.from_numpy(smoothed_log_probs(counts)).float()


def pair_credit(good: float, bad: float) -> float:
    """1 when the grammatical sentence scores higher, 0 when lower, 0.5 on an exact tie (a coin
    flip's expected credit: a context-free control ties on every word-order pair)."""
    return 1.0 if good > bad else 0.5 if good == bad else 0.0


class UnigramControl:
    """Sentence log-probabilities under the smoothed unigram model of a token store."""

    def __init__(self, counts: np.ndarray, tokenizer: Any, source: str = ""):
        self.counts = counts
        self.log_probs = smoothed_log_probs(counts)  # (V,)
        self.tokenizer = tokenizer
        self.source = source

    @classmethod
    def from_store(cls, path: str | Path, max_tokens: int | None = None) -> UnigramControl:
        """Counts of a token store (every token by default), scored with its own tokenizer."""
        from mlsm.data.corpus import TokenStore

        store = TokenStore.open(path)
        tok = store.load_tokenizer()
        vocab = max(len(tok), int(store.meta.get("vocab_size") or 0))
        return cls(store_counts(store, vocab, max_tokens), tok, str(path))

    @classmethod
    def consumed_by(cls, checkpoint: str | Path) -> UnigramControl:
        """Counts of the tokens the checkpoint's pre-training run consumes (`run_unigram`)."""
        return cls(*run_unigram(checkpoint))

    @property
    def n_tokens(self) -> int:
        return int(self.counts.sum())

    def token_ids(self, texts: Sequence[str]) -> list[list[int]]:
        return self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]

    def score(self, texts: Sequence[str]) -> list[float]:
        """Sum of log p(w) over each text's tokens (nats). `math.fsum` is exactly rounded, so
        the sum does not depend on the tokens' order: a pair of the same tokens in another order
        ties exactly (a float sum in token order differs in the last bits)."""
        return [math.fsum(self.log_probs[ids]) for ids in self.token_ids(texts)]

    def describe(self) -> dict[str, Any]:
        return {"source": self.source, "n_tokens": self.n_tokens, "vocab": len(self.counts),
                "smoothing": "add-one"}
