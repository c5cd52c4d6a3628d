"""The fine-tuning tasks' metrics, each as the task's official definition computes it.

Each takes predictions and gold labels and returns {metric name: value}; values are fractions.
scikit-learn computes MCC, accuracy and F1, SciPy the correlations, and seqeval entity F1 under
the CoNLL-2003 convention. The task registry (`mlsm.evaluate.finetune.tasks`) names one per task.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy import stats as sps
from seqeval.metrics import f1_score as seqeval_f1
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef


def metric_mcc(preds: Sequence[int], labels: Sequence[int]) -> dict[str, float]:
    """Matthews correlation (CoLA)."""
    return {"mcc": float(matthews_corrcoef(labels, preds))}


def metric_acc(preds: Sequence[int], labels: Sequence[int]) -> dict[str, float]:
    """Accuracy."""
    return {"acc": float(accuracy_score(labels, preds))}


def metric_acc_f1(preds: Sequence[int], labels: Sequence[int]) -> dict[str, float]:
    """Accuracy and F1 of the positive class 1 (MRPC, QQP: "paraphrase"/"duplicate")."""
    f1 = f1_score(labels, preds, pos_label=1, average="binary", zero_division=0.0)
    return {"acc": float(accuracy_score(labels, preds)), "f1": float(f1)}


def metric_pearson_spearman(preds: Sequence[float], labels: Sequence[float]) -> dict[str, float]:
    """Pearson and Spearman correlations (STS-B). A constant prediction scores 0, not NaN."""
    p, l_ = np.asarray(preds, dtype=np.float64), np.asarray(labels, dtype=np.float64)
    if np.ptp(p) == 0 or np.ptp(l_) == 0:
        return {"pearson": 0.0, "spearman": 0.0}
    return {
        "pearson": float(sps.pearsonr(p, l_)[0]),
        "spearman": float(sps.spearmanr(p, l_)[0]),
    }


def metric_entity_f1(preds: Sequence[Sequence[str]],
                     labels: Sequence[Sequence[str]]) -> dict[str, float]:
    """Entity-level micro F1 over tag sequences (seqeval, CoNLL-2003 convention)."""
    return {"f1": float(seqeval_f1([list(x) for x in labels], [list(x) for x in preds]))}
