"""Pre-registered hypotheses of a study: declared in the study file, hashed into the study folder
before any evaluation row exists, evaluated over results rows paired by pre-training seed, with
Holm's correction across all of them (`mlsm.evaluate.compare.paired`).

A hypothesis compares two models `a` and `b` ("ARM@P%", e.g. mlsm_l5@100%; `b` may be `control`:
the control value each row of `a` carries, e.g. the unigram control of a minimal-pair readout) on
one (kind, task, metric) of the study's rows. The rows are any results rows: fine-tuning rows
(results.jsonl: model, task, metric, value; no kind), readout rows (STUDY_OUT/readouts/*.jsonl:
model, kind, task, metric, value, control) and the BLiMP stage's scores (as pairs / masked rows).
Per pre-training seed the value is the mean of its matching rows (over fine-tuning seeds and lrs);
task "*" averages the per-task means with equal weight. Rows of one phenomenon are left out.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from mlsm.artifacts.jsonl import read_jsonl
from mlsm.errors import UserError
from mlsm.evaluate.compare.paired import (
    TESTS,
    holm,
    mean_ci,
    min_detectable_effect,
    p_text,
    paired_p,
)
from mlsm.fileio import atomic_write_text
from mlsm.inputs import is_number, read_json

RECORD = "preregistration.json"
"""File in the study folder holding the hypotheses' hash, written before any evaluation row."""


@dataclass
class Hypothesis:
    id: str = ""
    """Short unique name (H1, ...), used in the report and summary.json."""
    statement: str = ""
    """The hypothesis in words, as registered."""
    a: str = ""
    """First model, ARM@P% (an arm of the study at one of its readiness points)."""
    b: str = ""
    """Second model, ARM@P%, or `control`: the control value carried by a's rows (unigram,
    majority label) of the same items."""
    kind: str = ""
    """Row kind: a readout's (probe, pairs, masked); empty = fine-tuning rows (no kind)."""
    task: str = ""
    """Task of the rows (rte, heldout, blimp, ...); `*` = the mean over the tasks both models
    have, each task weighted equally."""
    metric: str = ""
    """Metric of the rows (accuracy, top1, loss, acc, mcc, ...), as the rows name it; `*` = the
    mean of each task's metrics (for kinds whose metrics all grow with quality, e.g. probe)."""
    direction: Literal["greater", "less", "two-sided"] = "greater"
    """Registered direction of a - b."""
    test: Literal["paired-t", "wilcoxon"] = "paired-t"
    """Test over the pre-training seeds: paired-t (assumes roughly normal seed-to-seed
    differences; the only one that can reach p < 0.05 with under 5 seeds one-sided, 6
    two-sided) or wilcoxon (signed rank, exact; needs 5 seeds for one-sided 0.05, 6 for
    two-sided)."""
    alpha: float = 0.05
    """Family-wise level; Holm's correction runs across all hypotheses, which share it."""


def parse_hypotheses(raw: Any, arms: Sequence[str], readiness: Sequence[float]) -> list[Hypothesis]:
    """The study file's `hypotheses:` list, each entry checked (unknown key, arm, readiness)."""
    from mlsm.config import build_dataclass

    if raw is None:
        return []
    if not isinstance(raw, list):
        raise UserError("hypotheses must be a list of {id, statement, a, b, kind, task, metric, "
                        "direction, test, alpha} entries; see docs/study.md")
    hyps = [build_dataclass(Hypothesis, h, "hypotheses") for h in raw]
    ids = [h.id for h in hyps]
    for h in hyps:
        where = f"hypotheses {h.id or '(no id)'}"
        if not h.id or ids.count(h.id) > 1:
            raise UserError(f"{where}: every hypothesis needs its own id (H1, H2, ...)")
        if not h.metric or not h.task:
            raise UserError(f"{where}: set task (a name, or * for the mean over tasks) and metric")
        for side in ("a", "b"):
            if not (side == "b" and h.b == "control"):
                _check_model(where, side, getattr(h, side), arms, readiness)
        if h.a == h.b:
            raise UserError(f"{where}: a and b are both {h.a}; compare two models")
        if h.test not in TESTS or not 0 < h.alpha < 1:
            raise UserError(f"{where}: test must be one of {', '.join(TESTS)} and alpha in (0, 1)")
    if len({h.alpha for h in hyps}) > 1:
        raise UserError("hypotheses: give every hypothesis the same alpha (Holm's correction "
                        "controls one family-wise level across all of them)")
    return hyps


def _check_model(where: str, side: str, text: str, arms: Sequence[str],
                 readiness: Sequence[float]) -> None:
    arm, at, label = text.rpartition("@")
    if not at:
        raise UserError(f"{where}: {side} = {text!r} must be ARM@P%, e.g. {arms[0]}@100%")
    if arm not in arms:
        raise UserError(f"{where}: {side} = {text!r} names no arm of the study; write ARM@P% with "
                        f"ARM one of {', '.join(arms)}")
    if label not in [f"{100 * f:g}%" for f in readiness]:
        raise UserError(f"{where}: {side} = {text!r}: {label or '(none)'} is not a readiness "
                        f"point; use one of {', '.join(f'{100 * f:g}%' for f in readiness)}")


# --- pre-registration record ----------------------------------------------------------------
def hypotheses_hash(hyps: Sequence[Hypothesis]) -> str:
    """SHA-256 of the hypotheses as canonical JSON: any change of any field changes it."""
    text = json.dumps([asdict(h) for h in hyps], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def evaluation_outputs_exist(root: Path) -> bool:
    """Whether the study folder already holds an evaluation row (fine-tuning, BLiMP, readouts)."""
    results = root / "results.jsonl"
    if results.is_file() and results.read_bytes().strip():
        return True
    folders = [root / d for d in ("blimp", "readouts") if (root / d).is_dir()]
    return any(any(folder.glob("*.json*")) for folder in folders)


def record_preregistration(root: Path, hyps: Sequence[Hypothesis], revision: str) -> None:
    """Write STUDY_OUT/preregistration.json unless it exists: the hash of the hypotheses and
    whether evaluation rows already existed then (if so they were not registered beforehand)."""
    path = root / RECORD
    if path.exists():
        return
    record = {"hash": hypotheses_hash(hyps), "hypotheses": [asdict(h) for h in hyps],
              "recorded": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "git_revision": revision, "results_existed": evaluation_outputs_exist(root)}
    atomic_write_text(path, json.dumps(record, indent=2) + "\n")


def preregistration_problems(root: Path, hyps: Sequence[Hypothesis]) -> list[str]:
    """Why the hypotheses cannot count as pre-registered (empty = they do): no record, a record
    made after results existed, or hypotheses changed since the record."""
    path = root / RECORD
    if not path.is_file():
        return [f"no {RECORD} in the study folder: the hypotheses were never recorded before "
                "results, so they cannot count as pre-registered"]
    rec = read_json(path, "pre-registration record", "restore it from the study's copy; a "
                    "record cannot be remade after results exist",
                    fields={"hash": "text", "recorded": "text", "results_existed": "bool"})
    out = []
    if rec["results_existed"]:
        out.append(f"the hypotheses were first recorded on {rec['recorded']}, when evaluation "
                   "rows already existed: they are not pre-registered")
    if rec["hash"] != hypotheses_hash(hyps):
        out.append(f"the hypotheses CHANGED after they were recorded on {rec['recorded']} "
                   f"(hash {rec['hash'][:12]} then, {hypotheses_hash(hyps)[:12]} now): "
                   "PRE-REGISTRATION BROKEN; the record holds the registered ones")
    return out


# --- rows -----------------------------------------------------------------------------------
def study_rows(root: Path, warn: Callable[[str], None] = print,
               keep: Callable[[str, dict[str, Any]], bool] | None = None) -> list[dict[str, Any]]:
    """Every results row of a study folder: fine-tuning rows (results.jsonl), readout rows
    (readouts/*.jsonl) and the BLiMP stage's scores as pairs / masked rows (only for a
    (model, kind, task, metric) no readout row gives). keep(kind, row), kind "readout" or
    "blimp" (a BLiMP file): False leaves the row out (made from other inputs or settings)."""
    keep = keep or (lambda kind, row: True)
    from mlsm.artifacts.results_file import read_results

    rows: list[dict[str, Any]] = []
    results = root / "results.jsonl"
    if results.is_file() and results.read_bytes().strip():
        rows += read_results(results, warn=warn)
    folder = root / "readouts"
    for path in sorted(folder.glob("*.jsonl")) if folder.is_dir() else []:
        found = read_jsonl(path, "readout file", f"delete {path} and run the study with "
                           "--stages readout again", warn=warn)
        rows += [r for _, r in found.rows if keep("readout", r)]
    have = {_key(r) for r in rows}
    folder = root / "blimp"
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        b = read_json(path, "BLiMP result", "delete it and run the study with --stages blimp "
                      "to score that model again")
        rows += [r for r in _blimp_as_rows(b) if _key(r) not in have] if keep("blimp", b) else []
    return rows


def _key(r: dict[str, Any]) -> tuple:
    return r.get("model"), r.get("kind", ""), r.get("task"), r.get("metric")


def _blimp_as_rows(b: dict[str, Any]) -> list[dict[str, Any]]:
    """A BLiMP stage file as rows: each pair set's accuracy (kind pairs) and the held-out masked
    top-1 / loss with the unigram's as control (kind masked, task heldout; through each readout
    control, task heldout:HEAD)."""
    model = f"{b['arm']}@{100 * b['readiness']:g}%"
    rows = [{"model": model, "kind": "pairs", "task": name, "metric": "accuracy",
             "value": s.get("overall")} for name, s in (b.get("sets") or {}).items()]
    scored = {"heldout": b.get("heldout") or {}}  # through the arm's own head (or its probe)
    scored.update({f"heldout:{head}": h for head, h in (b.get("controls") or {}).items()})
    for task, h in scored.items():  # the readout controls: task heldout:vocab, heldout:factored
        for metric, control in (("top1", "unigram_top1"), ("loss", "unigram_loss")):
            if isinstance(h, dict) and metric in h:
                rows.append({"model": model, "kind": "masked", "task": task, "metric": metric,
                             "value": h[metric], "control": h.get(control)})
    return rows


# --- evaluation -----------------------------------------------------------------------------
def split_model(model: str, seeded: bool) -> tuple[str, int | None, str]:
    """'mlm-s1@100%' -> ('mlm', 1, '100%') in a study with `seeds` (runs are ARM-s<seed>);
    'mlm@100%' -> ('mlm', None, '100%') in one without."""
    run, _, label = str(model).rpartition("@")
    if not seeded:
        return run, None, label
    arm, _, seed = run.rpartition("-s")
    return (arm, int(seed), label) if arm and seed.isdigit() else (run, None, label)


def seed_values(h: Hypothesis, side: str, rows: Sequence[dict[str, Any]],
                seeded: bool) -> dict[Any, dict[str, float]]:
    """{pre-training seed: {task: mean value}} of model `a` or `b` (b = control: the control of
    a's rows) over the rows matching h's kind, task and metric (metric "*": the mean of the task's
    metrics, each the mean of its rows)."""
    target = h.a if side == "a" or h.b == "control" else h.b
    field = "control" if side == "b" and h.b == "control" else "value"
    arm, _, label = target.rpartition("@")
    got: dict[Any, dict[tuple[str, str], list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if (r.get("kind") or "") != h.kind or r.get("phenomenon"):
            continue
        if h.metric != "*" and r.get("metric") != h.metric:
            continue
        if h.task != "*" and r.get("task") != h.task:
            continue
        value = r.get(field)
        r_arm, seed, r_label = split_model(r.get("model", ""), seeded)
        if (r_arm, r_label) == (arm, label) and is_number(value) and math.isfinite(value):
            got[seed][(str(r.get("task")), str(r.get("metric")))].append(float(value))
    out: dict[Any, dict[str, float]] = {}
    for seed, cells in got.items():
        per_task: dict[str, list[float]] = defaultdict(list)
        for (task, _), values in cells.items():
            per_task[task].append(sum(values) / len(values))
        out[seed] = {t: sum(v) / len(v) for t, v in per_task.items()}
    return out


def paired_values(h: Hypothesis, rows: Sequence[dict[str, Any]],
                  seeded: bool) -> tuple[list[Any], list[float], list[float], str]:
    """(seeds, a values, b values, note) over the seeds both models have; with task "*" a seed
    counts only when a and b have the same tasks (else the averages would not compare)."""
    va, vb = seed_values(h, "a", rows, seeded), seed_values(h, "b", rows, seeded)
    seeds, xa, xb, dropped = [], [], [], []
    for s in sorted(va.keys() & vb.keys(), key=lambda s: (s is None, s)):
        if va[s].keys() != vb[s].keys():
            dropped.append(s)
            continue
        seeds.append(s)
        xa.append(sum(va[s].values()) / len(va[s]))
        xb.append(sum(vb[s].values()) / len(vb[s]))
    note = f"seeds {dropped} left out: a and b have different tasks" if dropped else ""
    return seeds, xa, xb, note


def evaluate(hyps: Sequence[Hypothesis], rows: Sequence[dict[str, Any]],
             seeded: bool, planned: int = 0) -> list[dict[str, Any]]:
    """Each hypothesis tested over its paired seeds, Holm-adjusted across all of them, with the
    smallest effect its seeds detect at 80 % power (at alpha, and at alpha / m, the level of
    Holm's first step) from the measured SD of the differences.

    planned: the study's number of pre-training seeds. The registered test is the one over all
    of them: with fewer paired seeds the p-values are shown, but the decision reads "interim",
    never "supported", since stopping at the first look whose p falls below alpha would inflate
    the false-positive rate the registration fixed."""
    out = []
    for h in hyps:
        seeds, xa, xb, note = paired_values(h, rows, seeded)
        d = [x - y for x, y in zip(xa, xb, strict=True)]
        mean, low, high = mean_ci(d)
        sd = float(_sd(d))
        out.append({"id": h.id, "a": h.a, "b": h.b, "seeds": seeds, "a_values": xa,
                    "b_values": xb, "mean_diff": mean, "ci95": [low, high], "sd_diff": sd,
                    "n": len(d), "test": h.test, "direction": h.direction,
                    "p": paired_p(xa, xb, h.test, h.direction), "note": note,
                    "mde80": min_detectable_effect(sd, len(d), h.alpha, h.test, h.direction),
                    "mde80_first_step": min_detectable_effect(sd, len(d), h.alpha / len(hyps),
                                                              h.test, h.direction)})
    for row, adj, h in zip(out, holm([r["p"] for r in out]), hyps, strict=True):
        row["p_holm"] = adj
        row["planned_seeds"] = planned or row["n"]
        row["decision"] = ("not tested (fewer than 2 paired seeds)" if math.isnan(adj)
                           else f"interim: {row['n']} of {planned} seeds, decided at {planned}"
                           if row["n"] < planned
                           else "supported" if adj < h.alpha else "not supported")
    return out


def _sd(d: Sequence[float]) -> float:
    n = len(d)
    if n < 2:
        return math.nan
    m = sum(d) / n
    return math.sqrt(sum((x - m) ** 2 for x in d) / (n - 1))


def _value(x: Any) -> str:
    """A value in the metric's units, 4 decimals ('—' when missing)."""
    return f"{x:.4f}" if is_number(x) and math.isfinite(x) else "—"


def report_lines(hyps: Sequence[Hypothesis], results: Sequence[dict[str, Any]],
                 problems: Sequence[str]) -> list[str]:
    """The report's "Pre-registered hypotheses" section."""
    lines = ["## Pre-registered hypotheses\n"]
    lines += [f"**WARNING: {p}.**\n" for p in problems]
    if not hyps:
        return lines + ["None registered: every comparison in this report is exploratory.\n"]
    lines += ["Paired by pre-training seed (one pair per seed; fine-tuning seeds and lrs averaged "
              "within it). Mean difference a − b in the metric's units with its 95 % t interval; "
              "p of the registered test and direction; Holm's correction across all "
              f"{len(hyps)} hypotheses at alpha {hyps[0].alpha:g}. Detectable (80 % power): the "
              "smallest true difference the test finds with 80 % probability given the measured "
              "SD of the seed differences, at alpha and at alpha / m (Holm's first step).\n"]
    for h in hyps:
        lines.append(f"- **{h.id}** ({h.kind or 'fine-tuning'} / {h.task} / {h.metric}; "
                     f"{h.direction}; {h.test}): {h.statement}")
    lines += ["", "| id | a | b | seeds | a per seed | b per seed | mean a − b [95 % CI] | "
              "SD of diffs | p | Holm p | decision | detectable (α) | detectable (α/m) |",
              "|---|---|---|---|---|---|---|---:|---:|---:|---|---:|---:|"]
    for r in results:
        ci = f"{_value(r['mean_diff'])} [{_value(r['ci95'][0])}, {_value(r['ci95'][1])}]"
        lines.append(f"| {r['id']} | {r['a']} | {r['b']} | {r['n']} | "
                     f"{', '.join(map(_value, r['a_values']))} | "
                     f"{', '.join(map(_value, r['b_values']))} | {ci} | {_value(r['sd_diff'])} | "
                     f"{p_text(r['p'])} | {p_text(r['p_holm'])} | {r['decision']} | "
                     f"{_value(r['mde80'])} | {_value(r['mde80_first_step'])} |")
    lines += [f"- {r['id']}: {r['note']}" for r in results if r["note"]]
    return lines + [""]


def seed_comparisons(pairs: Sequence[tuple[str, str]], rows: Sequence[dict[str, Any]],
                     seeded: bool) -> list[dict[str, Any]]:
    """Exploratory: each (a, b) pair of ARM@P% models on every (kind, task, metric) the rows hold
    (fine-tuning rows also averaged over all tasks and metrics: task "*", metric "*"), paired by
    pre-training seed, two-sided paired t-test, uncorrected."""
    keys = {((r.get("kind") or ""), str(r.get("task")), str(r.get("metric"))) for r in rows
            if not r.get("phenomenon") and is_number(r.get("value"))}
    keys |= {("", "*", "*")} if any(k[0] == "" for k in keys) else set()
    hyps = [Hypothesis(id=f"{a} vs {b}", a=a, b=b, kind=k, task=t, metric=m,
                       direction="two-sided")
            for a, b in pairs for k, t, m in sorted(keys)]
    out = []
    for h in hyps:  # evaluate() one at a time: no Holm across exploratory comparisons
        r = evaluate([h], rows, seeded)[0]
        if r["n"]:
            out.append({**r, "kind": h.kind, "task": h.task, "metric": h.metric})
    return out


def comparison_lines(got: Sequence[dict[str, Any]]) -> list[str]:
    """The exploratory table of `seed_comparisons`."""
    if not got:
        return []
    lines = ["### Arms across pre-training seeds (exploratory)\n",
             "One pair per pre-training seed; mean difference a − b with its 95 % t interval, "
             "two-sided paired t-test, not corrected for the number of rows.\n",
             "| a | b | kind | task | metric | seeds | mean a − b [95 % CI] | SD of diffs | p |",
             "|---|---|---|---|---|---:|---|---:|---:|"]
    lines += [f"| {r['a']} | {r['b']} | {r['kind'] or 'fine-tuning'} | {r['task']} | "
              f"{r['metric']} | {r['n']} | {_value(r['mean_diff'])} [{_value(r['ci95'][0])}, "
              f"{_value(r['ci95'][1])}] | {_value(r['sd_diff'])} | {p_text(r['p'])} |" for r in got]
    return lines + [""]
