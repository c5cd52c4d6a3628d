"""`mlsm study report`: what a study folder holds, as Markdown + PNGs (written into the folder).

Sections, laid out as the *Hitchhikers' Guide to Masked Latent Semantic Modeling* (anonymous, under
review) reports: pre-training loss curves; readiness curves (its Fig. 4a); the Wilcoxon matrix and
win counts (Fig. 2b/2c); per-task mean ± std (Table 1); the first pair set's PLL accuracy vs FLOPs
per batch (Fig. 6) with each probe's held-out loss and top-1 beside the score; each arm's compute
(FLOPs, tokens, wall time), the wall time of every stage and what failed (`cost_report`).
`summary.json` holds the same numbers.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from mlsm.evaluate.compare.paired import p_text, too_few
from mlsm.evaluate.zeroshot.blimp import pair_set_test, tests_note
from mlsm.fileio import atomic_write, atomic_write_text, files_as_one
from mlsm.provenance import git_revision, invocation, machine_description
from mlsm.study import reuse
from mlsm.study.cost_report import arm_compute, arm_metrics, cost_tables, fmt, stage_times
from mlsm.study.folder import REPORT_OUTPUTS, Study, pretrain_done
from mlsm.study.reuse import blimp_rows
from mlsm.study.spec import readiness_label


def _save(fig: Figure, path: Path) -> str:
    FigureCanvasAgg(fig)
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight"))
    return path.name


def plot_pretraining(study: Study, path: Path) -> str | None:
    """Training loss per arm (nats; MLM's is a cross-entropy over words, MLSM's a KL over atoms)."""
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    drawn = False
    for k, arm in enumerate(study.spec.arms):
        rows = arm_metrics(study, arm)
        if rows:
            ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label=arm, color=f"C{k}",
                    linewidth=1)
            drawn = True
    if not drawn:
        return None
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_blimp_flops(rows: list[dict[str, Any]], compute: list[dict[str, Any]],
                     path: Path) -> str | None:
    """The layout of the Hitchhikers' Guide's Fig. 6: the first pair set's accuracy (BLiMP there)
    vs FLOPs per training batch, one point per arm@readiness. `overall` is the study's first pair
    set (the demo's is its held-out prose word-order pairs), named on the axis."""
    flops = {c["arm"]: c["flops_per_batch"] for c in compute}
    pts = [(flops.get(r["arm"], math.nan), 100 * r["overall"],
            f"{r['arm']}@{readiness_label(r['readiness'])}") for r in rows]
    pts = [p for p in pts if math.isfinite(p[0])]
    if not pts:
        return None
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    for k, (x, y, label) in enumerate(pts):
        ax.scatter([x / 1e12], [y], color=f"C{k}", label=label)
    ax.axhline(50, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("training FLOPs per batch (TFLOP, student + teacher)")
    ax.set_ylabel(f"'{first_pair_set(rows)}' pair accuracy (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def _finetune_section(study: Study, dest: Path) -> tuple[list[str], dict[str, Any]]:
    from mlsm.evaluate.compare.report import plot_readiness, plot_wilcoxon
    from mlsm.evaluate.compare.stats import compare_runs

    if not study.result_rows(warn=lambda m: study.log(f"[study] warning: {m}")):  # names torn
        return ["## Fine-tuning\n\nNo fine-tuning results yet.\n"], {}
    # one lr per task: no selection
    cmp = compare_runs(study.results, dest / "comparison", bootstrap=2000)
    parts = ["## Fine-tuning: readiness curves (Fig. 4a)\n",
             f"![readiness]({plot_readiness(cmp, dest / 'readiness.png').name})\n",
             "## Fine-tuning: Wilcoxon matrix and win counts (Fig. 2b/2c)\n",
             f"![wilcoxon]({plot_wilcoxon(cmp, dest / 'wilcoxon.png').name})\n",
             cmp.to_markdown()]
    # the conservative reading: one pair per fine-tuning run, its correlated metrics averaged
    per_run = compare_runs(study.results, bootstrap=2000, per_run=True)
    parts += _headline(study, cmp, "one pair per fine-tuning run and metric")
    parts += _headline(study, per_run, "one pair per run, its metrics averaged (conservative)")
    summary = {"models": cmp.models, "columns": [list(c) for c in cmp.columns],
               "mean": cmp.mean.tolist(), "std": cmp.std.tolist(), "count": cmp.count.tolist(),
               "pvalues_row_better": cmp.pvalues.tolist(), "wins": cmp.wins.tolist(),
               "n_pairs": cmp.n_pairs.tolist(),
               "per_run": {"pvalues_row_better": per_run.pvalues.tolist(),
                           "pvalues_two_sided": per_run.pvalues_two_sided.tolist(),
                           "wins": per_run.wins.tolist(), "n_pairs": per_run.n_pairs.tolist()}}
    return parts, summary


def headline_pairs(study: Study) -> list[tuple[str, str]]:
    """The comparisons a study is run for (the Hitchhikers' Guide, Table 1 / Fig. 4): every latent
    arm at 50 % and at 100 % against every other arm at 100 %, and the latent arms against each
    other at 100 %."""
    latent = [a for a in study.spec.arms if study.is_latent(a)]
    others = [a for a in study.spec.arms if a not in latent]
    pairs = [(f"{a}@{readiness_label(f)}", f"{b}@100%") for a in latent for b in others
             for f in (0.5, 1.0)]
    pairs += [(f"{a}@100%", f"{b}@100%") for i, a in enumerate(latent) for b in latent[i + 1:]]
    if study.spec.seeds:  # runs ARM-s<seed>: a pair shares its pre-training seed
        from mlsm.study.hypotheses import split_model

        pairs = [(a, b) for a, b in pairs if split_model(a, True)[1] == split_model(b, True)[1]]
    return pairs


def _headline(study: Study, cmp: Any, pairing: str) -> list[str]:
    rows = []
    for a, b in headline_pairs(study):
        if a in cmp.models and b in cmp.models:
            i, j = cmp.models.index(a), cmp.models.index(b)
            has_two = getattr(cmp, "pvalues_two_sided", None) is not None
            two = cmp.pvalues_two_sided[i, j] if has_two else math.nan
            few = too_few(cmp.n_pairs[i, j])  # one seed: no p-value, no interval, no "+nan"
            ps = [few or p_text(p) for p in (cmp.pvalues[i, j], cmp.pvalues[j, i], two)]
            rows.append(f"| {a} | {b} | {int(cmp.wins[i, j])}/{int(cmp.n_pairs[i, j])} | "
                        f"{int(cmp.wins[j, i])}/{int(cmp.n_pairs[i, j])} | {' | '.join(ps)} | "
                        f"{cmp.diff_text(i, j)} |")
    if not rows:
        return []
    return [f"## Headline comparisons, {pairing}\n",
            "Wilcoxon signed-rank over the paired runs: p(A>B) one-sided (A better than B), "
            "p(B>A) the reverse, and the two-sided p; mean difference A − B (×100) with "
            "its bootstrap CI.\n",
            "| A | B | A wins | B wins | p(A>B) | p(B>A) | p two-sided | mean A − B [CI] |",
            "|---|---|---:|---:|---:|---:|---:|---|", *rows, ""]


def blimp_comparisons(study: Study, blimp: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The headline pairs on BLiMP: both models scored the same pairs of each phenomenon of the
    first pair set, so their per-phenomenon accuracies pair up (the unit BLiMP reports);
    Wilcoxon signed-rank over the phenomena, win counts and the mean difference."""
    import numpy as np

    from mlsm.evaluate.compare.stats import wilcoxon_p

    by_model = {f"{r['arm']}@{readiness_label(r['readiness'])}": next(iter(r["sets"].values()))
                for r in blimp if r.get("sets")}
    out = []
    for a, b in headline_pairs(study):
        if a not in by_model or b not in by_model:
            continue
        pa, pb = by_model[a]["phenomena"], by_model[b]["phenomena"]
        common = sorted(pa.keys() & pb.keys())
        x, y = np.array([pa[k] for k in common]), np.array([pb[k] for k in common])
        out.append({"a": a, "b": b, "n_phenomena": len(common), "wins_a": int(np.sum(x > y)),
                    "wins_b": int(np.sum(y > x)), "mean_diff": float(np.mean(x - y)),
                    "p_a_better": wilcoxon_p(x, y, "greater"),
                    "p_b_better": wilcoxon_p(y, x, "greater"), "p_two_sided": wilcoxon_p(x, y)})
    return out


def _blimp_pair_lines(pairs: list[dict[str, Any]], first: str) -> list[str]:
    """The headline pairs on the first pair set (`first`, its name), paired by phenomenon."""
    if not pairs:
        return []
    return ["", f"## `{first}`: headline comparisons, paired by phenomenon\n",
            "Wilcoxon signed-rank over the phenomena both models scored (the same pairs); wins: "
            "phenomena where one model's accuracy is higher; mean difference A − B in points.\n",
            "| A | B | phenomena | A wins | B wins | mean A − B | p(A>B) | p(B>A) | p two-sided |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|",
            *[f"| {c['a']} | {c['b']} | {c['n_phenomena']} | {c['wins_a']} | {c['wins_b']} | "
              f"{100 * c['mean_diff']:+.2f} | {p_text(c['p_a_better'])} | "
              f"{p_text(c['p_b_better'])} | {p_text(c['p_two_sided'])} |" for c in pairs]]


def first_pair_set(rows: list[dict[str, Any]]) -> str:
    """The name of the pair set whose accuracy is a row's `overall` (the study's first set: the
    demo's is its held-out prose word-order pairs, not BLiMP), so no table calls it BLiMP."""
    return next(iter(rows[0].get("sets") or ["BLiMP"])) if rows else "BLiMP"


def _blimp_line(r: dict[str, Any]) -> str:
    """One row of the BLiMP table. The optional fields (held-out, probe) of a row written by an
    older study, or edited by hand, show as '—', never as an error."""
    p, h = r.get("probe") or {}, r.get("heldout") or {}
    name, first = next(iter(r["sets"].items()))
    tests = pair_set_test(name, first)
    cells = [f"{r['arm']}@{readiness_label(r['readiness'])}", fmt(r["overall"], 0.01, 1),
             str(r["n_pairs"]), fmt(first.get("control"), 0.01, 1),
             p_text(tests.p_vs_control), p_text(tests.p_vs_chance),
             fmt(h.get("top1"), 0.01, 1),
             fmt(h.get("unigram_top1"), 0.01, 1), p_text(h.get("p_vs_unigram")),
             fmt(h.get("loss"), 1, 3), fmt(h.get("unigram_loss"), 1, 3),
             str(p.get("input", "—")) if p else "— (MLM head)", fmt(p.get("heldout_loss"), 1, 3),
             fmt(p.get("heldout_top1"), 0.01, 1), fmt(p.get("unigram_loss"), 1, 3),
             str(p.get("steps", "—")) if p else "—"]
    return "| " + " | ".join(cells) + " |"


def _set_cells(name: str, s: dict[str, Any] | None) -> str:
    """'accuracy % | unigram % | p vs unigram | p vs 50 %' of the pair set `name` (the test it
    gets: `pair_set_test`; '—' for rows written before the control)."""
    if not s:
        return "— | — | — | —"
    t = pair_set_test(name, s)
    return (f"{fmt(s.get('overall'), 0.01, 1)} | {fmt(s.get('control'), 0.01, 1)} | "
            f"{p_text(t.p_vs_control)} | {p_text(t.p_vs_chance)}")


def _unscored_rows(study: Study) -> list[str]:
    """BLiMP rows of the checkpoints not scored by PLL (MAE-LM, MAE-MLSM, CLM, CLM -> MLM in its
    CLM phase): their stage was skipped, so the table says so where their score would be."""
    if not study.spec.blimp.data:
        return []
    return [f"| {arm}@{readiness_label(frac)} | n/a (scored by fine-tuning only) |"
            + " — |" * 14
            for arm in study.spec.arms for frac in study.spec.blimp.readiness
            if study.unscored_reason(arm, frac)]


def _zero_shot_tables(blimp: list[dict[str, Any]], blimp_pairs: list[dict[str, Any]],
                      study: Study) -> list[str]:
    """The pair sets and held-out masked tokens: no fine-tuning, so the low-noise readouts of a
    small study (the demo's signal), first in the report."""
    lines: list[str] = []
    names = list(dict.fromkeys(n for r in blimp for n in r.get("sets", {})))
    if len(names) > 1:
        lines += ["## Minimal-pair sets (PLL accuracy %; chance 50 %)\n",
                  "unigram: the add-one unigram of the tokens the run consumed, on the same "
                  f"pairs; {tests_note(names)}\n",
                  "| model | " + " | ".join(f"{n} | unigram | p vs unigram | p vs 50 %"
                                            for n in names) + " |",
                  "|---|" + "---:|---:|---:|---:|" * len(names)]
        for r in blimp:
            cells = " | ".join(_set_cells(n, r.get("sets", {}).get(n)) for n in names)
            lines.append(f"| {r['arm']}@{readiness_label(r['readiness'])} | {cells} |")
    where = study.spec.blimp.heldout_store and "a store of held-out documents" or \
        "the chunks after the last pre-training batch (held out only within the run's first epoch)"
    first = first_pair_set(blimp)
    lines += ["", f"## Pair sets (PLL; latent arms through their probe): `{first}`, the first, "
              "and held-out masked tokens\n",
              f"Held-out masked tokens: {where}, the run's own masking; latent arms are scored "
              "through their probe. Unigram: the frequencies of the tokens the run consumed (one "
              "estimate per run, shared by the arms of a seed, its probe's start and its pairs' "
              "control), on the same targets (the plateau of an MLM that does not use context); "
              "p: two-sided binomial "
              "test of the model's top-1 against the unigram's rate.\n",
              "unigram %: the add-one unigram of the same tokens on the same pairs; "
              f"{tests_note([first])}\n",
              f"| model | {first} % | pairs | unigram % | p vs unigram | p vs 50 % "
              "| held-out masked top-1 % | unigram top-1 % "
              "| p | held-out loss (nats) | unigram loss (nats) | probe input "
              "| probe held-out loss (nats) | probe top-1 % | probe unigram loss | probe steps |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    lines += [_blimp_line(r) for r in blimp]
    lines += _unscored_rows(study)
    return lines + _blimp_pair_lines(blimp_pairs, first)


def hypotheses_section(study: Study, compute: list[dict[str, Any]] | None = None
                       ) -> tuple[list[str], list[dict[str, Any]]]:
    """The pre-registered hypotheses evaluated over every results row of the study (paired by
    pre-training seed, Holm across them), the line that makes the rest exploratory, and each
    hypothesis at equal training FLOPs (`mlsm.study.equal_compute`, from `compute`)."""
    from mlsm.study import equal_compute as eq
    from mlsm.study import hypotheses as hy

    hyps, seeded = study.spec.hypotheses, bool(study.spec.seeds)
    warn = lambda m: study.log(f"[study] warning: {m}")  # noqa: E731
    keep = lambda kind, row: reuse.is_current(study, kind, row)  # noqa: E731
    rows = hy.study_rows(study.root, warn=warn, keep=keep) if hyps or seeded else []
    results = hy.evaluate(hyps, rows, seeded, planned=len(study.spec.seeds))
    problems = (hy.preregistration_problems(study.root, hyps)
                if hyps or (study.root / hy.RECORD).is_file() else [])
    lines = hy.report_lines(hyps, results, problems)
    lines.append("## Exploratory analyses\n\nEverything below this line is exploratory: not "
                 "pre-registered, p-values not corrected across the many comparisons.\n")
    if hyps and compute:
        fracs = sorted(set(study.spec.readiness) | set(study.spec.blimp.readiness))
        got = eq.equal_compute(hyps, rows, eq.arm_flops(compute, seeded), fracs, seeded)
        store = sum(t for (stage, _), t in stage_times(study).items() if stage == "targets")
        lines += eq.equal_compute_lines(got, store or None)
        for r, g in zip(results, got, strict=True):
            r["equal_compute"] = g
    if seeded:  # the headline pairs by declared arm, tested across pre-training seeds
        pairs = list(dict.fromkeys(
            tuple(f"{hy.split_model(m, True)[0]}@{hy.split_model(m, True)[2]}" for m in pair)
            for pair in headline_pairs(study)))
        lines += hy.comparison_lines(hy.seed_comparisons(pairs, rows, True))
    return lines, results


def write_report(study: Study, dest: Path | None = None) -> Path:
    """Write report.md, its PNGs and summary.json into STUDY_OUT, or into `dest` without
    changing the study folder (it then must hold no stale fine-tuning rows: `publish_report`
    refuses those); returns the report path."""
    if dest is not None:
        return _write_report(study, dest, in_place=False)
    reuse.supersede_stale_finetuning(study)
    # report.md, summary.json, figures and comparison/ of one moment: a kill leaves the earlier
    with files_as_one(study.root, REPORT_OUTPUTS.__contains__) as stage:
        _write_report(study, stage, in_place=True)
    return study.root / "report.md"


def _write_report(study: Study, dest: Path, in_place: bool) -> Path:
    root = study.root
    compute, blimp, times = arm_compute(study), blimp_rows(study), stage_times(study)
    blimp_pairs = blimp_comparisons(study, blimp)
    done = [a for a in study.spec.arms if pretrain_done(study, a)]
    # the folder's name, not its path: a published copy names no machine's folders
    where = (f"in the study folder `{root.name}`" if in_place else
             f"from the study folder `{root.name}` as it was at "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} (`--to`)")
    if study.pieces:
        where = (f"from the published pieces {', '.join(f'`{p}`' for p in study.pieces)} at "
                 f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} (`--from`)")
    command = invocation() or "mlsm.study.write_report (Python)"
    parts = [f"# Study `{study.spec.name}`\n",
             f"Generated by `{command}` {where}; mlsm {git_revision()}; machine: "
             f"{machine_description()}. {_arms_done(done, list(study.spec.arms))}\n"]
    if study.spec.notes:
        parts.append("## Fixed hyper-parameters and why\n\n" + study.spec.notes.strip() + "\n")
    hyp_lines, hyp_summary = hypotheses_section(study, compute)
    parts.append("\n".join(hyp_lines))
    # zero-shot first: at small scale the pairs and held-out tokens carry the signal that
    # fine-tuning (at its floor) does not
    parts.append("\n".join(_zero_shot_tables(blimp, blimp_pairs, study)) + "\n")
    png = plot_blimp_flops(blimp, compute, dest / "blimp_flops.png")
    if png:
        parts.append(f"## `{first_pair_set(blimp)}` pair accuracy vs FLOPs per batch (as the "
                     f"Hitchhikers' Guide's Fig. 6)\n\n![blimp vs flops]({png})\n")
    png = plot_pretraining(study, dest / "pretraining.png")
    if png:
        parts.append(f"## Pre-training loss\n\n![pre-training]({png})\n")
    ft_parts, ft_summary = _finetune_section(study, dest)
    parts += ft_parts
    parts.append("\n".join(cost_tables(compute, times, study)) + "\n")
    from mlsm.study.readout_report import readout_section

    readout_parts, readouts = readout_section(study, dest)
    parts += readout_parts
    summary = {"git_revision": git_revision(), "machine": machine_description(),
               "compute": compute, "blimp": blimp, "blimp_pairs": blimp_pairs,
               "finetune": ft_summary, "readouts": readouts, "hypotheses": hyp_summary,
               "stage_seconds": [{"stage": s, "arm": a, "seconds": t}
                                 for (s, a), t in times.items()],
               "status": study.owned_status()}
    # strict JSON: a p-value or interval that does not exist (one seed) is null, not NaN
    atomic_write_text(dest / "summary.json",
                      json.dumps(_strict(summary), indent=2, default=str, allow_nan=False) + "\n")
    path = dest / "report.md"
    atomic_write_text(path, "\n".join(parts))
    return path


def _arms_done(done: list[str], arms: list[str]) -> str:
    """"All 2 arms pre-trained (mlsm, mlm)." or "1 of 2 arms pre-trained (mlsm); not yet: mlm."."""
    if len(done) == len(arms):
        return f"All {len(arms)} arms pre-trained ({', '.join(arms)})."
    missing = [a for a in arms if a not in done]
    return (f"{len(done)} of {len(arms)} arms pre-trained ({', '.join(done) or 'none yet'}); "
            f"not yet: {', '.join(missing)}.")


def _strict(value: Any) -> Any:
    """`value` with every NaN or infinite float replaced by None (JSON has neither), nested."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_strict(v) for v in value]
    return value
