"""The teacher states a dictionary is learned on: how they are drawn from a token store.

Two samplings, because the paper's code and ours differ here (docs/fidelity.md): ours draws
windows at random token positions, so every part of every document can be drawn; the official
`train_dict.py` reads its corpus from the top, one line at a time, until it has enough subtokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from mlsm.defaults import SAMPLINGS
from mlsm.errors import UserError
from mlsm.progress import Progress
from mlsm.teacher.teacher import Teacher

MIN_WORDS = 5  # `documents`: the official train_dict.py keeps lines of more than 4 words


def _windows(rng: np.random.Generator, tokens: Any, offsets: np.ndarray, width: int,
             batch_size: int) -> Iterator[list[np.ndarray]]:
    """Endless batches of windows starting at uniformly drawn token positions, each stopping at
    its document's end."""
    n_tokens = int(offsets[-1])
    while True:
        starts = rng.integers(0, n_tokens, size=batch_size)
        ends = np.minimum(starts + width, offsets[np.searchsorted(offsets, starts, side="right")])
        yield [np.asarray(tokens[s:e]) for s, e in zip(starts, ends, strict=True)]


def _documents(tokens: Any, offsets: np.ndarray, width: int, batch_size: int,
               words: Callable[[np.ndarray], int]) -> Iterator[list[np.ndarray]]:
    """Batches of the store's documents in order, each from its start (at most `width` tokens),
    skipping those of fewer than MIN_WORDS words; ends with the store."""
    batch: list[np.ndarray] = []
    for start, stop in zip(offsets[:-1], offsets[1:], strict=True):
        seq = np.asarray(tokens[int(start):min(int(stop), int(start) + width)])
        if len(seq) and words(seq) >= MIN_WORDS:
            batch.append(seq)
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


def _store_for(teacher: Teacher, store: Any) -> tuple[Any, np.ndarray]:
    """The store's (tokens, offsets), refused unless it was prepared with the teacher's tokenizer,
    holds only ids the teacher knows, and is not empty."""
    from mlsm.data.corpus import (  # the tokenizers stack
        check_token_ids,
        require_same_tokenizer,
        tokenizer_hash,
    )

    store_hash = tokenizer_hash(store.load_tokenizer())
    require_same_tokenizer(teacher.tokenizer, store_hash, str(getattr(store, "path", "")))
    tokens, offsets = store.tokens, np.asarray(store.offsets)
    check_token_ids(tokens, teacher.vocab_size, getattr(store, "path", "the store"),
                    f"teacher {teacher.name or ''}".strip())
    if int(offsets[-1]) == 0:
        raise UserError("the token store is empty; prepare it from a non-empty corpus")
    return tokens, offsets


def _unit_rows(h: torch.Tensor) -> torch.Tensor:
    """h's rows (m, d) scaled to unit ℓ2 norm, all-zero rows dropped; NaN/inf refused."""
    if not bool(torch.isfinite(h).all()):
        raise UserError("the teacher produced NaN/inf states; check the teacher checkpoint "
                        "(its weights may hold NaN/inf) or load it in float32")
    norms = h.norm(dim=1, keepdim=True)
    return (h / norms.clamp(min=1e-12))[norms.squeeze(1) > 0]


def collect_vectors(teacher: Teacher, store: Any, n: int, max_len: int = 128, seed: int = 0,
                    batch_size: int = 32, sampling: str = "windows") -> torch.Tensor:
    """n ℓ2-normalised layer-l teacher states (n, d) of a token store.

    `windows` (ours): windows of up to max_len − 2 tokens start at uniformly drawn token
    positions and stop at their document's end. `documents` (the official `train_dict.py`): each
    document of more than 4 words from its start, in store order, until n states, then shuffled
    (the official script reads a corpus of one text per line, encodes each line alone and keeps
    every position but [CLS] and the final [SEP]; build the store from such a file to match it).
    The teacher sees each sequence with its own special tokens, whose states (and padding) are
    excluded. Uses only store.tokens, store.offsets and store.load_tokenizer().
    """
    if n < 1:
        raise UserError(f"need at least 1 vector (got n={n}); pass a positive --n-vectors")
    if sampling not in SAMPLINGS:
        raise UserError(f"unknown sampling {sampling!r}; valid: {', '.join(SAMPLINGS)}")
    teacher.check_length(max_len, "--max-len")
    tokens, offsets = _store_for(teacher, store)
    rng = np.random.default_rng(seed)
    width = max(1, max_len - 2)  # room for the teacher's [CLS] … [SEP]
    batches = _windows(rng, tokens, offsets, width, batch_size) if sampling == "windows" else \
        _documents(tokens, offsets, width, batch_size,
                   lambda seq: len(teacher.tokenizer.decode(seq.tolist()).split()))
    out: list[torch.Tensor] = []
    got, empty = 0, 0
    bar = Progress(n, f"teacher layer {teacher.layer}", "vec")
    for seqs in batches:
        ids, mask, content = teacher.batch_from_ids(seqs)
        h = _unit_rows(teacher.hidden_states(ids, mask)[content.to(teacher.device)].float())
        empty = empty + 1 if h.shape[0] == 0 else 0
        if empty >= 20:  # nothing but special/unknown tokens: the loop would never end
            raise UserError("the token store yields no ordinary tokens for this teacher; check "
                            "that it was prepared with the teacher's tokenizer")
        out.append(h[: n - got].cpu())
        got += out[-1].shape[0]
        bar.update(out[-1].shape[0])
        if got >= n:
            break
    bar.close()
    if got < n:
        raise UserError(f"the store's documents of at least {MIN_WORDS} words hold only "
                        f"{got:,} states (< --n-vectors {n:,}); lower --n-vectors or use "
                        "--sampling windows")
    X = torch.cat(out)
    if sampling == "documents":  # in store order so far; the official script permutes them
        X = X[torch.from_numpy(rng.permutation(X.shape[0]))]
    return X
