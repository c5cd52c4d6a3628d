"""Figures and a Markdown report from a fine-tuning results file (Figs. 2b, 4 and 7 of the
*Hitchhikers' Guide to Masked Latent Semantic Modeling*, anonymous, under review).

Figures are drawn on ``matplotlib.figure.Figure`` objects with the Agg canvas directly, so no
pyplot state or global backend is touched (safe inside notebooks and other programs).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from mlsm.artifacts.outputs import guard_output, report_kind
from mlsm.errors import UserError
from mlsm.evaluate.compare.stats import (
    COMPARISON_FILES,
    COMPARISON_HEADINGS,
    RUN_MEAN,
    SIGNIFICANCE,
    Comparison,
    compare_runs,
)
from mlsm.fileio import atomic_write, atomic_write_text, files_as_one


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)  # attach the Agg canvas: PNG output without pyplot
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight"))
    return path


def _avg(cmp: Comparison, i: int) -> float:
    """Mean over the dev (task, metric) columns every model has of model i's per-column means
    (Table 1's "avg"; test columns left out)."""
    return cmp.average(i)


def plot_readiness(cmp: Comparison, path: Path) -> Path:
    """Fig. 4: average dev score vs pre-training readiness, one line per run (or objective).

    Models without a readiness (e.g. public checkpoints) are drawn as dashed horizontal lines.
    """
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    series: dict[str, list[tuple[float, float]]] = {}
    for i, model in enumerate(cmp.models):
        info = cmp.info.get(model, {})
        if info.get("readiness") is None:
            ax.axhline(100 * _avg(cmp, i), linestyle="--", linewidth=1, label=model,
                       color=f"C{(9 - i) % 10}")
            continue
        label = Path(str(info["run"])).name if info.get("run") else info.get("objective") or model
        series.setdefault(str(label), []).append((float(info["readiness"]), 100 * _avg(cmp, i)))
    for k, (label, pts) in enumerate(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label, color=f"C{k}")
    ax.set_xlabel("readiness (fraction of pre-training steps)")
    ax.set_ylabel("average dev score (×100)")
    ax.set_title("Fine-tuning score vs readiness")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_wilcoxon(cmp: Comparison, path: Path) -> Path:
    """Fig. 2b/2c: one-sided p-value heatmap (colour = -log10 p of "row better than column",
    * at p < 0.01, so a star always sits on the better model's row) beside the win fractions."""
    m = len(cmp.models)
    fig = Figure(figsize=(4 + 1.6 * m, 1.5 + 0.7 * m))
    with np.errstate(divide="ignore", invalid="ignore"):
        logp = -np.log10(cmp.pvalues)
        frac = np.where(cmp.n_pairs > 0, cmp.wins / np.maximum(cmp.n_pairs, 1), np.nan)
    text = cmp.pvalue_table()
    panels = [(logp, "-log10 p (Wilcoxon, row > column)", "viridis", text),
              (frac, "win fraction (row beats column)", "RdBu", None)]
    for k, (values, title, cmap, labels) in enumerate(panels):
        ax = fig.add_subplot(1, 2, k + 1)
        im = ax.imshow(np.ma.masked_invalid(values), cmap=cmap, vmin=0 if k else None,
                       vmax=1 if k else None)
        fig.colorbar(im, ax=ax, fraction=0.046)
        for i in range(m):
            for j in range(m):
                if i != j:
                    s = (labels[i][j] if labels
                         else f"{int(cmp.wins[i, j])}/{int(cmp.n_pairs[i, j])}")
                    ax.text(j, i, s, ha="center", va="center", fontsize=8, color="black",
                            bbox={"facecolor": "white", "alpha": 0.6, "linewidth": 0})
        ax.set_xticks(range(m), cmp.models, rotation=45, ha="right", fontsize=8)
        ax.set_yticks(range(m), cmp.models, fontsize=8)
        ax.set_title(title, fontsize=9)
    return _save(fig, path)


def plot_paired(cmp: Comparison, task: str, path: Path, baseline: str | None = None) -> Path | None:
    """Fig. 7: per-run scores of each model (y) against the baseline's paired run (x) for one task.

    Points above the diagonal are runs where the model beats the baseline with the same seed.
    Returns None when fewer than two models have runs of this task.
    """
    models = [mod for mod in cmp.models if any(k[0] == task for k in cmp.scores[mod])]
    base = baseline if baseline in models else (models[0] if models else None)
    if base is None or len(models) < 2:
        return None
    fig = Figure(figsize=(5, 5))
    ax = fig.add_subplot()
    ref = {k: v for k, v in cmp.scores[base].items() if k[0] == task}
    for c, mod in enumerate(m for m in models if m != base):
        common = [k for k in cmp.scores[mod] if k in ref]
        ax.scatter([100 * ref[k] for k in common], [100 * cmp.scores[mod][k] for k in common],
                   label=mod, color=f"C{c}", alpha=0.8)
    lo, hi = ax.get_xlim()
    lo, hi = min(lo, ax.get_ylim()[0]), max(hi, ax.get_ylim()[1])
    ax.plot([lo, hi], [lo, hi], color="grey", linewidth=1, linestyle=":")
    ax.set_xlabel(f"{base} (×100)")
    ax.set_ylabel("other model (×100)")
    averaged = all(str(k[1]).startswith(RUN_MEAN) for k in ref)  # compare_runs(per_run=True)
    ax.set_title(f"{task}: paired runs (same seed, "
                 f"{'metrics averaged per run' if averaged else 'all metrics'})")
    ax.legend(fontsize=8)
    return _save(fig, path)


def check_baseline(cmp: Comparison, baseline: str | None, results_path: str | Path) -> None:
    """--baseline must name a model of the results.

    Else the scatters would use another, silently.
    """
    if baseline is not None and baseline not in cmp.models:
        raise UserError(f"--baseline {baseline!r} is not a model in {results_path}; "
                        f"models present: {', '.join(cmp.models)}")


HEADING = "# Fine-tuning report"  # report.md's first line: how a rerun knows the file is ours


def _writes(name: str) -> bool:
    """Whether `make_report` writes a file of this name."""
    return (name in COMPARISON_FILES or name in ("report.md", "readiness.png", "wilcoxon.png")
            or (name.startswith("paired_") and name.endswith(".png")))


REPORT_KIND = report_kind("mlsm report", _writes, {**COMPARISON_HEADINGS, "report.md": HEADING})


def make_report(results_path: str | Path, out_dir: str | Path, baseline: str | None = None,
                per_run: bool = False) -> Path:
    """Write PNGs, the comparison tables (Markdown + CSV) and ``report.md`` embedding them.

    ``baseline``: the model on the x axis of the paired scatters (default: the first model).
    ``per_run``: pair one score per fine-tuning run, its metrics averaged (`compare_runs`), in
    the tables, the Wilcoxon figure and the scatters. Returns the path of ``report.md``.
    """
    guard_output(out_dir, REPORT_KIND, keep=[results_path])  # a user's files are never replaced
    cmp = compare_runs(results_path, per_run=per_run)
    check_baseline(cmp, baseline, results_path)
    with files_as_one(out_dir, _writes) as stage:  # tables, figures and report.md of one run
        _report_into(cmp, results_path, stage, baseline, per_run)
    return Path(out_dir) / "report.md"


def _report_into(cmp: Comparison, results_path: str | Path, out: Path, baseline: str | None,
                 per_run: bool) -> None:
    cmp.write(out)
    figures = [("Average score vs readiness (Fig. 4)", plot_readiness(cmp, out / "readiness.png")),
               ("One-sided Wilcoxon p-values, row better than column "
                f"(* p < {SIGNIFICANCE}), and win fractions (Fig. 2b/2c)",
                plot_wilcoxon(cmp, out / "wilcoxon.png"))]
    for task in dict.fromkeys(t for t, _ in cmp.columns):
        png = plot_paired(cmp, task, out / f"paired_{task}.png", baseline)
        if png is not None:
            figures.append((f"{task}: paired runs (Fig. 7)", png))
    pairing = ("one pair per fine-tuning run, its metrics averaged" if per_run
               else "one pair per fine-tuning run and metric")
    parts = [f"{HEADING}\n\nResults: `{results_path}`; "
             f"models: {', '.join(cmp.models)}; pairs: {pairing}.\n"]
    parts += [f"## {title}\n\n![{title}]({png.name})\n" for title, png in figures]
    parts.append(cmp.to_markdown())
    atomic_write_text(out / "report.md", "\n".join(parts))
