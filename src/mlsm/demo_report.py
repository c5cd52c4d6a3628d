"""The evaluation pieces of `mlsm demo`: zero-shot minimal pairs from held-out prose, the
summary."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

from mlsm.evaluate.blimp import pair_set_test
from mlsm.evaluate.paired import p_text
from mlsm.fileio import atomic_write_text
from mlsm.study.folder import Study
from mlsm.study.reuse import is_current
from mlsm.study.spec import readiness_label


def _sentences(held: list[str], lo: int = 6, hi: int = 25) -> list[str]:
    """Sentences of held-out documents with lo..hi words, tabs and newlines flattened."""
    out = []
    for doc in held:
        for s in doc.replace("\n", " ").split(". "):
            words = s.replace("\t", " ").split()
            if lo <= len(words) <= hi and sum(w.isalpha() for w in words) >= len(words) // 2:
                out.append(" ".join(words).rstrip(".") + ".")
    return out


def _swap_two(words: list[str], rng: random.Random) -> list[str]:
    """The same words with two different ones at random positions exchanged."""
    for _ in range(20):
        i, j = rng.sample(range(len(words)), 2)
        if words[i] != words[j]:
            out = words[:]
            out[i], out[j] = out[j], out[i]
            return out
    return words


def write_pairs(held: list[str], folder: Path, n: int = 200, seed: int = 0) -> Path:
    """Two pair sets in BLiMP's format from held-out prose: a real sentence (good) vs its words
    shuffled, and vs two of its words swapped (bad). A model that learned English word order puts
    the real sentence's PLL higher; chance is 50 %."""
    rng = random.Random(seed)
    sents = _sentences(held)
    rng.shuffle(sents)
    kinds = {"shuffled_words": lambda w: rng.sample(w, len(w)),
             "two_words_swapped": lambda w: _swap_two(w, rng)}
    folder.mkdir(parents=True, exist_ok=True)
    for k, (uid, corrupt) in enumerate(kinds.items()):
        rows = []
        for i, s in enumerate(sents[k * n:(k + 1) * n]):
            words = s.rstrip(".").split()
            bad = corrupt(words)
            if bad != words:
                rows.append({"sentence_good": s, "sentence_bad": " ".join(bad) + ".", "UID": uid,
                             "pairID": str(i), "field": "word order (held-out prose)",
                             "linguistics_term": uid})
        atomic_write_text(folder / f"{uid}.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    return folder


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def summary_lines(study: Study) -> list[str]:
    """The demo's summary: per scored model its masked top-1 on held-out prose next to the
    unigram's (two-sided binomial p against the unigram's rate), each pair set's accuracy beside
    the unigram control's, with the two-sided p-values of the test the set gets
    (`mlsm.evaluate.blimp.pair_set_test`, as in the study report: exact binomial over the
    word-order pairs, Wilcoxon across BLiMP's phenomena); per fine-tuned model its mean dev
    score; every stage's wall time. Rows
    whose score is NaN (an empty pair set, a diverged fine-tuning run) are left out, with one
    warning that counts them; so are BLiMP files made from other inputs or settings."""
    lines, skipped = [], []
    folder = study.root / "blimp"
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        row = json.loads(path.read_text())
        if not is_current(study, "blimp", row):  # made from other settings: the study's report
            continue  # leaves it out too (a re-run of the blimp stage redoes it)
        name = f"{row['arm']}@{readiness_label(row['readiness'])}"
        sets = {k: v for k, v in row.get("sets", {}).items() if _finite(v.get("overall"))}
        skipped += [f"{name} {k}" for k in row.get("sets", {}) if k not in sets]
        h = row.get("heldout") or {}
        parts = []
        if _finite(h.get("top1")):
            uni = 100 * h.get("unigram_top1", math.nan)
            parts.append(f"held-out masked top-1 {100 * h['top1']:.1f} % (unigram {uni:.1f} %, "
                         f"p {p_text(h.get('p_vs_unigram'))}, n {h.get('n', 0)})")
        elif h:
            skipped.append(f"{name} held-out masked tokens")
        parts += [_set_text(k, v) for k, v in sets.items()]
        if parts:
            lines.append(f"{name}: " + "; ".join(parts))
    lines += _finetune_lines(study, skipped)
    if skipped:
        lines.insert(0, f"warning: left out {len(skipped)} result(s) with a NaN score: "
                        + ", ".join(skipped[:5]) + (" ..." if len(skipped) > 5 else ""))
    if lines:
        lines.insert(1 if skipped else 0, "pairs: chance 50 %, beside the unigram control on the "
                     "same pairs, p two-sided by the test each set names; masked top-1 p: "
                     "two-sided exact binomial test against the unigram's rate")
    return lines + _stage_lines(study)


def _set_text(name: str, v: dict[str, Any]) -> str:
    """One pair set: accuracy, the unigram control's, and the p-values of the test the set gets
    (`pair_set_test`; a result written before the control: its p against 50 % only)."""
    head = f"{name} {100 * v['overall']:.1f} % of {v['n_pairs']}"
    t = pair_set_test(name, v)
    if not _finite(v.get("control")):
        return f"{head} ({t.label()}: p vs 50 % {p_text(t.p_vs_chance)})"
    return (f"{head} (unigram {100 * v['control']:.1f} %; {t.label()}: "
            f"p vs unigram {p_text(t.p_vs_control)}, p vs 50 % {p_text(t.p_vs_chance)})")


def _finetune_lines(study: Study, skipped: list[str]) -> list[str]:
    """Mean dev score per (model, task, metric) over seeds, NaN runs left out (and counted)."""
    if not study.results.is_file():
        return []
    cells: dict[tuple[str, str, str], list[float]] = {}
    for line in study.results.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line torn by a crash
        key = (r.get("model", "?"), r.get("task", "?"), r.get("metric", "?"))
        if _finite(r.get("value")):
            cells.setdefault(key, []).append(float(r["value"]))
        else:
            skipped.append(f"{key[0]} {key[1]} seed {r.get('seed')}")
    return [f"{m} {t} {metric}: {100 * sum(v) / len(v):.1f} "
            + ("(1 seed)" if len(v) == 1 else f"(mean of {len(v)} seeds)")
            for (m, t, metric), v in sorted(cells.items())]


def _stage_lines(study: Study) -> list[str]:
    path = study.root / "stages.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []
    if not rows:
        return []

    def cost(r: dict[str, Any]) -> str:  # rows written before the CPU column have none
        cpu = r.get("cpu_seconds")
        return f"{r['seconds']:.0f} s" + (f" ({cpu:.0f} s CPU)" if _finite(cpu) else "")

    times = ", ".join(f"{r['stage']}{':' + r['arm'] if r.get('arm') else ''} {cost(r)}"
                      for r in rows)
    return [f"stage wall (CPU) times: {times}"]


def print_summary(study: Study) -> None:
    """Print `summary_lines` (see there)."""
    for line in summary_lines(study):
        print(line)
