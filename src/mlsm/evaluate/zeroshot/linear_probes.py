"""Frozen-encoder linear probes on the full GLUE training sets (SentEval-style readouts).

The encoder is never trained: each sentence is encoded once (mean of the last layer over the tokens
its attention mask keeps, [CLS] and [SEP] included; batched by length, no grad) and a linear model
is fitted on the features of the whole training set:

- classification (CoLA, SST-2, MRPC, RTE, QNLI, ...): standardised features, scikit-learn's
  `LogisticRegressionCV` (lbfgs), its C chosen among `C_GRID` by 5-fold cross-validation on the
  training set only (`StratifiedKFold` without shuffling: no seed), scored with the task's metric
  (MCC for CoLA, accuracy otherwise); then refitted on the whole training set;
- regression (STS-B): `RidgeCV` over `ALPHA_GRID`, alpha chosen by leave-one-out on the training
  set (its closed form, deterministic); Pearson and Spearman on dev.

Sentence pairs get SentEval's pair features [u, v, |u − v|, u ⊙ v] (Conneau et al. 2017, §3.1),
u and v encoded separately. Every score is read beside a model-free control on the same dev set:
the majority training label (classification) or the mean training score (regression, whose
correlation is 0 by definition), so a score at chance shows as such. Scores are on the dev split
(GLUE's test labels are not public); nothing is tuned on it. Deterministic: same inputs, same rows.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

C_GRID = tuple(float(c) for c in np.logspace(-3, 3, 7))
"""Inverse L2 strengths tried by the classifiers' cross-validation."""
ALPHA_GRID = tuple(float(a) for a in np.logspace(-2, 5, 8))
"""Ridge penalties tried by the regressor's leave-one-out."""
FOLDS = 5
"""Cross-validation folds on the training set."""
TOL = 1e-3
"""lbfgs stopping tolerance: the C chosen and the dev score matched 1e-4's on MRPC, 3x faster."""


def _one_blas_thread() -> Any:
    """A single BLAS thread while scikit-learn fits: its matrix-vector products are small, and on
    a loaded 2-core machine a BLAS thread pool fighting for cores made one MRPC fit 23x slower
    (276 s against 12 s, measured)."""
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=1, user_api="blas")


@torch.no_grad()
def encode(model: Any, tokenizer: Any, texts: Sequence[str], max_len: int = 128,
           token_budget: int = 16384) -> np.ndarray:
    """Mean-pooled last hidden states of `texts`: (n, d) float32, rows in input order. Texts are
    sorted by length and packed under `token_budget` padded tokens a forward pass."""
    model.eval()
    ids = tokenizer(list(texts), truncation=True, max_length=max_len)["input_ids"]
    order = np.argsort([len(x) for x in ids], kind="stable")[::-1]  # longest first: OOM early
    device = next(model.parameters()).device
    out = np.zeros((len(ids), model.config.hidden_size), dtype=np.float32)
    start = 0
    while start < len(order):
        width = len(ids[order[start]])
        stop = min(len(order), start + max(1, token_budget // max(width, 1)))
        rows = order[start:stop]
        input_ids = torch.full((len(rows), width), tokenizer.pad_token_id or 0)  # (B, T)
        mask = torch.zeros((len(rows), width), dtype=torch.long)  # (B, T)
        for j, i in enumerate(rows):
            input_ids[j, :len(ids[i])] = torch.tensor(ids[i])
            mask[j, :len(ids[i])] = 1
        hidden = model(input_ids=input_ids.to(device),
                       attention_mask=mask.to(device)).last_hidden_state.float()  # (B, T, d)
        mask = mask.to(device)
        m = mask.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
        out[rows] = ((hidden * m).sum(1) / m.sum(1).clamp(min=1)).cpu().numpy()
        start = stop
    return out


def pair_features(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """SentEval's features of a sentence pair: [u, v, |u − v|, u ⊙ v], (n, 4d)."""
    return np.concatenate([u, v, np.abs(u - v), u * v], axis=1)


def _cv_scoring(task: str) -> str:
    return "matthews_corrcoef" if task == "cola" else "accuracy"


def fit_classifier(x: np.ndarray, y: np.ndarray, task: str = "") -> Any:
    """Standardise, then LogisticRegressionCV (lbfgs) with C chosen on the training folds."""
    from sklearn.linear_model import LogisticRegressionCV
    from sklearn.model_selection import StratifiedKFold
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    folds = StratifiedKFold(n_splits=max(2, min(FOLDS, int(np.bincount(y).min()))))
    clf = LogisticRegressionCV(Cs=list(C_GRID), cv=folds, solver="lbfgs", max_iter=1000,
                               tol=TOL, scoring=_cv_scoring(task))
    with _one_blas_thread(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # sklearn 1.8's notices of 1.10 defaults
        return make_pipeline(StandardScaler(), clf).fit(x, y)


def fit_regressor(x: np.ndarray, y: np.ndarray) -> Any:
    """Standardise, then RidgeCV with alpha chosen by leave-one-out on the training set."""
    from sklearn.linear_model import RidgeCV
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    with _one_blas_thread():
        return make_pipeline(StandardScaler(), RidgeCV(alphas=list(ALPHA_GRID))).fit(x, y)


def _features(examples: list[Any], cache: dict[str, np.ndarray]) -> np.ndarray:
    u = np.stack([cache[e.text] for e in examples])
    if examples[0].text_pair is None:
        return u
    return pair_features(u, np.stack([cache[e.text_pair] for e in examples]))


def available_tasks(data_dir: str | Path, names: Sequence[str]) -> list[str]:
    """The tasks of `names` whose training and dev files are under data_dir (QNLI has no train
    split in ../shared/data/glue)."""
    from mlsm.errors import UserError
    from mlsm.evaluate.finetune.tasks import get_task, task_folder

    out = []
    for name in names:
        spec = get_task(name)
        try:
            folder = task_folder(spec, data_dir)
        except UserError:
            continue
        if any(folder.glob("train*")) and any(folder.glob("dev*")):
            out.append(spec.name)
    return out


def probe_task(model: Any, tokenizer: Any, task: str, data_dir: str | Path,
               max_train: int | None = None, max_len: int = 128) -> list[dict[str, Any]]:
    """Fit one task's linear probe on frozen features; one row per metric of the task:
    {"task", "metric", "value", "control", "control_kind", "n", "n_train", "hyper", "seconds"}."""
    from mlsm.evaluate.finetune.tasks import get_task, load_task

    start = time.perf_counter()
    spec = get_task(task)
    if spec.kind not in ("cls", "reg"):
        from mlsm.errors import UserError

        raise UserError(f"task {spec.name} is a token task; linear probes read sentence tasks")
    train = load_task(spec.name, spec.train_split, data_dir, max_train)
    dev = load_task(spec.name, spec.eval_splits[""], data_dir)
    texts = sorted({t for e in train + dev for t in (e.text, e.text_pair) if t is not None})
    cache = dict(zip(texts, encode(model, tokenizer, texts, max_len), strict=True))
    x, xd = _features(train, cache), _features(dev, cache)
    y = np.array([e.label for e in train])
    yd = [e.label for e in dev]
    if spec.kind == "reg":
        fitted = fit_regressor(x, y.astype(np.float64))
        preds = fitted.predict(xd)
        control = [float(y.mean())] * len(dev)
        hyper, control_kind = {"alpha": float(fitted[-1].alpha_)}, "mean training score"
    else:
        fitted = fit_classifier(x, y.astype(np.int64), spec.name)
        preds = fitted.predict(xd)
        control = [int(np.bincount(y.astype(np.int64)).argmax())] * len(dev)
        hyper, control_kind = {"C": float(fitted[-1].C_[0])}, "majority training label"
    scores, base = spec.metric(list(preds), yd), spec.metric(control, yd)
    seconds = round(time.perf_counter() - start, 1)
    return [{"task": spec.name, "metric": m, "value": v, "control": base[m],
             "control_kind": control_kind, "n": len(dev), "n_train": len(train), "hyper": hyper,
             "seconds": seconds} for m, v in scores.items()]
