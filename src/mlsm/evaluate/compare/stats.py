"""Paired comparisons of result rows (Fig. 2b p-values, Fig. 2c wins and Table 1 of the
*Hitchhikers' Guide to Masked Latent Semantic Modeling*, anonymous, under review).

The rows come from ``results.jsonl`` (``mlsm.artifacts.results_file``, its one door). Two models
are compared on every (task, metric, seed, lr, epochs, batch, max_len, n_train) cell both have:
Wilcoxon signed-rank tests (``scipy.stats.wilcoxon``) over the paired scores, and the number of
cells each model wins. All metrics here are higher-is-better. Test-set metrics (``<metric>_test``,
written by ``mlsm finetune --eval-test``) are reported in the means table and never enter the
tests, the win counts, the bootstrap or the average: the statistics are on dev metrics alone, as
the paper's.

Significance is directional, as the Hitchhikers' Guide reads its Fig. 2b/3b and §4.3: a ``*`` at
(row i, column j) means model i is significantly *better* than model j, i.e. the one-sided test with
alternative "greater" on the differences (row − column) has p < 0.01. At most one cell of a pair
carries a star. The two-sided p is kept (``pvalues_two_sided.csv``) for readers who want it.
"""

from __future__ import annotations

import csv
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats as sps

from mlsm.artifacts.outputs import guard_output, report_kind
from mlsm.artifacts.results_file import (
    CELL_FIELDS,
    TEST_SUFFIX,
    cell_key,
    is_test_metric,
    read_scores,
)
from mlsm.errors import UserError
from mlsm.evaluate.compare.paired import too_few
from mlsm.fileio import atomic_write, atomic_write_text, files_as_one

SIGNIFICANCE = 0.01  # the Hitchhikers' Guide marks p < 0.01
# What Comparison.write puts into an output folder (and the first line of its Markdown).
COMPARISON_FILES = {"comparison.md", "means.csv", "pvalues.csv", "pvalues_two_sided.csv",
                    "wins.csv", "mean_diff_ci.csv"}
COMPARISON_HEADINGS = {"comparison.md": "# Fine-tuning comparison"}
COMPARISON_KIND = report_kind("mlsm comparison", COMPARISON_FILES.__contains__,
                              COMPARISON_HEADINGS)
def dev_cells(scores: dict[str, dict[tuple[Any, ...], float]]
              ) -> dict[str, dict[tuple[Any, ...], float]]:
    """The scores without their test-set cells: what the statistics are computed on."""
    at = CELL_FIELDS.index("metric")
    return {m: {k: v for k, v in cells.items() if not is_test_metric(k[at])}
            for m, cells in scores.items()}


def wilcoxon_p(a: np.ndarray, b: np.ndarray, alternative: str = "two-sided") -> float:
    """Wilcoxon signed-rank p-value of paired scores; 1.0 when all pairs tie, NaN if none.

    alternative="greater" tests whether ``a`` is better than ``b`` (the median of a − b > 0).
    """
    if len(a) == 0:
        return math.nan
    if np.all(a == b):
        return 1.0
    return float(sps.wilcoxon(a, b, alternative=alternative).pvalue)


@dataclass
class Comparison:
    """Pairwise tests and per-task means. Matrices are (m, m), indexed [row model, column model]."""

    models: list[str]
    columns: list[tuple[str, str]]  # (task, metric)
    mean: np.ndarray  # (m, c) mean over seeds (and lrs)
    std: np.ndarray  # (m, c) sample std (ddof=1; 0 for a single run)
    count: np.ndarray  # (m, c) runs per cell
    # (m, m) one-sided Wilcoxon p of "row better than column"; NaN on the diagonal
    pvalues: np.ndarray
    wins: np.ndarray  # (m, m) cells where the row model scores strictly higher
    n_pairs: np.ndarray  # (m, m) common cells
    # model -> step/readiness/objective/run
    info: dict[str, dict[str, Any]] = field(default_factory=dict)
    # model -> cell -> value
    scores: dict[str, dict[tuple[Any, ...], float]] = field(default_factory=dict)
    pvalues_two_sided: np.ndarray | None = None  # (m, m) symmetric two-sided p; NaN on the diagonal
    # (m, m, 3) bootstrap mean difference row − column, CI low, CI high
    ci: np.ndarray | None = None
    ci_level: float = 0.95
    # (m, c, 2) percentile bootstrap CI of each mean over its runs (`bootstrap_mean_ci`)
    mean_ci: np.ndarray | None = None

    def pvalue_table(self) -> list[list[str]]:
        """Rows of the directional p-value matrix as text.

        ``*`` at (i, j): i better than j, p < 0.01.
        """
        m = len(self.models)
        return [[("—" if i == j else too_few(self.n_pairs[i, j]) or (
                  "—" if math.isnan(self.pvalues[i, j]) else
                  f"{self.pvalues[i, j]:.3g}{'*' if self.pvalues[i, j] < SIGNIFICANCE else ''}"))
                 for j in range(m)] for i in range(m)]

    def common_columns(self) -> np.ndarray:
        """(c,) bool: the dev (task, metric) columns every model has a score in; "avg" is their
        mean (an average over different task sets would compare models on different things;
        test-set columns are reported, never averaged)."""
        dev = np.array([not is_test_metric(m) for _, m in self.columns], dtype=bool)
        return (self.count > 0).all(axis=0) & dev

    def avg_label(self) -> str:
        dev = np.array([not is_test_metric(m) for _, m in self.columns], dtype=bool)
        common = self.common_columns()
        return "avg" if common.sum() == dev.sum() else f"avg ({int(common.sum())} common)"

    def average(self, i: int) -> float:
        """Model i's mean of its per-column means over `common_columns` (Table 1's "avg"); NaN
        without any."""
        have = self.common_columns()
        return float(self.mean[i][have].mean()) if have.any() else math.nan

    def mean_table(self) -> list[list[str]]:
        """Table 1 rows: "mean ± std" ×100 per (task, metric) (and "[low, high]", the bootstrap
        CI of the mean, when computed), then the average of the means over the dev columns every
        model has (`common_columns`)."""
        out = []
        for i in range(len(self.models)):
            cells = [f"{100 * self.mean[i, c]:.2f} ± {100 * self.std[i, c]:.2f}"
                     + self._mean_ci_text(i, c) if self.count[i, c] else "—"
                     for c in range(len(self.columns))]
            avg = self.average(i)
            out.append([*cells, "—" if math.isnan(avg) else f"{100 * avg:.2f}"])
        return out

    def _mean_ci_text(self, i: int, c: int) -> str:
        if self.mean_ci is None or math.isnan(self.mean_ci[i, c, 0]):
            return ""
        return f" [{100 * self.mean_ci[i, c, 0]:.2f}, {100 * self.mean_ci[i, c, 1]:.2f}]"

    def test_note(self) -> list[str]:
        """The line saying that test-set columns are reported only (empty without any)."""
        tests = [f"{t} {m}" for t, m in self.columns if is_test_metric(m)]
        if not tests:
            return []
        return [f"Test-set scores ({', '.join(tests)}) are reported in the means table only: the "
                "average, the Wilcoxon tests, the win counts and the bootstrap use the dev "
                "metrics alone.", ""]

    def to_markdown(self) -> str:
        """The three tables as Markdown."""
        cols = [f"{t} {m}" for t, m in self.columns]
        wins = [[("—" if i == j else f"{int(self.wins[i, j])}/{int(self.n_pairs[i, j])}")
                 for j in range(len(self.models))] for i in range(len(self.models))]
        return "\n".join([
            "## Mean dev scores (×100, mean ± std over seeds"
            + (f" [{100 * self.ci_level:.0f} % bootstrap CI of the mean])" if self.mean_ci
               is not None else ")"), "",
            _md(["model", *cols, self.avg_label()], self.models, self.mean_table()), "",
            *self.test_note(),
            "## Wilcoxon signed-rank p-values, one-sided: row better than column "
            f"(* p < {SIGNIFICANCE})", "",
            _md(["model", *self.models], self.models, self.pvalue_table()), "",
            "## Wins (row beats column / paired runs)", "",
            _md(["model", *self.models], self.models, wins), "",
            *self._ci_markdown(),
        ])

    def _ci_markdown(self) -> list[str]:
        """The bootstrap section (empty without `ci`): mean difference ×100 [low, high]."""
        if self.ci is None:
            return []
        m = len(self.models)
        rows = [[self.diff_text(i, j) for j in range(m)] for i in range(m)]
        title = ("## Mean paired difference row − column ×100, "
                 f"{100 * self.ci_level:.0f} % bootstrap CI")
        return [title, "", _md(["model", *self.models], self.models, rows), ""]

    def diff_text(self, i: int, j: int) -> str:
        """Mean difference ×100 [low, high] of row i − column j; n/a with fewer than 2 pairs."""
        if i == j:
            return "—"
        if too_few(self.n_pairs[i, j]):
            return too_few(self.n_pairs[i, j])  # type: ignore[return-value]
        if self.ci is None or math.isnan(self.ci[i, j, 0]):
            return "—"
        return (f"{100 * self.ci[i, j, 0]:+.2f} "
                f"[{100 * self.ci[i, j, 1]:+.2f}, {100 * self.ci[i, j, 2]:+.2f}]")

    def write(self, out_dir: str | Path) -> dict[str, Path]:
        """``comparison.md``, ``means.csv``, ``pvalues.csv`` (one-sided, row better than column),
        ``pvalues_two_sided.csv`` and ``wins.csv`` in ``out_dir``."""
        out = Path(out_dir)
        with files_as_one(out, COMPARISON_FILES.__contains__) as stage:  # no mix of two runs
            written = self._write(stage)
        return {k: out / p.name for k, p in written.items()}

    def _write(self, out: Path) -> dict[str, Path]:
        paths = {k: out / f"{k}.csv" for k in ("means", "pvalues", "pvalues_two_sided", "wins")}
        paths["markdown"] = out / "comparison.md"
        atomic_write_text(paths["markdown"],
                          COMPARISON_HEADINGS["comparison.md"] + "\n\n" + self.to_markdown())
        cis = self.mean_ci is not None
        means = [[t, met, mod, self.mean[i, c], self.std[i, c], int(self.count[i, c]),
                  *(self.mean_ci[i, c].tolist() if cis else [])]  # type: ignore[index]
                 for c, (t, met) in enumerate(self.columns) for i, mod in enumerate(self.models)
                 if self.count[i, c]]
        _csv(paths["means"], ["task", "metric", "model", "mean", "std", "n",
                              *(["ci_low", "ci_high"] if cis else [])], means)
        _csv(paths["pvalues"], ["model", *self.models],
             [[m, *r] for m, r in zip(self.models, self.pvalues.tolist(), strict=True)])
        two = (self.pvalues_two_sided if self.pvalues_two_sided is not None
               else np.full_like(self.pvalues, math.nan))
        _csv(paths["pvalues_two_sided"], ["model", *self.models],
             [[m, *r] for m, r in zip(self.models, two.tolist(), strict=True)])
        _csv(paths["wins"], ["model", *self.models],
             [[m, *r] for m, r in zip(self.models, self.wins.astype(int).tolist(), strict=True)])
        if self.ci is not None:
            paths["mean_diff_ci"] = out / "mean_diff_ci.csv"
            _csv(paths["mean_diff_ci"],
                 ["model", "other", "n", "mean_diff", "ci_low", "ci_high", "level"],
                 [[a, b, int(self.n_pairs[i, j]), *self.ci[i, j].tolist(), self.ci_level]
                  for i, a in enumerate(self.models) for j, b in enumerate(self.models) if i != j])
        return paths


def _md(header: list[str], names: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join([n, *r]) + " |" for n, r in zip(names, rows, strict=True)]
    return "\n".join(lines)


def _csv(path: Path, header: list[str], rows: list[list[Any]]) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(header)
            writer.writerows(rows)

    atomic_write(path, write)


def _scores(rows: list[dict[str, Any]]
            ) -> tuple[dict[str, dict[tuple[Any, ...], float]], dict[str, dict[str, Any]]]:
    """model -> {cell key: value} (a re-run cell keeps its last value), and model -> metadata."""
    scores: dict[str, dict[tuple[Any, ...], float]] = {}
    info: dict[str, dict[str, Any]] = {}
    for r in rows:
        key = cell_key(r)
        scores.setdefault(r["model"], {})[key] = float(r["value"])
        info.setdefault(r["model"],
                        {k: r.get(k) for k in ("step", "readiness", "objective", "run")})
    return scores, info


def _pairwise(models: list[str],
              scores: dict[str, dict[tuple[Any, ...], float]]) -> tuple[np.ndarray, ...]:
    """(greater, two_sided, wins, n_pairs).

    greater[i, j] is the one-sided p of "i better than j".
    """
    m = len(models)
    pvalues, wins, n_pairs = np.full((m, m), math.nan), np.zeros((m, m)), np.zeros((m, m))
    two_sided = np.full((m, m), math.nan)
    for i, a in enumerate(models):
        for j, b in enumerate(models):
            if i == j:
                continue
            common = sorted(scores[a].keys() & scores[b].keys(), key=repr)
            x = np.array([scores[a][k] for k in common])
            y = np.array([scores[b][k] for k in common])
            pvalues[i, j] = wilcoxon_p(x, y, alternative="greater")
            two_sided[i, j] = wilcoxon_p(x, y)
            wins[i, j] = int(np.sum(x > y))
            n_pairs[i, j] = len(common)
    return pvalues, two_sided, wins, n_pairs


SELECTED_LR = -1.0  # the lr field of a cell after best-lr selection: "the model's best lr"


def best_lr(by_lr: dict[float, list[float]]) -> float:
    """The learning rate whose runs have the best mean validation score; a tie goes to the
    smaller lr. The one rule of `select_best_lr` and of a preset's grid (`protocol`)."""
    return max(by_lr, key=lambda lr: (np.mean(by_lr[lr]), -lr))


def select_best_lr(scores: dict[str, dict[tuple[Any, ...], float]],
                   info: dict[str, dict[str, Any]]) -> dict[str, dict[tuple[Any, ...], float]]:
    """Keep, per (model, task, epochs, batch, max_len, n_train), the runs of the learning rate
    with the best mean VALIDATION score (over seeds and the task's metrics; ``*_test`` metrics
    never choose), as a grid search picks one lr per model and task. The kept cells' lr field
    becomes SELECTED_LR so that models tuned to different lrs still pair by seed; the chosen lrs
    go to ``info[model]["best_lr"]`` ({task: lr})."""
    out: dict[str, dict[tuple[Any, ...], float]] = {}
    lr_at = CELL_FIELDS.index("lr")
    for model, cells in scores.items():
        groups: dict[tuple[Any, ...], dict[float, list[float]]] = {}
        for key, value in cells.items():
            if not is_test_metric(key[1]):
                group = (key[0], *key[lr_at + 1:])  # task, epochs, batch, max_len, n_train
                groups.setdefault(group, {}).setdefault(key[lr_at], []).append(value)
        best = {g: best_lr(by_lr) for g, by_lr in groups.items()}
        out[model] = {(*k[:lr_at], SELECTED_LR, *k[lr_at + 1:]): v for k, v in cells.items()
                      if best.get((k[0], *k[lr_at + 1:])) == k[lr_at]}
        info.setdefault(model, {})["best_lr"] = {g[0]: lr for g, lr in best.items()}
    return out


RUN_MEAN = "run_mean"  # the metric of a cell that averages one run's metrics (`per_run`)


def average_metrics(scores: dict[str, dict[tuple[Any, ...], float]]
                    ) -> dict[str, dict[tuple[Any, ...], float]]:
    """One cell per fine-tuning run: the mean of its validation metrics (metric RUN_MEAN; its
    ``*_test`` metrics, if any, become one RUN_MEAN_test cell). MRPC's accuracy and F1, or STS-B's
    Pearson and Spearman, move together; as two pairs they count one run twice and make a
    Wilcoxon p too small. As one pair per run the test is the conservative one."""
    at = CELL_FIELDS.index("metric")
    out: dict[str, dict[tuple[Any, ...], float]] = {}
    for model, cells in scores.items():
        runs: dict[tuple[Any, ...], list[float]] = {}
        for key, value in cells.items():
            runs.setdefault((*key[:at], _run_metric(key[at]), *key[at + 1:]), []).append(value)
        out[model] = {k: float(np.mean(v)) for k, v in runs.items()}
    return out


def _run_metric(metric: str) -> str:
    return RUN_MEAN + (TEST_SUFFIX if is_test_metric(metric) else "")


def bootstrap_mean_diff(models: list[str], scores: dict[str, dict[tuple[Any, ...], float]],
                        n_resamples: int = 10000, level: float = 0.95, seed: int = 0) -> np.ndarray:
    """(m, m, 3): mean paired difference row − column over the common cells and its percentile
    bootstrap CI (``scipy.stats.bootstrap``, resampling cells). Every pair resamples with the same
    seed, so CI(j, i) = −CI(i, j) mirrored. NaN with fewer than 2 common cells."""
    m = len(models)
    out = np.full((m, m, 3), math.nan)
    for i, a in enumerate(models):
        for j, b in enumerate(models):
            common = sorted(scores[a].keys() & scores[b].keys(), key=repr)
            if i == j or len(common) < 2:
                continue
            d = np.array([scores[a][k] - scores[b][k] for k in common])
            out[i, j, 0] = d.mean()
            if np.all(d == d[0]):  # no spread: the interval is the point
                out[i, j, 1:] = d[0]
                continue
            res = sps.bootstrap((d,), np.mean, n_resamples=n_resamples, confidence_level=level,
                                method="percentile", random_state=np.random.default_rng(seed))
            out[i, j, 1:] = res.confidence_interval.low, res.confidence_interval.high
    return out


def bootstrap_mean_ci(values: np.ndarray, n_resamples: int, level: float = 0.95,
                      seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean of one model's runs on one (task, metric)
    (``scipy.stats.bootstrap``, resampling runs, a fixed seed); the point itself without spread,
    NaN with fewer than 2 runs."""
    if len(values) < 2:
        return math.nan, math.nan
    if np.all(values == values[0]):
        return float(values[0]), float(values[0])
    res = sps.bootstrap((values,), np.mean, n_resamples=n_resamples, confidence_level=level,
                        method="percentile", random_state=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def _warn_uneven(models: list[str], columns: list[tuple[str, str]], count: np.ndarray) -> None:
    """One warning when models were scored on different (task, metric) columns: which model
    lacks which, and that "avg" covers only the common ones."""
    lacking = [(m, [f"{t} {met}" for c, (t, met) in enumerate(columns) if not count[i, c]])
               for i, m in enumerate(models)]
    lacking = [(m, cols) for m, cols in lacking if cols]
    if not lacking:
        return
    common = int((count > 0).all(axis=0).sum())
    said = "; ".join(f"{m} lacks {', '.join(cols[:3])}{', ...' if len(cols) > 3 else ''}"
                     for m, cols in lacking[:3])
    print(f"mlsm: warning: the models were not scored on the same tasks ({said}"
          f"{'; ...' if len(lacking) > 3 else ''}); the avg column averages only the {common} "
          "columns every model has", file=sys.stderr)


def compare_runs(results_path: str | Path, out_dir: str | Path | None = None, *,
                 select_lr: bool = False, bootstrap: int = 0,
                 ci_level: float = 0.95, per_run: bool = False) -> Comparison:
    """Paired one-sided (and two-sided) Wilcoxon p-values, win counts and per-task means of
    every model in a results file.

    select_lr: per model and task keep only its best learning rate on validation
    (``select_best_lr``).
    bootstrap: number of resamples for CIs of the mean paired differences and of each mean
    (`bootstrap_mean_ci`; 0 = none).
    per_run: pair one score per fine-tuning run, its metrics averaged (``average_metrics``), not
    one per (run, metric): the conservative test when a task reports correlated metrics.
    With ``out_dir``, also writes ``comparison.md`` and the CSVs there.
    """
    if out_dir is not None:  # a user's own files there are never overwritten
        guard_output(out_dir, COMPARISON_KIND, keep=[results_path])
    rows = read_scores(results_path)
    if not rows:
        raise UserError(f"{results_path}: no result rows; run `mlsm finetune` first")
    if bootstrap < 0 or not 0.0 < ci_level < 1.0:
        raise UserError(f"--bootstrap must be >= 0 (got {bootstrap}) and the CI level in (0, 1) "
                        f"(got {ci_level})")
    scores, info = _scores(rows)
    if select_lr:
        scores = select_best_lr(scores, info)
    if per_run:
        scores = average_metrics(scores)
    models = list(scores)
    columns = list(dict.fromkeys((r["task"], _run_metric(r["metric"]) if per_run else r["metric"])
                                 for r in rows))
    shape = (len(models), len(columns))
    mean, std, count = np.zeros(shape), np.zeros(shape), np.zeros(shape, dtype=int)
    mean_ci = np.full((*shape, 2), math.nan) if bootstrap else None
    for i, mod in enumerate(models):
        for c, (task, metric) in enumerate(columns):
            vals = np.array([v for k, v in scores[mod].items() if k[0] == task and k[1] == metric])
            count[i, c] = len(vals)
            if len(vals):
                mean[i, c] = vals.mean()
                std[i, c] = vals.std(ddof=1) if len(vals) > 1 else 0.0
            if mean_ci is not None:
                mean_ci[i, c] = bootstrap_mean_ci(vals, bootstrap, ci_level)
    _warn_uneven(models, columns, count)
    dev = dev_cells(scores)  # test-set scores are reported, never tested, counted or averaged
    pvalues, two_sided, wins, n_pairs = _pairwise(models, dev)
    ci = bootstrap_mean_diff(models, dev, bootstrap, ci_level) if bootstrap else None
    report = Comparison(models, columns, mean, std, count, pvalues, wins, n_pairs, info, scores,
                        two_sided, ci, ci_level, mean_ci)
    if out_dir is not None:
        report.write(out_dir)
    return report
