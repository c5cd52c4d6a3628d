"""The evaluation pieces of `mlsm demo`: zero-shot minimal pairs from held-out prose, the summary."""

from __future__ import annotations

import json
import random
from pathlib import Path

from mlsm.study.runner import Study
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


def write_pairs(held: list[str], folder: Path, n: int = 150, seed: int = 0) -> Path:
    """Two pair sets in BLiMP's format from held-out prose: a real sentence (good) vs its words
    shuffled, and vs two of its words swapped (bad). A model that learned English word order puts
    the real sentence's PLL higher; chance is 50 %."""
    rng = random.Random(seed)
    sents = _sentences(held)
    rng.shuffle(sents)
    kinds = {"shuffled_words": lambda w: rng.sample(w, len(w)), "two_words_swapped": lambda w: _swap_two(w, rng)}
    folder.mkdir(parents=True, exist_ok=True)
    for k, (uid, corrupt) in enumerate(kinds.items()):
        rows = []
        for i, s in enumerate(sents[k * n:(k + 1) * n]):
            words = s.rstrip(".").split()
            bad = corrupt(words)
            if bad != words:
                rows.append({"sentence_good": s, "sentence_bad": " ".join(bad) + ".", "UID": uid, "pairID": str(i),
                             "field": "word order (held-out prose)", "linguistics_term": uid})
        (folder / f"{uid}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def print_summary(study: Study) -> None:
    """One line per scored model: held-out masked-token top-1 and every pair set's accuracy."""
    folder = study.root / "blimp"
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        row = json.loads(path.read_text())
        h = row.get("heldout") or {}
        sets = ", ".join(f"{name} {100 * s['overall']:.1f} %" for name, s in row.get("sets", {}).items())
        print(f"{row['arm']}@{readiness_label(row['readiness'])}: held-out masked top-1 {100 * h.get('top1', float('nan')):.1f} %; "
              f"pairs (chance 50 %): {sets}")
