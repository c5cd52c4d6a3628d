"""Results files and paired comparisons (seed paper 000: Fig. 2b p-values, Fig. 2c wins, Table 1).

``results.jsonl`` holds one JSON object per line and per metric (see ``finetune.run_cell``).
Two models are compared on every (task, metric, seed, lr, epochs, batch, max_len, n_train) cell
both have: Wilcoxon signed-rank tests (``scipy.stats.wilcoxon``) over the paired scores, and the
number of cells each model wins. All metrics here are higher-is-better.

Significance is directional, as Berend (2023) reads Fig. 2b/3b and §4.3: a ``*`` at (row i,
column j) means model i is significantly *better* than model j, i.e. the one-sided test with
alternative "greater" on the differences (row − column) has p < 0.01. At most one cell of a pair
carries a star. The two-sided p is kept (``pvalues_two_sided.csv``) for readers who want it.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats as sps

from mlsm.errors import UserError

try:  # POSIX advisory lock: several finetune processes may append to one results file
    import fcntl
except ImportError:  # Windows: appends of one write() call are still whole in practice
    fcntl = None

SIGNIFICANCE = 0.01  # seed 000 marks p < 0.01
CELL_FIELDS = ("task", "metric", "seed", "lr", "epochs", "batch_size", "max_len", "n_train")


def append_results(path: str | Path, rows: Iterable[dict[str, Any]]) -> None:
    """Append rows as JSON lines in one locked ``write`` + fsync, so a crash or a concurrent
    writer never interleaves or half-writes a cell's lines (a torn tail line from a killed
    process is closed off with a newline first; ``read_results`` skips it)."""
    text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)
    if not text:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            text = "\n" + text
        os.write(fd, text.encode("utf-8"))
        os.fsync(fd)
    finally:
        os.close(fd)  # closing releases the lock


def read_results(path: str | Path) -> list[dict[str, Any]]:
    """All complete rows of a results file; torn or foreign lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no results file; run `mlsm finetune ... --results {path}` first")
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and {"model", "value", *CELL_FIELDS} <= row.keys():
            rows.append(row)
    return rows


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
    pvalues: np.ndarray  # (m, m) one-sided Wilcoxon p of "row better than column"; NaN on the diagonal
    wins: np.ndarray  # (m, m) cells where the row model scores strictly higher
    n_pairs: np.ndarray  # (m, m) common cells
    info: dict[str, dict[str, Any]] = field(default_factory=dict)  # model -> step/readiness/objective/run
    scores: dict[str, dict[tuple[Any, ...], float]] = field(default_factory=dict)  # model -> cell -> value
    pvalues_two_sided: np.ndarray | None = None  # (m, m) symmetric two-sided p; NaN on the diagonal

    def pvalue_table(self) -> list[list[str]]:
        """Rows of the directional p-value matrix as text; ``*`` at (i, j): i better than j, p < 0.01."""
        m = len(self.models)
        return [[("—" if i == j or math.isnan(self.pvalues[i, j]) else
                  f"{self.pvalues[i, j]:.3g}{'*' if self.pvalues[i, j] < SIGNIFICANCE else ''}")
                 for j in range(m)] for i in range(m)]

    def mean_table(self) -> list[list[str]]:
        """Table 1 rows: "mean ± std" ×100 per (task, metric), then the average of the means."""
        out = []
        for i in range(len(self.models)):
            cells = [f"{100 * self.mean[i, c]:.2f} ± {100 * self.std[i, c]:.2f}" if self.count[i, c] else "—"
                     for c in range(len(self.columns))]
            row_means = self.mean[i][self.count[i] > 0]
            out.append([*cells, f"{100 * row_means.mean():.2f}" if len(row_means) else "—"])
        return out

    def to_markdown(self) -> str:
        """The three tables as Markdown."""
        cols = [f"{t} {m}" for t, m in self.columns]
        wins = [[("—" if i == j else f"{int(self.wins[i, j])}/{int(self.n_pairs[i, j])}")
                 for j in range(len(self.models))] for i in range(len(self.models))]
        return "\n".join([
            "## Mean dev scores (×100, mean ± std over seeds)", "",
            _md(["model", *cols, "avg"], self.models, self.mean_table()), "",
            f"## Wilcoxon signed-rank p-values, one-sided: row better than column (* p < {SIGNIFICANCE})", "",
            _md(["model", *self.models], self.models, self.pvalue_table()), "",
            "## Wins (row beats column / paired runs)", "",
            _md(["model", *self.models], self.models, wins), "",
        ])

    def write(self, out_dir: str | Path) -> dict[str, Path]:
        """``comparison.md``, ``means.csv``, ``pvalues.csv`` (one-sided, row better than column),
        ``pvalues_two_sided.csv`` and ``wins.csv`` in ``out_dir``."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {k: out / f"{k}.csv" for k in ("means", "pvalues", "pvalues_two_sided", "wins")}
        means = [[t, met, mod, self.mean[i, c], self.std[i, c], int(self.count[i, c])]
                 for c, (t, met) in enumerate(self.columns) for i, mod in enumerate(self.models)
                 if self.count[i, c]]
        _csv(paths["means"], ["task", "metric", "model", "mean", "std", "n"], means)
        _csv(paths["pvalues"], ["model", *self.models], [[m, *r] for m, r in zip(self.models, self.pvalues.tolist(), strict=True)])
        two = self.pvalues_two_sided if self.pvalues_two_sided is not None else np.full_like(self.pvalues, math.nan)
        _csv(paths["pvalues_two_sided"], ["model", *self.models], [[m, *r] for m, r in zip(self.models, two.tolist(), strict=True)])
        _csv(paths["wins"], ["model", *self.models], [[m, *r] for m, r in zip(self.models, self.wins.astype(int).tolist(), strict=True)])
        paths["markdown"] = out / "comparison.md"
        _atomic_text(paths["markdown"], "# Fine-tuning comparison\n\n" + self.to_markdown())
        return paths


def _md(header: list[str], names: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join([n, *r]) + " |" for n, r in zip(names, rows, strict=True)]
    return "\n".join(lines)


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _csv(path: Path, header: list[str], rows: list[list[Any]]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    os.replace(tmp, path)


def _scores(rows: list[dict[str, Any]]) -> tuple[dict[str, dict[tuple[Any, ...], float]], dict[str, dict[str, Any]]]:
    """model -> {cell key: value} (a re-run cell keeps its last value), and model -> metadata."""
    scores: dict[str, dict[tuple[Any, ...], float]] = {}
    info: dict[str, dict[str, Any]] = {}
    for r in rows:
        key = tuple(float(r[k]) if k == "lr" else r[k] for k in CELL_FIELDS)
        scores.setdefault(r["model"], {})[key] = float(r["value"])
        info.setdefault(r["model"], {k: r.get(k) for k in ("step", "readiness", "objective", "run")})
    return scores, info


def _pairwise(models: list[str], scores: dict[str, dict[tuple[Any, ...], float]]) -> tuple[np.ndarray, ...]:
    """(greater, two_sided, wins, n_pairs): greater[i, j] is the one-sided p of "i better than j"."""
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


def compare_runs(results_path: str | Path, out_dir: str | Path | None = None) -> Comparison:
    """Paired one-sided (and two-sided) Wilcoxon p-values, win counts and per-task means of every model in a results file.

    With ``out_dir``, also writes ``comparison.md`` and the CSVs there.
    """
    rows = read_results(results_path)
    if not rows:
        raise UserError(f"{results_path}: no result rows; run `mlsm finetune` first")
    scores, info = _scores(rows)
    models = list(scores)
    columns = list(dict.fromkeys((r["task"], r["metric"]) for r in rows))
    shape = (len(models), len(columns))
    mean, std, count = np.zeros(shape), np.zeros(shape), np.zeros(shape, dtype=int)
    for i, mod in enumerate(models):
        for c, (task, metric) in enumerate(columns):
            vals = np.array([v for k, v in scores[mod].items() if k[0] == task and k[1] == metric])
            count[i, c] = len(vals)
            if len(vals):
                mean[i, c] = vals.mean()
                std[i, c] = vals.std(ddof=1) if len(vals) > 1 else 0.0
    pvalues, two_sided, wins, n_pairs = _pairwise(models, scores)
    report = Comparison(models, columns, mean, std, count, pvalues, wins, n_pairs, info, scores, two_sided)
    if out_dir is not None:
        report.write(out_dir)
    return report
