"""Extractive QA for `mlsm finetune`: windows over long contexts, start/end labels, the loss and
n-best span decoding (SQuAD v1.1 and v2.0).

Windows: the fast tokenizer cuts (question, context) pairs with ``truncation="only_second"``,
``return_overflowing_tokens`` and ``stride`` (tokens shared by consecutive windows), and maps
every context token to its characters (``return_offsets_mapping``), as BERT's SQuAD recipe does
(Devlin et al. 2019, §4.2-4.3). A training window is labelled with the token span of the first
gold answer, or with position 0 (the [CLS] token) when the answer is not wholly inside it or the
question has none. The head is a per-token linear d -> 2 (start, end logits), drawn like every
fine-tuning head from (seed, task, d) alone (`finetune.build_head`).

Decoding: in every window, the ``n_best`` highest-scoring spans (start logit + end logit) whose
ends are context tokens, end >= start, at most ``max_answer_tokens`` long; the best over the
example's windows is the answer. SQuAD 2.0 also keeps the null score (start + end logit of
position 0, the lowest over the windows): the no-answer score is null − best span score, and the
answer is "" when it exceeds ``null_threshold``. SQuAD 1.1 has no unanswerable question, so its
answer is always the best span, however high the null score (the v1.1 protocol of BERT's
``run_squad.py``); the task says which (`TaskSpec.unanswerable`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from mlsm.errors import UserError
from mlsm.evaluate.finetune.qa_data import QAExample
from mlsm.evaluate.finetune.qa_metrics import squad_v1_metrics, squad_v2_metrics


@dataclass(frozen=True)
class QASettings:
    """Windowing and decoding settings of the QA tasks (one place; docs/finetune.md)."""

    stride_fraction: float = 1 / 3
    """Tokens shared by consecutive windows, as a fraction of --max-len (BERT's SQuAD recipe:
    128 of 384)."""
    max_question_tokens: int = 64
    """Questions are cut to this many tokens (BERT's max_query_length), and further where needed
    to leave 2 x stride context tokens in a window."""
    n_best: int = 20
    """Candidate spans kept per window (and per question over its windows)."""
    max_answer_tokens: int = 30
    """Longest answer span, in tokens."""
    null_threshold: float = 0.0
    """SQuAD 2.0: answer "" when null score − best span score exceeds this (SQuAD 1.1 always
    answers its best span)."""


SETTINGS = QASettings()


def stride_for(max_len: int, settings: QASettings = SETTINGS) -> int:
    """The window overlap in tokens for windows of ``max_len`` tokens."""
    return int(max_len * settings.stride_fraction)


def _questions(tokenizer: Any, examples: Sequence[QAExample], limit: int) -> list[str]:
    """Questions cut after ``limit`` tokens (at the character where token ``limit`` starts)."""
    enc = tokenizer([ex.question for ex in examples], add_special_tokens=False,
                    return_offsets_mapping=True)
    return [ex.question if len(offs) <= limit else ex.question[:offs[limit][0]]
            for ex, offs in zip(examples, enc["offset_mapping"], strict=True)]


def _label(offsets: list[tuple[int, int]], context_ids: np.ndarray,
           answer: tuple[str, int] | None) -> tuple[int, int]:
    """(start token, end token) of the answer's characters in one window; (0, 0) when absent."""
    if answer is None:
        return 0, 0
    start, end = answer[1], answer[1] + len(answer[0])
    first, last = int(context_ids[0]), int(context_ids[-1])
    if offsets[first][0] > start or offsets[last][1] < end:
        return 0, 0
    ctx_starts = np.array([offsets[t][0] for t in context_ids])
    ctx_ends = np.array([offsets[t][1] for t in context_ids])
    s = int(context_ids[np.searchsorted(ctx_starts, start, side="right") - 1])
    e = int(context_ids[np.searchsorted(ctx_ends, end, side="left")])
    return s, e


def encode_windows(tokenizer: Any, examples: Sequence[QAExample], max_len: int,
                   settings: QASettings = SETTINGS) -> list[dict[str, Any]]:
    """One feature per window: {"inputs", "label": (start, end), "example": index,
    "offsets": (T, 2) int array with -1 outside the context}."""
    if not getattr(tokenizer, "is_fast", False):
        raise UserError("QA tasks need a fast tokenizer (tokenizer.json) for character offsets; "
                        "save the model's tokenizer with `tokenizers` support")
    stride = stride_for(max_len, settings)
    # a window keeps >= 2 x stride context tokens, so consecutive windows advance >= stride
    # tokens (a long question would otherwise leave windows that advance one token at a time)
    room = max_len - tokenizer.num_special_tokens_to_add(pair=True) - 2 * stride
    limit = min(settings.max_question_tokens, room)
    if limit < 1:
        raise UserError(f"--max-len {max_len} leaves no room for a question and a context "
                        "window in QA tasks; use --max-len 128 or more (384 in BERT's recipe)")
    enc = tokenizer(_questions(tokenizer, examples, limit), [ex.context for ex in examples],
                    truncation="only_second", max_length=max_len, stride=stride,
                    return_overflowing_tokens=True, return_offsets_mapping=True)
    feats = []
    for w, k in enumerate(enc["overflow_to_sample_mapping"]):
        seq = np.array([-1 if s is None else s for s in enc.sequence_ids(w)])
        ctx = np.flatnonzero(seq == 1)
        offsets = np.full((len(seq), 2), -1, dtype=np.int64)
        offsets[ctx] = np.array(enc["offset_mapping"][w])[ctx]
        ex = examples[k]
        inputs = {key: enc[key][w] for key in enc if key not in
                  ("offset_mapping", "overflow_to_sample_mapping")}
        label = _label(enc["offset_mapping"][w], ctx, ex.answers[0] if ex.answers else None)
        feats.append({"inputs": inputs, "label": label, "example": k, "offsets": offsets})
    return feats


def collate(tokenizer: Any, feats: Sequence[dict[str, Any]], device: torch.device
            ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Right-padded inputs (B, T) and labels (B, 2): token positions stay where they were."""
    batch = tokenizer.pad([f["inputs"] for f in feats], return_tensors="pt", padding_side="right")
    labels = torch.tensor([f["label"] for f in feats], dtype=torch.long)
    return {k: v.to(device) for k, v in batch.items()}, labels.to(device)


def span_logits(logits: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T, 2) head output -> (B, 2, T) start/end logits, padding at -1e4 so it takes no
    probability (results do not depend on how a batch is padded)."""
    out = logits.float().transpose(1, 2)  # (B, 2, T)
    return out.masked_fill(attention_mask[:, None, :] == 0, -1e4)


def loss(logits: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean of the start and end cross-entropies (Devlin et al. 2019, §4.2)."""
    se = span_logits(logits, attention_mask).transpose(1, 2)  # (B, T, 2): classes on dim 1
    return nn.functional.cross_entropy(se, labels)  # labels (B, 2); mean over B and both ends


def window_spans(start: torch.Tensor, end: torch.Tensor, context: torch.Tensor,
                 settings: QASettings = SETTINGS) -> tuple[torch.Tensor, torch.Tensor]:
    """The n-best valid spans of each window: (scores (B, n), flat index s * T + e (B, n)).

    start, end: (B, T) logits; context: (B, T) bool. Invalid pairs score -inf.
    """
    t = start.shape[1]
    pair = start[:, :, None] + end[:, None, :]  # (B, T, T): span s..e scores start[s] + end[e]
    idx = torch.arange(t)
    length = idx[None, :] - idx[:, None]  # e - s
    ok = (length >= 0) & (length < settings.max_answer_tokens)  # (T, T)
    ok = ok[None] & context[:, :, None] & context[:, None, :]
    pair = pair.masked_fill(~ok, -torch.inf)
    return pair.flatten(1).topk(min(settings.n_best, t * t), dim=1)


def decode(windows: list[tuple[np.ndarray, np.ndarray, float]], context: str,
           settings: QASettings = SETTINGS, *, unanswerable: bool) -> dict[str, Any]:
    """One question's answer from its windows [(scores, (n, 2) char spans, null score)]:
    {"text", "span", "score", "na_score", "n_best": [(score, text), ...]}.

    ``unanswerable``: the task may have questions without an answer (SQuAD 2.0), so "text" is ""
    when the no-answer score exceeds ``settings.null_threshold``; else (SQuAD 1.1) "text" is the
    best span whatever the null score."""
    cands: list[tuple[float, int, int]] = []
    for scores, chars, _ in windows:
        cands += [(float(s), int(c[0]), int(c[1])) for s, c in zip(scores, chars, strict=True)
                  if np.isfinite(s)]
    cands.sort(key=lambda c: -c[0])
    best = [(s, context[a:b]) for s, a, b in cands[:settings.n_best]]
    null = min(n for _, _, n in windows)
    span, score = (best[0][1], best[0][0]) if best else ("", -np.inf)
    na_score = null - score  # +inf when no valid span exists: "no answer"
    text = "" if unanswerable and na_score > settings.null_threshold else span
    return {"text": text, "span": span, "score": score, "na_score": na_score, "n_best": best}


@torch.no_grad()
def predict(backbone: nn.Module, head: nn.Module, tokenizer: Any,
            feats: list[dict[str, Any]], examples: Sequence[QAExample], device: torch.device,
            batch_size: int = 64, settings: QASettings = SETTINGS, *,
            unanswerable: bool) -> list[dict[str, Any]]:
    """The decoded answer of every example (`decode`, ``unanswerable`` as there), from batches
    of its windows."""
    backbone.eval()
    head.eval()
    per_example: list[list[tuple[np.ndarray, np.ndarray, float]]] = [[] for _ in examples]
    for i in range(0, len(feats), batch_size):
        chunk = feats[i:i + batch_size]
        inputs, _ = collate(tokenizer, chunk, device)
        se = span_logits(head(backbone(**inputs).last_hidden_state),
                         inputs["attention_mask"]).cpu()  # (B, 2, T)
        width = se.shape[2]
        offsets = np.full((len(chunk), width, 2), -1, dtype=np.int64)
        for b, f in enumerate(chunk):
            offsets[b, :len(f["offsets"])] = f["offsets"]
        scores, flat = window_spans(se[:, 0], se[:, 1], torch.from_numpy(offsets[:, :, 0] >= 0),
                                    settings)
        s_tok, e_tok = (flat // width).numpy(), (flat % width).numpy()
        for b, f in enumerate(chunk):
            chars = np.stack([offsets[b, s_tok[b], 0], offsets[b, e_tok[b], 1]], axis=1)
            null = float(se[b, 0, 0] + se[b, 1, 0])
            per_example[f["example"]].append((scores[b].numpy(), chars, null))
    return [decode(w, ex.context, settings, unanswerable=unanswerable)
            for w, ex in zip(per_example, examples, strict=True)]


def score_v1(preds: Sequence[dict[str, Any]], examples: Sequence[QAExample]) -> dict[str, float]:
    """SQuAD v1.1's em and f1 of decoded predictions (`decode`)."""
    return squad_v1_metrics({ex.qid: p["text"] for p, ex in zip(preds, examples, strict=True)},
                            {ex.qid: ex.answer_texts for ex in examples})


def score_v2(preds: Sequence[dict[str, Any]], examples: Sequence[QAExample]) -> dict[str, float]:
    """SQuAD 2.0's em, f1, has_ans_em, has_ans_f1, no_ans_f1, best_em, best_f1."""
    return _v2(preds, examples)[0]


def thresholds_v2(preds: Sequence[dict[str, Any]], examples: Sequence[QAExample]
                  ) -> dict[str, dict[str, float]]:
    """Extra result-row fields: {"best_em": {"threshold": t}, "best_f1": {"threshold": t}}, the
    no-answer threshold each best_* score was found at (kept out of the metrics: not a score)."""
    return {m: {"threshold": t} for m, t in _v2(preds, examples)[1].items()}


def _v2(preds: Sequence[dict[str, Any]], examples: Sequence[QAExample]
        ) -> tuple[dict[str, float], dict[str, float]]:
    pairs = list(zip(preds, examples, strict=True))
    return squad_v2_metrics({ex.qid: p["span"] for p, ex in pairs},
                            {ex.qid: p["na_score"] for p, ex in pairs},
                            {ex.qid: ex.answer_texts for ex in examples},
                            SETTINGS.null_threshold)
