"""The cost sections of a study report: each arm's compute (FLOPs, tokens, pre-training and
training time, precision), the wall time of every stage, and what failed; with how the report's
tables show a number (`fmt`)."""

from __future__ import annotations

import math
from typing import Any

from mlsm.artifacts.rundir import RunDir
from mlsm.inputs import is_number
from mlsm.study.executors import job_inner, standing_failures
from mlsm.study.folder import Study


def arm_metrics(study: Study, arm: str) -> list[dict[str, Any]]:
    """The rows of the arm's metrics.jsonl (a torn line skipped with a warning in the study log)."""
    return RunDir(study.run_dir(arm)).metric_rows(warn=lambda m: study.log(f"[study] warning: {m}"))


def training_seconds(rows: list[dict[str, Any]]) -> float:
    """Seconds spent in training steps, summed over the logged windows of metrics.jsonl.

    Each row's `tokens_per_s` is measured over the steps since the previous row of the same
    process, so tokens / rate summed over rows stays exact across any number of resumes (the
    stage's wall time only covers its last, uninterrupted segment) and leaves out checkpoint saves.
    """
    total, prev_tokens = 0.0, 0
    for row in rows:
        tokens, rate = row.get("tokens"), row.get("tokens_per_s")
        if tokens is None or not rate or tokens <= prev_tokens:
            prev_tokens = tokens or prev_tokens
            continue
        total += (tokens - prev_tokens) / rate
        prev_tokens = tokens
    return total


def arm_compute(study: Study) -> list[dict[str, Any]]:
    """Per arm: objective, steps done, tokens, FLOPs per batch (flops_for_run), pre-training wall
    time of the stage's last run and training time summed over every resumed segment."""
    from mlsm.train.flops import flops_for_run
    from mlsm.train.throughput import flops_row_of

    times = stage_times(study)
    out = []
    for arm in study.spec.arms:
        cfg = study.arm_config(arm)
        rows = arm_metrics(study, arm)
        step = rows[-1]["step"] if rows else 0
        try:
            table = flops_for_run(cfg)
            row = flops_row_of(table, cfg.objective.name)
            flops = row.total if row is not None else math.nan
        except Exception:  # a missing dictionary/teacher config: report the rest
            flops = math.nan
        out.append({"arm": arm, "objective": cfg.objective.name, "steps_done": step,
                    "steps": cfg.train.steps,
                    "tokens": step * cfg.train.batch_size * cfg.data.max_len,
                    "flops_per_batch": flops, "pretrain_seconds": times.get(("pretrain", arm), 0.0),
                    "training_seconds": training_seconds(rows),
                    "final_loss": rows[-1]["loss"] if rows else math.nan,
                    **_precision(study, arm, trained=bool(rows))})
    return out


def _precision(study: Study, arm: str, trained: bool) -> dict[str, Any]:
    """The precisions the arm's run trained in, as its run.json segments recorded them
    (`precisions`), and how the compute table shows them (`precision`; segments written before
    the precision was recorded, or a run that trained without a run.json to read, as in a piece
    published before pieces carried it, say "not recorded"; "—" is an arm with no training)."""
    seen = RunDir(study.run_dir(arm)).segment_values("precision")
    known = sorted({p for p in seen if isinstance(p, str)})
    unknown = any(not isinstance(p, str) for p in seen) or (trained and not seen)
    shown = known + (["not recorded"] if unknown else [])
    return {"precisions": known, "precision": " + ".join(shown) or "—"}


def _precision_warning(compute: list[dict[str, Any]]) -> list[str]:
    """A line when the arms' recorded segments, together, trained in more than one precision
    (across arms or within one resumed arm): a difference then mixes the objective with the
    arithmetic. Segments that recorded none are not counted as a precision of their own."""
    if len({p for c in compute for p in c.get("precisions", [])}) <= 1:
        return []
    listed = ", ".join(f"{c['arm']}: {c.get('precision', '—')}" for c in compute)
    return ["", f"**Arms trained in different precisions** ({listed}): a difference between "
                "them mixes the objective with the arithmetic.\n"]


def stage_times(study: Study) -> dict[tuple[str, str | None], float]:
    times: dict[tuple[str, str | None], float] = {}
    for row in study.stage_runs():
        key = (row["stage"], row["arm"])
        times[key] = times.get(key, 0.0) + float(row["seconds"])
    return times


def _number(x: Any) -> bool:
    """A number a report table can show (finite)."""
    return is_number(x) and math.isfinite(x)


def fmt(x: Any, scale: float = 1.0, digits: int = 2) -> str:
    """x / scale with `digits` decimals (scale 0.01: a rate as %); '—' when x is no number."""
    return f"{x / scale:.{digits}f}" if _number(x) else "—"


def cost_tables(compute: list[dict[str, Any]], times: dict, study: Study) -> list[str]:
    """Compute per arm, the wall time of every stage, and what failed."""
    lines = ["## Compute per arm\n",
             "Pre-training wall: the stage's last uninterrupted run. Training time: the logged "
             "windows of `metrics.jsonl` summed over every resumed segment (saves left out).\n",
             "| arm | objective | precision | steps | tokens | GFLOPs / batch | "
             "pre-training wall (s) | training time (s) | final loss |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {c['arm']} | {c['objective']} | {c.get('precision', '—')} | "
              f"{c['steps_done']}/{c['steps']} | "
              f"{c['tokens']:,} | {fmt(c['flops_per_batch'], 1e9, 0)} | "
              f"{c['pretrain_seconds']:.0f} | {c['training_seconds']:.0f} | "
              f"{fmt(c['final_loss'], 1, 3)} |" for c in compute]
    lines += _precision_warning(compute)
    lines += ["", "## Wall time of every stage\n",
              "seconds: the stage's own run. Its subprocess: the `python -m mlsm.study.job` "
              "process that ran it (start-up and loading included), where one did; so the "
              "seconds column sums each piece of work once. A `STAGE-job` row of its own ran "
              "several rows above (a whole arm's job).\n",
              "| stage | arm / model | seconds | its subprocess (s) |", "|---|---|---:|---:|"]
    lines += _wall_rows(times)
    failed = standing_failures(study)
    if failed:
        lines += ["", "## Failed\n"] + [f"- `{k}`: {v.get('error', '')}" for k, v in failed.items()]
    return lines


def _wall_rows(times: dict[tuple[str, str | None], float]) -> list[str]:
    """One row per stage record, with the subprocess that ran it beside it (`job_inner`) rather
    than as a second row a reader would add twice."""
    jobs = {job_inner(s, a): t for (s, a), t in times.items() if s.endswith("-job") and a}
    beside = {key: f"{t:.0f}" for key, t in jobs.items() if key in times}
    return [f"| {s} | {a or ''} | {t:.0f} | {beside.get((s, a), '')} |"
            for (s, a), t in times.items()
            if not (s.endswith("-job") and a and job_inner(s, a) in beside)]
