"""Readouts against steps and against training FLOPs: one panel per readout, one line per run
(a study's arm), each control dashed (x markers) in its run's colour. Drawn on `Figure` objects
with the Agg canvas, so no pyplot state is touched."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from mlsm.fileio import atomic_write

Key = tuple[str, str, str]  # (kind, task, metric)
AXES = {"step": "step", "train_flops": "training FLOPs (step x FLOPs per batch)"}
PLOT_NAMES = {"step": "readouts_steps.png", "train_flops": "readouts_flops.png"}  # by x axis


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def headline(rows: list[dict[str, Any]]) -> dict[Key, list[dict[str, Any]]]:
    """Rows that are one number per model (not one phenomenon of a pair set), by readout."""
    out: dict[Key, list[dict[str, Any]]] = {}
    for r in rows:
        if "phenomenon" not in r and finite(r.get("value")):
            out.setdefault((r["kind"], r["task"], r["metric"]), []).append(r)
    return dict(sorted(out.items()))


def run_of(row: dict[str, Any]) -> str:
    """The line a row belongs to: its study arm, else the run its checkpoint folder lies in
    (RUN/checkpoints/step-N), else the model's name before any @."""
    if row.get("arm"):
        return str(row["arm"])
    folder = Path(str(row.get("checkpoint", "")))
    if folder.parent.name == "checkpoints":
        return folder.parent.parent.name
    return str(row.get("model", "?")).split("@")[0]


def plot_readouts(rows: list[dict[str, Any]], x: str, path: Path,
                  line_of: Callable[[dict[str, Any]], str] = run_of) -> str | None:
    """Write the figure of every readout against `x` ("step" or "train_flops"); its file name, or
    None when no row has an `x`."""
    panels = {k: v for k, v in headline(rows).items() if any(finite(r.get(x)) for r in v)}
    if not panels:
        return None
    lines = sorted({line_of(r) for got in panels.values() for r in got})
    cols = min(4, len(panels))
    nrows = -(-len(panels) // cols)
    fig = Figure(figsize=(3.4 * cols, 2.6 * nrows))
    for i, ((kind, task, metric), got) in enumerate(panels.items()):
        ax = fig.add_subplot(nrows, cols, i + 1)
        for k, line in enumerate(lines):
            pts = sorted((r[x], r["value"], r.get("control")) for r in got
                         if line_of(r) == line and finite(r.get(x)))
            if not pts:
                continue
            xs = [p[0] for p in pts]
            ax.plot(xs, [p[1] for p in pts], marker="o", color=f"C{k}", label=line, linewidth=1)
            if all(finite(p[2]) for p in pts):
                ax.plot(xs, [p[2] for p in pts], linestyle="--", marker="x", color=f"C{k}",
                        linewidth=0.8)
        ax.set_title(f"{kind}: {task} {metric}", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if x == "train_flops":
            ax.set_xscale("log")
    fig.axes[0].legend(fontsize=7)
    fig.supxlabel(AXES[x], fontsize=9)
    fig.tight_layout()
    FigureCanvasAgg(fig)
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight"))
    return path.name


def write_plots(rows: list[dict[str, Any]], folder: Path,
                line_of: Callable[[dict[str, Any]], str] = run_of) -> list[str]:
    """readouts_steps.png and readouts_flops.png in `folder` (those that have points)."""
    names = []
    for x, name in PLOT_NAMES.items():
        png = plot_readouts(rows, x, folder / name, line_of)
        if png:
            names.append(png)
    return names
