"""The evaluation half of `mlsm demo`: paired fine-tuning, a BLiMP subset, the report."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlsm.evaluate.blimp import evaluate_blimp, write_blimp_report
from mlsm.evaluate.finetune import finetune
from mlsm.evaluate.report import make_report
from mlsm.evaluate.stats import compare_runs, read_results


def finetune_both(models: dict[str, Path], shared: Path | None, held: list[str], out: Path,
                  seeds: int, make_task: Callable[[list[str], Path], Path]) -> tuple[Path, str]:
    """Fine-tune every model on SST-2 (GLUE data found) or the word-order task; paired seeds."""
    if shared is not None and (shared / "glue" / "SST-2").is_dir():
        task, data_dir = "sst2", shared / "glue"
    else:
        if not held:
            from mlsm.demo import stdlib_prose

            held = stdlib_prose()[:300]
        task, data_dir = "word_order", make_task(held, out)
    results = out / "finetune" / "results.jsonl"
    results.parent.mkdir(parents=True, exist_ok=True)
    # lr 1e-4: tiny students trained for minutes learn too little at the paper's 2e-5 in 3 epochs
    finetune([f"{name}={path}" for name, path in models.items()], [task], seeds=range(seeds),
             lrs=(1e-4,), epochs=3, batch_size=32, max_len=128, data_dir=data_dir,
             results=results, max_train_examples=2000)
    return results, task


def score_blimp(scorers: dict[str, tuple[Any, Any]], data: Path, pairs: int, out: Path) -> dict[str, Any]:
    """BLiMP accuracy by PLL on `pairs` pairs of every phenomenon, per model."""
    found = {}
    for name, (model, tok) in scorers.items():
        target = out / "blimp" / name
        if (target / "blimp.json").is_file():
            found[name] = json.loads((target / "blimp.json").read_text())
            continue
        result = evaluate_blimp(model, tok, data, limit_per_phenomenon=pairs)
        write_blimp_report(result, target)
        found[name] = result
    return found


def _metrics(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _plot_pretraining(runs: dict[str, Path], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.4))
    axes = fig.subplots(1, 2)
    for name, run in runs.items():
        rows = _metrics(run)
        axes[0].plot([r["step"] for r in rows], [r["loss"] for r in rows], label=f"{name} loss")
        axes[1].plot([r["step"] for r in rows], [r["tokens_per_s"] for r in rows], label=name)
    axes[0].set(xlabel="step", ylabel="training loss", title="loss (MLM: CE over V; MLSM: KL over k)")
    axes[1].set(xlabel="step", ylabel="tokens/s", title="throughput")
    for ax in axes:
        ax.legend()
    fig.tight_layout()
    FigureCanvasAgg(fig).print_png(str(path))


def summary_rows(runs: dict[str, Path], results: Path, task: str, blimp: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per model: final loss, median tokens/s, fine-tuning mean, BLiMP accuracy."""
    rows = []
    records = read_results(results)
    for name, run in runs.items():
        m = _metrics(run)
        scores = [r["value"] for r in records if r["model"] == name and r["task"] == task]
        row = {
            "model": name, "final loss": m[-1]["loss"],
            "tokens/s": round(statistics.median(r["tokens_per_s"] for r in m)),
            f"{task} (mean over seeds)": statistics.mean(scores) if scores else "–",
        }
        if blimp:
            row["BLiMP subset"] = blimp[name]["overall"] if name in blimp else "–"
        rows.append(row)
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    keys = list(rows[0])
    fmt = lambda v: f"{v:,.3f}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def write_report(out: Path, runs: dict[str, Path], results: Path, task: str, blimp: dict[str, Any]) -> Path:
    """report/demo.md with the summary table, the paired comparison and the plots."""
    report_dir = out / "report"
    report_dir.mkdir(parents=True, exist_ok=True)
    _plot_pretraining(runs, report_dir / "pretraining.png")
    make_report(results, report_dir / "finetune")
    table = _table(summary_rows(runs, results, task, blimp))
    parts = [
        "# mlsm demo: MLSM vs MLM", "",
        "Two identical tiny students (BERT, 2 layers, d = 128) pre-trained on the same batches; "
        "MLSM targets come from all-MiniLM-L6-v2 layer 5 through a k = 1536 dictionary.", "",
        table, "", "![pretraining](pretraining.png)", "",
        f"## Fine-tuning ({task}, paired seeds)", "", compare_runs(results).to_markdown(), "",
        "Figures: [finetune/report.md](finetune/report.md)", "",
    ]
    if blimp:
        parts += ["## BLiMP subset (PLL; MLSM through its linear probe)", "",
                  _table([{"model": n, "overall": r["overall"], "pairs": r["n_pairs"]} for n, r in blimp.items()])]
    else:
        parts += ["BLiMP was not scored: no `blimp/` folder was found. Pass `mlsm demo --data PATH` "
                  "with a folder holding `blimp/` (and `glue/` for SST-2) to add it."]
    path = report_dir / "demo.md"
    path.write_text("\n".join(parts) + "\n")
    print("\n" + table + f"\n\nreport: {path}")
    return path
