"""The readouts section of a study report: every readout against steps and against training FLOPs
(one line per arm, its control dashed in the same colour) and a table of the values."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from mlsm.errors import UserError
from mlsm.fileio import atomic_write
from mlsm.study.runner import Study

Key = tuple[str, str, str]  # (kind, task, metric)


def readout_rows(study: Study) -> list[dict[str, Any]]:
    """Every row of STUDY_OUT/readouts/*.jsonl (a file is written whole by its stage)."""
    folder = study.root / "readouts"
    rows = []
    for path in sorted(folder.glob("*.jsonl")) if folder.is_dir() else []:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise UserError(f"{path}:{number} is not JSON; delete {path} and run the study "
                                "with --stages readout to take that readout again") from None
            if not isinstance(row, dict) or not isinstance(row.get("arm"), str):
                raise UserError(f"{path}:{number} is not a readout row; delete {path} and run "
                                "the study with --stages readout again")
            rows.append(row)
    return rows


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def headline(rows: list[dict[str, Any]]) -> dict[Key, list[dict[str, Any]]]:
    """Rows that are one number per model (not one phenomenon of a pair set), by readout."""
    out: dict[Key, list[dict[str, Any]]] = {}
    for r in rows:
        if "phenomenon" not in r and _finite(r.get("value")):
            out.setdefault((r["kind"], r["task"], r["metric"]), []).append(r)
    return dict(sorted(out.items()))


def plot_readouts(study: Study, rows: list[dict[str, Any]], x: str, path: Path) -> str | None:
    """One panel per readout, `x` ("step" or "train_flops") on the horizontal axis."""
    panels = {k: v for k, v in headline(rows).items() if any(_finite(r.get(x)) for r in v)}
    if not panels:
        return None
    cols = min(4, len(panels))
    nrows = -(-len(panels) // cols)
    fig = Figure(figsize=(3.4 * cols, 2.6 * nrows))
    for i, ((kind, task, metric), got) in enumerate(panels.items()):
        ax = fig.add_subplot(nrows, cols, i + 1)
        for k, arm in enumerate(study.spec.arms):
            pts = sorted((r[x], r["value"], r.get("control")) for r in got
                         if r["arm"] == arm and _finite(r.get(x)))
            if not pts:
                continue
            xs = [p[0] for p in pts]
            ax.plot(xs, [p[1] for p in pts], marker="o", color=f"C{k}", label=arm, linewidth=1)
            if all(_finite(p[2]) for p in pts):
                ax.plot(xs, [p[2] for p in pts], linestyle="--", color=f"C{k}", linewidth=0.8)
        ax.set_title(f"{kind}: {task} {metric}", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if x == "train_flops":
            ax.set_xscale("log")
    fig.axes[0].legend(fontsize=7)
    fig.supxlabel("training FLOPs (step x FLOPs per batch)" if x == "train_flops" else "step",
                  fontsize=9)
    fig.tight_layout()
    FigureCanvasAgg(fig)
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight"))
    return path.name


def _cell(r: dict[str, Any]) -> str:
    scale = 100 if r["kind"] != "masked" or r["metric"] == "top1" else 1
    digits = 1 if scale == 100 else 3
    control = f" ({r['control'] * scale:.{digits}f})" if _finite(r.get("control")) else ""
    p = f", p {r['p_vs_control']:.2g}" if _finite(r.get("p_vs_control")) else ""
    return f"{r['value'] * scale:.{digits}f}{control}{p}"


def readout_section(study: Study) -> tuple[list[str], list[dict[str, Any]]]:
    """Markdown parts and the rows (for summary.json)."""
    rows = readout_rows(study)
    if not rows:
        return [], []
    parts = ["## Readouts (docs/readouts.md)\n",
             "Each cell: the model's value (its control on the same items in brackets; "
             "probes: the majority / mean training label; pairs and masked tokens: the add-one "
             "unigram of the pre-training store), and for pair sets the Wilcoxon p of model − "
             "unigram over phenomena (two-sided), for masked top-1 the binomial p against the "
             "unigram's rate. Rates in %, losses in nats. Dashed lines in the plots: controls.\n"]
    for x, name in (("step", "readouts_steps.png"), ("train_flops", "readouts_flops.png")):
        png = plot_readouts(study, rows, x, study.root / name)
        if png:
            parts.append(f"![readouts vs {x}]({png})\n")
    table = headline(rows)
    models = sorted({r["model"] for r in rows}, key=lambda m: (m.split("@")[0], _pct(m)))
    parts += ["| model | " + " | ".join(f"{k} {t} {m}" for k, t, m in table) + " |",
              "|---|" + "---:|" * len(table)]
    for model in models:
        cells = []
        for got in table.values():
            mine = [r for r in got if r["model"] == model]
            cells.append(_cell(mine[0]) if mine else "—")
        parts.append(f"| {model} | " + " | ".join(cells) + " |")
    notes = sorted({f"{r['model']} {r['kind']}: {r['note']}" for r in rows if r.get("note")})
    parts += [""] + [f"- {n}" for n in notes] + [""]
    return parts, rows


def _pct(model: str) -> float:
    try:
        return float(model.rpartition("@")[2].rstrip("%"))
    except ValueError:
        return math.inf
