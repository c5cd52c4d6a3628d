"""Results files and paired comparisons (seed paper 000: Fig. 2b p-values, Fig. 2c wins, Table 1).

``results.jsonl`` holds one JSON object per line and per metric (see ``finetune.run_cell``).
Two models are compared on every (task, metric, seed, lr, epochs, batch, max_len, n_train) cell
both have: a two-sided Wilcoxon signed-rank test (``scipy.stats.wilcoxon``) over the paired
scores, and the number of cells each model wins. All metrics here are higher-is-better.
"""

from __future__ import annotations

import csv
import json
import math
import os
import sys
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
    for number, raw in enumerate(path.read_bytes().splitlines(), 1):
        line = _decode_line(path, number, raw)
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and {"model", "value", *CELL_FIELDS} <= row.keys():
            rows.append(row)
    return rows


def _decode_line(path: Path, number: int, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}:{number} is not UTF-8 text (byte {exc.start + 1} of the line); "
                        "remove or fix that line (results files are JSON lines written by mlsm finetune)") from None


def read_scores(path: str | Path) -> list[dict[str, Any]]:
    """The rows of `read_results` whose value is a finite number; the others (NaN, null, text)
    are skipped and counted in one warning on stderr, so a mean is never silently NaN."""
    rows = read_results(path)
    good = [r for r in rows if isinstance(r["value"], int | float) and not isinstance(r["value"], bool)
            and math.isfinite(r["value"])]
    if len(good) < len(rows):
        print(f"mlsm: warning: {path}: skipped {len(rows) - len(good)} of {len(rows)} result rows whose value "
              "is not a finite number (NaN, null or text)", file=sys.stderr)
    return good


def wilcoxon_p(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sided Wilcoxon signed-rank p-value of paired scores; 1.0 when all pairs tie, NaN if none."""
    if len(a) == 0:
        return math.nan
    if np.all(a == b):
        return 1.0
    return float(sps.wilcoxon(a, b, alternative="two-sided").pvalue)


@dataclass
class Comparison:
    """Pairwise tests and per-task means. Matrices are (m, m), indexed [row model, column model]."""

    models: list[str]
    columns: list[tuple[str, str]]  # (task, metric)
    mean: np.ndarray  # (m, c) mean over seeds (and lrs)
    std: np.ndarray  # (m, c) sample std (ddof=1; 0 for a single run)
    count: np.ndarray  # (m, c) runs per cell
    pvalues: np.ndarray  # (m, m) Wilcoxon p over the common cells; NaN on the diagonal
    wins: np.ndarray  # (m, m) cells where the row model scores strictly higher
    n_pairs: np.ndarray  # (m, m) common cells
    info: dict[str, dict[str, Any]] = field(default_factory=dict)  # model -> step/readiness/objective/run
    scores: dict[str, dict[tuple[Any, ...], float]] = field(default_factory=dict)  # model -> cell -> value

    def pvalue_table(self) -> list[list[str]]:
        """Rows of the p-value matrix as text, ``*`` marking p < 0.01."""
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
            f"## Wilcoxon signed-rank p-values (row vs column; * p < {SIGNIFICANCE})", "",
            _md(["model", *self.models], self.models, self.pvalue_table()), "",
            "## Wins (row beats column / paired runs)", "",
            _md(["model", *self.models], self.models, wins), "",
        ])

    def write(self, out_dir: str | Path) -> dict[str, Path]:
        """``comparison.md``, ``means.csv``, ``pvalues.csv``, ``wins.csv`` in ``out_dir``."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {k: out / f"{k}.csv" for k in ("means", "pvalues", "wins")}
        means = [[t, met, mod, self.mean[i, c], self.std[i, c], int(self.count[i, c])]
                 for c, (t, met) in enumerate(self.columns) for i, mod in enumerate(self.models)
                 if self.count[i, c]]
        _csv(paths["means"], ["task", "metric", "model", "mean", "std", "n"], means)
        _csv(paths["pvalues"], ["model", *self.models], [[m, *r] for m, r in zip(self.models, self.pvalues.tolist(), strict=True)])
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


def _pairwise(models: list[str], scores: dict[str, dict[tuple[Any, ...], float]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    m = len(models)
    pvalues, wins, n_pairs = np.full((m, m), math.nan), np.zeros((m, m)), np.zeros((m, m))
    for i, a in enumerate(models):
        for j, b in enumerate(models):
            if i == j:
                continue
            common = sorted(scores[a].keys() & scores[b].keys(), key=repr)
            x = np.array([scores[a][k] for k in common])
            y = np.array([scores[b][k] for k in common])
            pvalues[i, j] = wilcoxon_p(x, y)
            wins[i, j] = int(np.sum(x > y))
            n_pairs[i, j] = len(common)
    return pvalues, wins, n_pairs


def compare_runs(results_path: str | Path, out_dir: str | Path | None = None) -> Comparison:
    """Paired Wilcoxon p-values, win counts and per-task means of every model in a results file.

    With ``out_dir``, also writes ``comparison.md`` and the CSVs there.
    """
    rows = read_scores(results_path)
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
    pvalues, wins, n_pairs = _pairwise(models, scores)
    report = Comparison(models, columns, mean, std, count, pvalues, wins, n_pairs, info, scores)
    if out_dir is not None:
        report.write(out_dir)
    return report
