"""The readouts section of a study report: every readout against steps and against training FLOPs
(`mlsm.evaluate.readout_plots`: one line per arm, its control dashed) and a table of the values."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from mlsm.artifacts.jsonl import read_jsonl
from mlsm.errors import UserError
from mlsm.evaluate.readout_plots import finite, headline, write_plots
from mlsm.study.folder import Study
from mlsm.study.reuse import current_rows


def readout_rows(study: Study) -> list[dict[str, Any]]:
    """Every row of STUDY_OUT/readouts/*.jsonl (a file is written whole by its stage)."""
    folder = study.root / "readouts"
    rows = []
    for path in sorted(folder.glob("*.jsonl")) if folder.is_dir() else []:
        fix = f"delete {path} and run the study with --stages readout to take that readout again"
        for number, row in read_jsonl(path, "readout file", fix).rows:
            if not isinstance(row, dict) or not isinstance(row.get("arm"), str):
                raise UserError(f"{path}:{number} is not a readout row; {fix}")
            rows.append(row)
    return current_rows(study, "readout", rows)


def _cell(r: dict[str, Any]) -> str:
    scale = 100 if r["kind"] != "masked" or r["metric"] == "top1" else 1
    digits = 1 if scale == 100 else 3
    control = f" ({r['control'] * scale:.{digits}f})" if finite(r.get("control")) else ""
    p = f", p {r['p_vs_control']:.2g}" if finite(r.get("p_vs_control")) else ""
    return f"{r['value'] * scale:.{digits}f}{control}{p}"


def readout_section(study: Study, dest: Path) -> tuple[list[str], list[dict[str, Any]]]:
    """Markdown parts and the rows (for summary.json); the plots go into `dest`."""
    rows = readout_rows(study)
    if not rows:
        return [], []
    parts = ["## Readouts (docs/readouts.md)\n",
             "Each cell: the model's value (its control on the same items in brackets; "
             "probes: the majority / mean training label; pairs and masked tokens: the add-one "
             "unigram of the tokens the run consumed), and for pair sets the Wilcoxon p of model − "
             "unigram over phenomena (two-sided), for masked top-1 the binomial p against the "
             "unigram's rate. Rates in %, losses in nats. Dashed lines in the plots: controls.\n"]
    parts += [f"![readouts]({png})\n" for png in write_plots(rows, dest)]
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
