"""Named fine-tuning protocols (presets), validation carved from the training data, and the
best-learning-rate choice made on it.

`mlm-vs-clm-2025` is the protocol of Gisserot-Boukhlef et al. 2025 ("Should We Still Pretrain
Encoders with Masked Language Modeling?", §3 and its appendix): at most 1,000 steps or one epoch,
whichever ends first; batch 32; 10 % linear warmup then linear decay; a grid of 6 learning rates,
the best chosen on validation (5 % of the training set, its appendix); 5 seeds; sequence
classification on mean-pooled token embeddings with cross-entropy, token classification with
token-level cross-entropy; 95 % CIs. The six values of the grid (1e-5 … 5e-4 on a 1-2-5 scale)
are the seed-002 authors' public grid (checked against it in the fidelity audit of issue #53).

The learning rate is chosen on a validation split carved from the TRAINING data (a fixed
fraction, the same examples for every model and seed), never on the dev/test set whose score is
reported. Every (lr, seed) run writes its rows — validation metrics as ``<metric>_val`` beside the
dev metrics — to the grid file ``<results>.lr-grid.jsonl``; once all runs of a (model, task) are
there, the dev rows of the chosen lr go to ``results.jsonl`` with ``lr`` = SELECTED_LR (so models
tuned to different lrs pair by seed in `compare`), ``chosen_lr``, ``val_score`` and the preset's
name. `compare`, `report` and a study read them like any other rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mlsm.artifacts.fingerprint import require_same, settings_fingerprint
from mlsm.artifacts.results_file import append_results, read_results
from mlsm.errors import UserError
from mlsm.evaluate.compare.stats import SELECTED_LR, best_lr

VAL_SUFFIX = "_val"  # metric suffix of the carved validation split


@dataclass(frozen=True)
class Preset:
    """A fine-tuning protocol: the `FinetuneConfig` settings it fixes (each documented, typed and
    range-checked there, so a preset declares values, not settings) and where it comes from."""

    values: dict[str, Any]
    """FinetuneConfig field -> the value the protocol fixes."""
    source: str
    """Where the protocol comes from."""

    def settings(self) -> dict[str, Any]:
        """Keyword arguments of `finetune` (seeds as 0..N-1)."""
        out = dict(self.values)
        if isinstance(out.get("seeds"), int):
            out["seeds"] = range(out["seeds"])
        return out


PRESETS: dict[str, Preset] = {
    "mlm-vs-clm-2025": Preset(
        {"lrs": [1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4], "seeds": 5, "epochs": 1, "max_steps": 1000,
         "batch_size": 32, "warmup_ratio": 0.1, "head": "mean", "val_fraction": 0.05},
        source="Gisserot-Boukhlef et al. 2025, 'Should We Still Pretrain Encoders with Masked "
               "Language Modeling?' (the authors' public lr grid)"),
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise UserError(f"unknown fine-tuning preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name]


def preset_settings(name: str, **overrides: Any) -> dict[str, Any]:
    """`finetune` keyword arguments of preset `name` (and its name), with `overrides` (those not
    None) on top: ``finetune(models, tasks, **preset_settings("mlm-vs-clm-2025"), ...)``."""
    given = {k: v for k, v in overrides.items() if v is not None}
    return {**get_preset(name).settings(), "preset": name, **given}


# ----------------------------------------------------------------------------- validation carve


def carve_validation(n: int, task: str, fraction: float,
                     seed: int) -> tuple[list[int], list[int]]:
    """(train indices, validation indices) of a training set of n examples: round(fraction * n)
    of them (at least 1, at most n - 1) drawn by a generator seeded by `seed` — `finetune` passes
    one made of the task's name alone, so every model and seed holds out the same examples. Both
    lists keep file order."""
    if not 0 < fraction < 1:
        raise UserError(f"val_fraction must be in (0, 1), got {fraction}")
    if n < 2:
        raise UserError(f"task {task}: {n} training example(s) cannot give a validation split; "
                        "use more training data or val_fraction 0")
    k = min(n - 1, max(1, round(fraction * n)))
    gen = torch.Generator().manual_seed(seed)
    val = sorted(torch.randperm(n, generator=gen)[:k].tolist())
    held = set(val)
    return [i for i in range(n) if i not in held], val


def split_validation(train: Sequence[Any], task: str, fraction: float,
                     seed: int) -> tuple[list[Any], list[Any]]:
    """`carve_validation` applied to a list of training examples."""
    keep, val = carve_validation(len(train), task, fraction, seed)
    return [train[i] for i in keep], [train[i] for i in val]


def with_validation(task_data: Callable[[Any], Any], fraction: float,
                    seed_of: Callable[[Any], int],
                    as_split: Callable[[Any, list[Any], dict[str, Any]], Any] | None = None
                    ) -> Callable[[Any], Any]:
    """Wrap `finetune`'s task reader (spec -> (train, {split: eval examples})) so that with
    `fraction` > 0 it also returns a "val" split carved from the training examples alone.
    `as_split(spec, held-out examples, evals)`: the "val" split as the task scores it (a
    retrieval task's is a BEIR split, not a list of training queries); None: the list itself."""
    if not fraction:
        return task_data

    def read(spec: Any) -> Any:
        train, evals = task_data(spec)
        train, val = split_validation(train, spec.name, fraction, seed_of(spec))
        return train, {**evals, "val": val if as_split is None else as_split(spec, val, evals)}

    return read


# ----------------------------------------------------------------------------- lr choice


def grid_path(results: str | Path) -> Path:
    """Where the per-lr runs of a validated grid go: RESULTS.lr-grid.jsonl beside results."""
    p = Path(results)
    stem = p.name[: -len(".jsonl")] if p.name.endswith(".jsonl") else p.name
    return p.with_name(f"{stem}.lr-grid.jsonl")


def validation_scores(rows: Sequence[dict[str, Any]]) -> dict[float, list[float]]:
    """lr -> the validation score of each of its runs (the mean of a run's ``*_val`` metrics)."""
    runs: dict[tuple[float, Any], list[float]] = {}
    for r in rows:
        if str(r["metric"]).endswith(VAL_SUFFIX):
            runs.setdefault((float(r["lr"]), r["seed"]), []).append(float(r["value"]))
    by_lr: dict[float, list[float]] = {}
    for (lr, _), values in sorted(runs.items(), key=lambda kv: (kv[0][0], repr(kv[0][1]))):
        by_lr.setdefault(lr, []).append(sum(values) / len(values))
    return by_lr


GRID_FIELDS = ("epochs", "batch_size", "max_len", "head", "max_steps")  # shared by a grid's runs


def report_selected(grid: Path, results: Path, cell: dict[str, Any], preset: str,
                    recompute: bool = False) -> None:
    """Append to `results` the chosen lr's dev rows of the (model, task) grid that `cell`
    describes (model, task, n_train, GRID_FIELDS, the grid's fingerprint; lr and seed: the lists
    run), unless there. Each row records ``selected_on``, the fingerprint of what it was chosen
    on (the grid rows' fingerprint, the lrs and the seeds): rows chosen on anything else are a
    one-line refusal, or (recompute) superseded by the fresh choice."""
    lists = {k: {float(v) if k == "lr" else v for v in cell[k]} for k in ("lr", "seed")}

    def ours(r: dict[str, Any]) -> bool:
        return (all(r.get(k, 0 if k == "max_steps" else "cls" if k == "head" else None) == v
                    for k, v in cell.items() if k not in lists)
                and float(r["lr"]) in lists["lr"] and r["seed"] in lists["seed"])

    basis = settings_fingerprint({"grid": cell.get("fingerprint"), "lrs": sorted(lists["lr"]),
                                  "seeds": sorted(lists["seed"], key=repr)})
    chosen = [{**r, "selected_on": basis}
              for r in selected_rows([r for r in read_results(grid) if ours(r)], preset)]

    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        return (r["model"], r["task"], r["seed"], r["metric"], r["lr"], r["n_train"],
                *(r.get(k) for k in GRID_FIELDS))

    held: dict[tuple[Any, ...], Any] = {}  # the last selection of each row, by key
    for r in read_results(results) if results.exists() else []:
        held[key(r)] = r.get("selected_on")
    stale = [r for r in chosen if key(r) in held and held[key(r)] != basis]
    if stale and not recompute:
        require_same({"lr choice": held[key(stale[0])]}, {"lr choice": basis},
                     f"{results}: the selected rows of {cell['model']} {cell['task']}",
                     "pass --recompute (Python: recompute=True) to replace them, or write to a "
                     "new --results file")
    append_results(results, [r for r in chosen if held.get(key(r), "") != basis])


def selected_rows(rows: Sequence[dict[str, Any]], preset: str) -> list[dict[str, Any]]:
    """The reported rows of one (model, task) grid: the dev rows (not ``*_val``) of the lr with
    the best mean validation score (`stats.best_lr`), lr set to SELECTED_LR."""
    by_lr = validation_scores(rows)
    if not by_lr:
        raise UserError("no validation rows to choose a learning rate on")
    lr = best_lr(by_lr)
    val = sum(by_lr[lr]) / len(by_lr[lr])
    grid = {f"{k:g}": sum(v) / len(v) for k, v in sorted(by_lr.items())}
    return [{**r, "lr": SELECTED_LR, "chosen_lr": lr, "val_score": val, "val_by_lr": grid,
             "preset": preset or None}
            for r in rows if float(r["lr"]) == lr and not str(r["metric"]).endswith(VAL_SUFFIX)]


# ----------------------------------------------------------------------------- pooling


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of the token embeddings that the attention mask keeps (all without one): (B, T, d),
    (B, T) -> (B, d) (Gisserot-Boukhlef et al. 2025: classification on mean-pooled embeddings)."""
    if attention_mask is None:
        return hidden.mean(1)
    mask = attention_mask.to(hidden.dtype).unsqueeze(-1)  # (B, T, 1)
    return (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0)
