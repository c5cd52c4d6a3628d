"""Pseudo-log-likelihood (PLL) scoring with masked language models.

PLL(W) = sum_t log P(w_t | W with w_t replaced by [MASK])      (Salazar et al. 2020, §2, Eq. 2)

Two variants:
- ``original``: exactly one token masked per copy (Salazar et al. 2020).
- ``within_word_l2r``: when scoring sub-token t of a word, also mask the sub-tokens of the same word
  to the right of t (Kauf & Ivanova 2023, "A Better Way to Do Masked Language Model Scoring", §3),
  which removes the inflation of multi-token words whose later pieces give the answer away.

Speed and memory, compared with one full masked-LM forward per sentence batch:
- the masked copies of many sentences are packed into batches under a token budget (B * T padded
  tokens), sentences sorted by length so that a batch holds similar lengths (little padding);
  a long sentence's copies are split over several batches, so memory is bounded on long inputs;
- the vocabulary head is applied at the single masked position of each copy only, (B, d) -> (B, V),
  instead of (B, T, V) logits for every position;
- identical sentences are scored once.

Any model works through the tiny `MaskedScorer` protocol; HF masked LMs get an adapter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, overload, runtime_checkable

import numpy as np
import torch

from mlsm.errors import UserError
from mlsm.limits import MAX_SENTENCE_CHARS
from mlsm.progress import Progress

Variant = Literal["original", "within_word_l2r"]
VARIANTS: tuple[str, ...] = ("original", "within_word_l2r")


@runtime_checkable
class MaskedScorer(Protocol):
    """Anything that can predict the vocabulary at chosen positions of a (partly masked) batch.

    `input_ids`, `attention_mask`: (B, T) long; `select`: (B, T) bool. Returns logits (N, |V|) with
    N = select.sum(), rows in row-major order of `select` (what `hidden[select]` gives). Logits need
    not be normalised: PLL applies log-softmax itself. MLSM models implement this through their
    linear probe; HF masked LMs through `HFMaskedLMScorer`.
    """

    def logits_at(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, select: torch.Tensor
    ) -> torch.Tensor: ...


class HFMaskedLMScorer:
    """`MaskedScorer` adapter for an HF ``AutoModelForMaskedLM`` model.

    Runs the base model, gathers the selected positions and applies the family's own MLM head there
    only (`mlsm.models.heads.mlm_head_fn`). Families without a sparse head fall back to the model's
    full forward, (B, T, V) logits, then select: correct, just slower.
    """

    def __init__(self, model: torch.nn.Module):
        from mlsm.models.heads import mlm_head_fn

        self.model = model
        try:
            self._head = mlm_head_fn(model)
        except ValueError:
            self._head = None

    def logits_at(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, select: torch.Tensor
    ) -> torch.Tensor:
        if self._head is None:
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits
            return logits[select]  # (B, T, V) -> (N, V)
        out = self.model.base_model(input_ids=input_ids, attention_mask=attention_mask)
        hidden = out.last_hidden_state  # (B, T, d)
        return self._head(hidden[select])  # (N, d) -> (N, V)


def as_scorer(model: Any) -> MaskedScorer:
    """Return `model` itself if it implements `MaskedScorer`, else wrap an HF masked LM."""
    if callable(getattr(model, "logits_at", None)):
        return model
    config = getattr(model, "config", None)
    if isinstance(model, torch.nn.Module) and config is not None and hasattr(model, "base_model"):
        return HFMaskedLMScorer(model)
    raise UserError(
        f"cannot score with a {type(model).__name__}: pass an HF AutoModelForMaskedLM "
        "or an object with logits_at(input_ids, attention_mask, select)"
    )


def load_masked_lm(path: str, device: str | torch.device | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) of an HF masked-LM folder, in eval mode on `device`; `mlsm.hf` loads it
    (and words the UserError if it cannot). An mlsm checkpoint whose objective is not
    `scored_by_pll` (MAE-LM: its vocabulary head would load untrained) is refused in one line."""
    from pathlib import Path

    from transformers import AutoModelForMaskedLM

    from mlsm.hf import load_model, load_tokenizer
    from mlsm.models.heads import check_scored_by_pll

    check_scored_by_pll(Path(path))
    model, tokenizer = load_model(AutoModelForMaskedLM, path), load_tokenizer(path)
    return (model.to(device) if device is not None else model).eval(), tokenizer


@dataclass(frozen=True)
class TokenScores:
    """Per-token PLL terms of one sentence; `log_probs[j]` scores `tokens[j]` at `positions[j]`."""

    sentence: str
    tokens: list[str]
    token_ids: list[int]
    positions: list[int]
    log_probs: list[float]

    @property
    def total(self) -> float:
        return float(sum(self.log_probs))


class SentenceTooLong(UserError):
    """Sentence `index` (of those given) has more tokens than the model has positions: PLL would
    index past its position embeddings. A caller that knows where the sentence came from (BLiMP:
    its phenomenon and pair) says so in its own line."""

    def __init__(self, index: int, n_tokens: int, limit: int) -> None:
        super().__init__(f"sentence {index} has {n_tokens} tokens, more than the model's {limit} "
                         "positions: split it")
        self.index, self.n_tokens, self.limit = index, n_tokens, limit


@dataclass
class _Item:
    """One distinct tokenised sentence: ids (L,), scored positions (n,), word index per token
    (L,)."""

    ids: torch.Tensor
    targets: torch.Tensor
    words: torch.Tensor


def _word_index(word_ids: list[int | None]) -> torch.Tensor:
    # Special tokens (None) get -1; they are never targets, so they never join a target's word.
    return torch.tensor([-1 if w is None else w for w in word_ids], dtype=torch.long)


def _encode(
    tokenizer: Any, sentences: Sequence[str], variant: str, max_len: int | None
) -> tuple[list[_Item], list[int]]:
    """Tokenise with special tokens; return distinct items and, per sentence, its item index."""
    if variant == "within_word_l2r" and not getattr(tokenizer, "is_fast", False):
        raise UserError("variant within_word_l2r needs word boundaries: load a fast tokenizer")
    # verbose=False: the length check below is the one line; transformers' own warning about
    # a sequence longer than the model is noise before it
    enc = tokenizer(list(sentences), add_special_tokens=True, return_special_tokens_mask=True,
                    verbose=False)
    items: list[_Item] = []
    seen: dict[tuple, int] = {}
    which: list[int] = []
    for i, ids in enumerate(enc["input_ids"]):
        if max_len is not None and len(ids) > max_len:
            raise SentenceTooLong(i, len(ids), max_len)
        words = _word_index(enc.word_ids(i)) if variant == "within_word_l2r" else None
        key = (tuple(ids), None if words is None else tuple(words.tolist()))
        if key not in seen:
            special = torch.tensor(enc["special_tokens_mask"][i], dtype=torch.bool)
            targets = torch.nonzero(~special).flatten()  # (n,) positions to score
            ids_t = torch.tensor(ids, dtype=torch.long)
            seen[key] = len(items)
            items.append(_Item(ids_t, targets, words if words is not None else ids_t.new_empty(0)))
        which.append(seen[key])
    return items, which


def _plan(
    items: Sequence[_Item], token_budget: int, max_rows: int
) -> list[list[tuple[int, int, int]]]:
    """Group the masked copies into batches of (item, first copy, end copy) segments.

    Items are visited longest first, so each batch holds similar lengths and the largest batch
    comes first (an out-of-memory shows at once). A batch keeps rows * width <= token_budget
    (at least one row) and rows <= max_rows, which bounds the (rows, |V|) logits too.
    """
    order = sorted(range(len(items)), key=lambda k: -len(items[k].ids))
    batches: list[list[tuple[int, int, int]]] = []
    batch: list[tuple[int, int, int]] = []
    rows = width = 0
    for k in order:
        n, length = len(items[k].targets), len(items[k].ids)
        start = 0
        while start < n:
            w = max(width, length)
            room = min(max_rows, max(1, token_budget // w)) - rows
            if room <= 0:
                batches.append(batch)
                batch, rows, width = [], 0, 0
                continue
            take = min(room, n - start)
            batch.append((k, start, start + take))
            rows, width, start = rows + take, w, start + take
    if batch:
        batches.append(batch)
    return batches


def _mask_rows(item: _Item, targets: torch.Tensor, variant: str) -> torch.Tensor:
    """Which tokens each copy hides: (n, L) bool, one row per target position."""
    length = len(item.ids)
    if variant == "original":
        hide = torch.zeros(len(targets), length, dtype=torch.bool)
        hide[torch.arange(len(targets)), targets] = True
        return hide
    # within_word_l2r (Kauf & Ivanova 2023): same word as the target and at or right of it.
    same_word = item.words[None, :] == item.words[targets][:, None]  # (n, L)
    right = torch.arange(length)[None, :] >= targets[:, None]  # (n, L)
    return same_word & right


def _build_batch(
    items: Sequence[_Item], segments: list[tuple[int, int, int]], variant: str, mask_id: int,
    pad_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded masked copies: input_ids, attention_mask, select (B, T) and true ids (B,)."""
    n_rows = sum(end - start for _, start, end in segments)
    width = max(len(items[k].ids) for k, _, _ in segments)
    input_ids = torch.full((n_rows, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n_rows, width), dtype=torch.long)
    select = torch.zeros((n_rows, width), dtype=torch.bool)
    truth = torch.empty(n_rows, dtype=torch.long)
    row = 0
    for k, start, end in segments:
        item, n = items[k], end - start
        targets = item.targets[start:end]  # (n,)
        length = len(item.ids)
        block = input_ids[row : row + n, :length]  # a view: writes land in input_ids
        block[:] = item.ids
        block[_mask_rows(item, targets, variant)] = mask_id
        attention[row : row + n, :length] = 1
        select[torch.arange(row, row + n), targets] = True
        truth[row : row + n] = item.ids[targets]
        row += n
    return input_ids, attention, select, truth


def _device_of(model: Any, device: str | torch.device | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    module = model.model if isinstance(model, HFMaskedLMScorer) else model
    if isinstance(module, torch.nn.Module):
        param = next(module.parameters(), None)
        if param is not None:
            return param.device
    return torch.device(getattr(module, "device", None) or "cpu")


@contextlib.contextmanager
def _eval_mode(model: Any) -> Iterator[None]:
    """Dropout off while scoring; the caller's train/eval flag is restored afterwards."""
    module = model.model if isinstance(model, HFMaskedLMScorer) else model
    if not isinstance(module, torch.nn.Module):
        yield
        return
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)


def _special_ids(tokenizer: Any) -> tuple[int, int]:
    mask_id = getattr(tokenizer, "mask_token_id", None)
    if mask_id is None:
        raise UserError("the tokenizer has no mask token: PLL needs a masked-LM tokenizer")
    pad_id = getattr(tokenizer, "pad_token_id", None)
    return mask_id, pad_id if pad_id is not None else mask_id


def _model_max_len(tokenizer: Any, scorer: Any) -> int | None:
    module = scorer.model if isinstance(scorer, HFMaskedLMScorer) else scorer
    limit = getattr(getattr(module, "config", None), "max_position_embeddings", None)
    tok_limit = getattr(tokenizer, "model_max_length", None)
    if tok_limit is not None and tok_limit < 1_000_000:
        limit = tok_limit if limit is None else min(limit, tok_limit)
    return limit


def _score_items(
    scorer: MaskedScorer, items: Sequence[_Item], variant: str, mask_id: int, pad_id: int,
    token_budget: int, max_rows: int, device: torch.device, progress: bool | None,
) -> list[np.ndarray]:
    """log P(true token) at every target of every item: one float64 array (n,) per item."""
    out = [np.zeros(len(it.targets), dtype=np.float64) for it in items]
    batches = _plan(items, token_budget, max_rows)
    total = sum(len(it.targets) for it in items)
    bar = Progress(total, "PLL", "copy", enabled=progress)
    for segments in batches:
        ids, attention, select, truth = _build_batch(items, segments, variant, mask_id, pad_id)
        logits = scorer.logits_at(ids.to(device), attention.to(device), select.to(device))
        logits = logits.float()  # (B, V); log-softmax in fp32 even for half models
        truth = truth.to(logits.device)
        # log p(true) = z_true - logsumexp(z): no (B, V) log-softmax tensor is materialised.
        logp = logits.gather(1, truth[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)
        logp = logp.double().cpu().numpy()
        row = 0
        for k, start, end in segments:
            out[k][start:end] = logp[row : row + end - start]
            row += end - start
        bar.update(len(truth))
    bar.close()
    return out


def _special_frame(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The special ids the tokenizer puts before and after one sequence ([CLS] / [SEP] for BERT,
    <s> / </s> for RoBERTa), read off the encoding of a probe text with and without them
    (transformers 5 tokenizers have no build_inputs_with_special_tokens)."""
    for probe in ("a", "the", "0", "."):
        plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
        full = tokenizer(probe)["input_ids"]
        for k in range(len(full) - len(plain) + 1):
            if plain and full[k : k + len(plain)] == plain:
                return list(full[:k]), list(full[k + len(plain) :])
    raise UserError("cannot tell where this tokenizer puts its special tokens; score text with "
                    "score_pll instead")


def _items_from_ids(
    tokenizer: Any, sequences: Sequence[Sequence[int]], words: Sequence[Sequence[int]] | None,
    max_len: int | None,
) -> list[_Item]:
    """One item per sequence of token ids (no special tokens): the tokenizer's own special
    tokens go around each and are never scored."""
    before, after = _special_frame(tokenizer)
    items = []
    for i, seq in enumerate(sequences):
        ids = [*before, *seq, *after]
        if max_len is not None and len(ids) > max_len:
            raise UserError(f"sequence {i} has {len(ids)} tokens with its special tokens, more "
                            f"than the model's {max_len}: cut it shorter")
        targets = torch.arange(len(before), len(before) + len(seq))  # (n,) its own tokens
        word = torch.full((len(ids),), -1, dtype=torch.long)
        if words is not None:
            word[targets] = torch.as_tensor(list(words[i]), dtype=torch.long)
        items.append(_Item(torch.tensor(ids, dtype=torch.long), targets, word))
    return items


def score_token_ids(
    model: Any,
    tokenizer: Any,
    sequences: Sequence[Sequence[int]],
    *,
    words: Sequence[Sequence[int]] | None = None,
    variant: Variant = "original",
    token_budget: int = 8192,
    max_rows: int = 512,
    device: str | torch.device | None = None,
    progress: bool | None = False,
) -> list[np.ndarray]:
    """PLL terms of already tokenised sequences: per sequence, a float64 array of log P(token |
    the masked copy) for each of its tokens, in order (`score_pll` sums them).

    sequences: token ids WITHOUT special tokens (the tokenizer adds its own; they are never
    scored) — what a token store holds, or a text cut to a token budget. words: for
    ``within_word_l2r``, a word index per token (equal for the pieces of one word, as the fast
    tokenizer's ``word_ids()``). The other arguments are `score_pll`'s.
    """
    if variant not in VARIANTS:
        raise UserError(f"unknown PLL variant {variant!r}: use one of {', '.join(VARIANTS)}")
    if variant == "within_word_l2r" and words is None:
        raise UserError("variant within_word_l2r needs the word index of every token (words=)")
    if words is not None and [len(w) for w in words] != [len(s) for s in sequences]:
        raise UserError("words= must give one word index per token of each sequence")
    if token_budget < 1 or max_rows < 1:
        raise UserError("token_budget and max_rows must be positive integers")
    scorer = as_scorer(model)
    mask_id, pad_id = _special_ids(tokenizer)
    items = _items_from_ids(tokenizer, sequences, words, _model_max_len(tokenizer, scorer))
    with _eval_mode(scorer), torch.inference_mode():
        return _score_items(scorer, items, variant, mask_id, pad_id, token_budget, max_rows,
                            _device_of(scorer, device), progress)


def _checked_sentences(sentences: Sequence[str] | str, max_chars: int) -> Sequence[str]:
    """The sentences as a list of text, each refused before tokenisation if it is not a str or
    is longer than max_chars (a 100 MB "sentence" took gigabytes in the tokeniser)."""
    if isinstance(sentences, str):
        sentences = [sentences]
    bad = next((i for i, x in enumerate(sentences) if not isinstance(x, str)), None)
    if bad is not None:
        raise UserError(f"sentence {bad} is a {type(sentences[bad]).__name__}, not text; pass a "
                        "list of strings")
    long = next((i for i, x in enumerate(sentences) if len(x) > max_chars), None)
    if long is not None:
        raise UserError(f"sentence {long} has {len(sentences[long]):,} characters, more than the "
                        f"limit of {max_chars:,} (--max-sentence-chars); split it, or raise the "
                        "limit if it is meant to be one sentence")
    return sentences


@overload
def score_pll(
    model: Any, tokenizer: Any, sentences: Sequence[str], *, variant: Variant = ...,
    token_budget: int = ..., max_rows: int = ..., device: str | torch.device | None = ...,
    per_token: Literal[False] = ..., progress: bool | None = ..., max_chars: int = ...,
) -> list[float]: ...
@overload
def score_pll(
    model: Any, tokenizer: Any, sentences: Sequence[str], *, variant: Variant = ...,
    token_budget: int = ..., max_rows: int = ..., device: str | torch.device | None = ...,
    per_token: Literal[True], progress: bool | None = ..., max_chars: int = ...,
) -> list[TokenScores]: ...
def score_pll(
    model: Any,
    tokenizer: Any,
    sentences: Sequence[str],
    *,
    variant: Variant = "original",
    token_budget: int = 8192,
    max_rows: int = 512,
    device: str | torch.device | None = None,
    per_token: bool = False,
    progress: bool | None = False,
    max_chars: int = MAX_SENTENCE_CHARS,
) -> list[float] | list[TokenScores]:
    """Pseudo-log-likelihood (natural log) of each sentence, in input order.

    model: an HF ``AutoModelForMaskedLM`` or any `MaskedScorer`. tokenizer: the model's tokenizer
    (special tokens are added and never scored). token_budget: padded tokens per forward pass
    (rows * longest row); max_rows: cap on masked copies per pass (bounds the (rows, |V|) logits).
    device: where inputs go; default the model's. per_token: return `TokenScores` per sentence
    instead of floats. progress: None = a tqdm bar on a TTY, plain lines every 30 s otherwise
    (`mlsm.progress`); False = none. max_chars: a longer sentence is refused before anything
    is tokenised (a 100 MB "sentence" took gigabytes in the tokeniser).
    """
    if variant not in VARIANTS:
        raise UserError(f"unknown PLL variant {variant!r}: use one of {', '.join(VARIANTS)}")
    if token_budget < 1 or max_rows < 1:
        raise UserError("token_budget and max_rows must be positive integers")
    sentences = _checked_sentences(sentences, max_chars)
    scorer = as_scorer(model)
    mask_id, pad_id = _special_ids(tokenizer)
    items, which = _encode(tokenizer, sentences, variant, _model_max_len(tokenizer, scorer))
    dev = _device_of(scorer, device)
    with _eval_mode(scorer), torch.inference_mode():
        terms = _score_items(
            scorer, items, variant, mask_id, pad_id, token_budget, max_rows, dev, progress
        )
    if not per_token:
        return [float(terms[k].sum()) for k in which]
    result = []
    for sentence, k in zip(sentences, which, strict=True):
        ids = items[k].ids[items[k].targets].tolist()
        result.append(
            TokenScores(
                sentence=sentence,
                tokens=tokenizer.convert_ids_to_tokens(ids),
                token_ids=ids,
                positions=items[k].targets.tolist(),
                log_probs=terms[k].tolist(),
            )
        )
    return result
