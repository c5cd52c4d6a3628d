"""Each pre-registered comparison read at equal training FLOPs as well as at equal steps.

At equal steps an arm with a teacher costs more than MLM: its frozen teacher runs a forward pass
to layer l on every batch (counted by `mlsm.train.flops`; v2's MLSM l = 5 cost 1.44x MLM per batch).
For each hypothesis `a` vs `b` this module gives the training FLOPs of both checkpoints, their
ratio, and, where the study holds a checkpoint of the costlier arm at no more FLOPs than the
other's (the largest such readiness point), the same test between those two checkpoints:
exploratory and uncorrected, with the FLOPs ratio that remains. A target store's build (the
`targets` stage, paid once and shared by every seed) is reported beside it in seconds, since
the FLOPs of a step do not include it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from mlsm.evaluate.compare.paired import p_text
from mlsm.study.hypotheses import Hypothesis, evaluate, split_model

TOLERANCE = 1e-3
"""Relative slack when matching FLOPs: a checkpoint at most 0.1 % above the other counts as
within its budget (readiness points are rounded to the percent)."""
EQUAL = 0.01
"""Two checkpoints whose FLOPs differ by at most 1 % are at equal compute already: no second
reading."""
MATCH = 0.05
"""The equal-FLOPs checkpoint must reach at least 95 % of the other's FLOPs; a readiness point
further below is not called equal compute (the section says none was close enough)."""


def arm_flops(compute: Sequence[dict[str, Any]], seeded: bool) -> dict[str, float]:
    """Declared arm -> training FLOPs of its whole run (FLOPs per batch x planned steps, from
    `arm_compute`'s rows, one per run)."""
    out: dict[str, float] = {}
    for c in compute:
        arm = split_model(f"{c['arm']}@100%", seeded)[0]
        if isinstance(c.get("flops_per_batch"), (int, float)):
            out.setdefault(arm, float(c["flops_per_batch"]) * float(c["steps"]))
    return out


def _split(model: str) -> tuple[str, float]:
    arm, _, label = model.rpartition("@")
    return arm, float(label.rstrip("%")) / 100


def equal_flops_point(costly: float, cheap: float, frac: float,
                      fracs: Sequence[float]) -> float | None:
    """The largest readiness point f of `fracs` with f x `costly` <= `frac` x `cheap` (FLOPs of
    the whole runs; within TOLERANCE), or None when none is."""
    budget = frac * cheap * (1 + TOLERANCE)
    fit = [f for f in fracs if f * costly <= budget]
    return max(fit) if fit else None


def equal_compute(hyps: Sequence[Hypothesis], rows: Sequence[dict[str, Any]],
                  flops: dict[str, float], fracs: Sequence[float],
                  seeded: bool) -> list[dict[str, Any]]:
    """Per hypothesis: both checkpoints' training FLOPs and, where the study has one, the test at
    equal FLOPs (the costlier side moved to its equal-FLOPs checkpoint)."""
    out = []
    for h in hyps:
        (arm_a, fa), (arm_b, fb) = _split(h.a), _split(h.b if h.b != "control" else h.a)
        cost_a, cost_b = flops.get(arm_a, math.nan), flops.get(arm_b, math.nan)
        row: dict[str, Any] = {"id": h.id, "a": h.a, "b": h.b,
                               "flops_a": fa * cost_a, "flops_b": fb * cost_b}
        row["ratio"] = row["flops_a"] / row["flops_b"] if row["flops_b"] else math.nan
        moved = None
        if h.b != "control" and math.isfinite(row["ratio"]) and abs(row["ratio"] - 1) > EQUAL:
            a_costs_more = row["ratio"] > 1
            costly, cheap, frac = (cost_a, cost_b, fb) if a_costs_more else (cost_b, cost_a, fa)
            point = equal_flops_point(costly, cheap, frac, fracs)
            if point is not None:
                label = f"{100 * point:g}%"
                moved = dataclasses.replace(h, a=f"{arm_a}@{label}") if a_costs_more else \
                    dataclasses.replace(h, b=f"{arm_b}@{label}")
        ratio = math.nan if moved is None else \
            (_split(moved.a)[1] * cost_a) / (_split(moved.b)[1] * cost_b)
        if moved is not None and min(ratio, 1 / ratio) >= 1 - MATCH:
            (got,) = evaluate([moved], rows, seeded)
            row["equal"] = {"a": moved.a, "b": moved.b, "ratio": ratio, "n": got["n"],
                            "mean_diff": got["mean_diff"], "ci95": got["ci95"], "p": got["p"]}
        out.append(row)
    return out


def _num(x: Any, digits: int = 4) -> str:
    return f"{x:.{digits}f}" if isinstance(x, (int, float)) and math.isfinite(x) else "—"


def equal_compute_lines(got: Sequence[dict[str, Any]],
                        store_seconds: float | None = None) -> list[str]:
    """The report's "Equal compute" section (exploratory)."""
    if not got:
        return []
    lines = ["### Equal compute (exploratory)\n",
             "Training FLOPs of each pre-registered comparison's checkpoints (`mlsm flops`'s "
             "accounting: student forward and backward, heads at the masked positions, a frozen "
             "teacher's forward to its layer l), their ratio, and the same test at equal FLOPs "
             "where the study holds a checkpoint of the costlier arm at no more FLOPs than the "
             "other's (that arm's largest such readiness point; uncorrected).\n",
             "| id | a | b | FLOPs a | FLOPs b | a / b | at equal FLOPs | a / b there | seeds | "
             "mean a − b [95 % CI] | p |", "|---|---|---|---:|---:|---:|---|---:|---:|---|---:|"]
    for r in got:
        e = r.get("equal")
        head = (f"| {r['id']} | {r['a']} | {r['b']} | {r['flops_a']:.3g} | {r['flops_b']:.3g} | "
                f"{_num(r['ratio'], 2)} |")
        if e is None:
            why = "equal already" if abs(r["ratio"] - 1) <= EQUAL else \
                "— (no checkpoint within 5 %)"
            lines.append(head + f" {why} | | | | |")
            continue
        ci = f"{_num(e['mean_diff'])} [{_num(e['ci95'][0])}, {_num(e['ci95'][1])}]"
        lines.append(head + f" {e['a']} vs {e['b']} | {_num(e['ratio'], 3)} | {e['n']} | {ci} | "
                            f"{p_text(e['p'])} |")
    if store_seconds:
        lines.append(f"\nThe target store's build, shared by every seed of the arms that read "
                     f"it, took {store_seconds:,.0f} s on top (not in the FLOPs above).")
    return lines + [""]
