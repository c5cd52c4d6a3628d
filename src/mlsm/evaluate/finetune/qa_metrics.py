"""SQuAD metrics: exact match and token F1 with the official answer normalisation.

Definitions follow the official evaluation scripts of SQuAD v1.1 (Rajpurkar et al. 2016) and
v2.0 (Rajpurkar et al. 2018), written here from their documented behaviour:

- normalisation: lower-case, drop ASCII punctuation (``string.punctuation``), drop the articles
  a/an/the as whole words, collapse whitespace;
- EM: normalised strings equal; F1: bag-of-tokens overlap of the normalised strings;
  each question scores the maximum over its gold answers;
- v1.1: a question without a prediction scores 0; F1 of two empty strings is 0;
- v2.0: gold answers that normalise to "" are dropped, and a question left with none has the
  gold answer "" (unanswerable); F1 is 1 when both sides are empty, 0 when only one is;
  ``na_score > threshold`` turns a prediction into "no answer"; HasAns/NoAns are the same
  averages over the answerable / unanswerable questions; ``best_*`` sweeps the threshold over
  the questions' no-answer scores in increasing order (the official ``find_best_thresh``,
  ties included) — an oracle on the evaluation set, reported as the official script does.

Values are fractions (the official scripts print percentages).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Mapping, Sequence

_PUNCT = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """The official SQuAD answer normalisation (lower, punctuation, articles, whitespace)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, gold: str) -> float:
    """1.0 when the normalised strings are equal, else 0.0."""
    return float(normalize_answer(prediction) == normalize_answer(gold))


def token_f1(prediction: str, gold: str, empty_agrees: bool = False) -> float:
    """Harmonic mean of token precision and recall of the normalised strings.

    ``empty_agrees``: v2.0's rule, F1 = 1 when both sides normalise to nothing (and 0 when one
    does); v1.1 scores that case 0.
    """
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if empty_agrees and (not pred or not ref):
        return float(pred == ref)
    same = sum((Counter(pred) & Counter(ref)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def squad_v1_metrics(predictions: Mapping[str, str],
                     golds: Mapping[str, Sequence[str]]) -> dict[str, float]:
    """``em`` and ``f1`` over every question of ``golds`` (id -> gold answer texts); a question
    missing from ``predictions`` scores 0, as in the official v1.1 script."""
    em = f1 = 0.0
    for qid, answers in golds.items():
        if qid not in predictions:
            continue
        pred = predictions[qid]
        em += max(exact_match(pred, a) for a in answers)
        f1 += max(token_f1(pred, a) for a in answers)
    n = max(1, len(golds))
    return {"em": em / n, "f1": f1 / n}


def _v2_raw(spans: Mapping[str, str], golds: Mapping[str, Sequence[str]]
            ) -> tuple[dict[str, float], dict[str, float], dict[str, bool]]:
    """Per-question EM and F1 of the span predictions before any threshold, and has-answer."""
    exact, f1, has_ans = {}, {}, {}
    for qid, answers in golds.items():
        refs = [a for a in answers if normalize_answer(a)] or [""]
        has_ans[qid] = bool(answers)
        exact[qid] = max(exact_match(spans[qid], a) for a in refs)
        f1[qid] = max(token_f1(spans[qid], a, empty_agrees=True) for a in refs)
    return exact, f1, has_ans


def best_threshold(spans: Mapping[str, str], raw: Mapping[str, float],
                   na_scores: Mapping[str, float], has_ans: Mapping[str, bool]
                   ) -> tuple[float, float]:
    """(best score, its threshold): start with every question answered "no answer", then
    answer them in increasing no-answer score, keeping the best running total (official
    ``find_best_thresh``; threshold 0.0 when answering none is best)."""
    score = best = float(sum(not v for v in has_ans.values()))
    thresh = 0.0
    for qid in sorted(raw, key=lambda k: na_scores[k]):
        if has_ans[qid]:
            score += raw[qid]
        elif spans[qid]:
            score -= 1.0
        if score > best:
            best, thresh = score, na_scores[qid]
    return best / max(1, len(raw)), thresh


def squad_v2_metrics(spans: Mapping[str, str], na_scores: Mapping[str, float],
                     golds: Mapping[str, Sequence[str]], threshold: float = 0.0
                     ) -> tuple[dict[str, float], dict[str, float]]:
    """SQuAD 2.0 metrics and the best thresholds.

    spans: id -> best non-null answer text; na_scores: id -> no-answer score (higher = more
    likely unanswerable; here null score − best span score); golds: id -> gold texts, empty for
    an unanswerable question. Returns ({em, f1, has_ans_em, has_ans_f1, no_ans_f1, best_em,
    best_f1}, {best_em: threshold, best_f1: threshold}); the HasAns/NoAns entries are absent
    when no question of that kind exists (as in the official output).
    """
    exact, f1, has_ans = _v2_raw(spans, golds)

    def thresholded(raw: dict[str, float]) -> dict[str, float]:
        return {q: float(not has_ans[q]) if na_scores[q] > threshold else s
                for q, s in raw.items()}

    ex_t, f1_t = thresholded(exact), thresholded(f1)
    n = max(1, len(golds))
    out = {"em": sum(ex_t.values()) / n, "f1": sum(f1_t.values()) / n}
    yes = [q for q in golds if has_ans[q]]
    no = [q for q in golds if not has_ans[q]]
    if yes:
        out["has_ans_em"] = sum(ex_t[q] for q in yes) / len(yes)
        out["has_ans_f1"] = sum(f1_t[q] for q in yes) / len(yes)
    if no:  # on an unanswerable question EM and F1 agree (both 1 exactly when "" is predicted)
        out["no_ans_f1"] = sum(f1_t[q] for q in no) / len(no)
    out["best_em"], em_thresh = best_threshold(spans, exact, na_scores, has_ans)
    out["best_f1"], f1_thresh = best_threshold(spans, f1, na_scores, has_ans)
    return out, {"best_em": em_thresh, "best_f1": f1_thresh}
