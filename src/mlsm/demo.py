"""`mlsm demo`: MLSM against MLM end to end, offline, in minutes on a laptop CPU.

The demo is a small study (`mlsm.study`, the code path of `mlsm study`):
1. corpus: English prose every Python installation carries (pydoc's topic pages and the standard
   library's docstrings), or --corpus PATH / hf:NAME; 300 documents are held out;
2. a token store with the packaged all-MiniLM-L6-v2 tokenizer (student and teacher must agree);
3. a dictionary (k = 512, λ = 0.05) on the teacher's layer-3 states;
4. two tiny students pre-trained on identical batches, at once: MLSM and MLM;
5. the MLSM model's linear probe, trained to a held-out plateau, so both can be scored by PLL;
6. zero-shot minimal pairs from the held-out prose (a real sentence vs its words shuffled, vs two
   words swapped) scored by PLL, and masked-token accuracy on the held-out prose next to the
   unigram's, each with a binomial test — signal even offline; with GLUE / BLiMP data (--data,
   ../shared/data, or HF `datasets` when the Hub is reachable) also SST-2 fine-tuning (one seed
   by default: tiny students stay at chance on it) and a BLiMP subset;
7. the study report (Markdown + PNGs) and a summary with every stage's time.
Every stage is skipped when its output already exists, so an interrupted demo resumes.
"""

from __future__ import annotations

import ast
import json
import math
import os
import random
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlsm.errors import Incomplete, UserError
from mlsm.evaluate.compare.paired import p_text
from mlsm.evaluate.zeroshot.blimp import WORD_ORDER_PAIRS, pair_set_test
from mlsm.fileio import atomic_write_text
from mlsm.study.folder import Study
from mlsm.study.reuse import blimp_rows
from mlsm.study.runner import run_study
from mlsm.study.spec import StudySpec, readiness_label, study_from_dict

# Sizes fixed a priori from cost and earlier training-loss curves, before any evaluation score
# was seen, and not changed after (docs/results/demo/README.md): see docs/study.md.
STUDENT = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
           "intermediate_size": 512, "hidden_dropout_prob": 0.0,
           "attention_probs_dropout_prob": 0.0}
"""No dropout: minutes of training on a tiny model underfit; dropout would only slow them
(Geiping & Goldstein 2023 drop it for short budgets too)."""
STEPS, BATCH, LR, WARMUP = 500, 16, 2e-3, 0.05
DICTIONARY = {"layer": 3, "k": 512, "lam": 0.05}
"""The MLSM arm's teacher layer (early exit: 3 of MiniLM's 6 layers) and k (a third of the
Hitchhikers' Guide's k ≈ 4d, 4d = 1536 here): the teacher's forward and the k x |V| probe
dominate the MLSM arm's cost."""
PAIR_SET = WORD_ORDER_PAIRS
"""The folder of the zero-shot pairs, and so their name in every table, figure and summary line
(a pair set is named by its folder): word-order pairs of held-out prose, not BLiMP. Under that
name they get the exact binomial test over their pairs
(`mlsm.evaluate.zeroshot.blimp.PAIRWISE_TESTED`)."""
N_VECTORS = 4096
HELD_OUT = 300
SEEDS = 1
"""SST-2 fine-tuning seeds: one, chosen from cost (each seed is a fine-tuning run per model); the
students are too small and too briefly trained to leave chance on it, so more seeds buy nothing."""
"""Documents held out of the corpus: the minimal pairs and the held-out masked tokens."""
NOTES = ("Tiny students (2 layers x 128, no dropout, sequences of 64, batch 16, AdamW lr 2e-3 "
         "with 5 % warmup) pre-trained for minutes, both arms at "
         "once on one thread each; sizes, steps and lr fixed a priori from cost and "
         "training-loss curves, before any evaluation score was seen, and never changed after. "
         "MLSM: the teacher's layer 3, k = 512, lambda = 0.05. "
         "SST-2 (when its data is there): lr 1e-4 for 2 epochs on <= 1000 examples, 1 seed, "
         "fixed a priori. Zero-shot pairs: a sentence of the held-out documents vs the same words "
         "shuffled, and vs two of its words swapped (PLL, chance 50 %); held-out masked tokens "
         "come from the same held-out documents.")


def stdlib_prose(min_words: int = 20) -> list[str]:
    """Documents of English prose from the running Python: pydoc topics and stdlib docstrings."""
    from pydoc_data.topics import topics

    docs = [text.strip() for _, text in sorted(topics.items())]
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if "test" in path.parent.name or "site-packages" in path.parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc.split()) >= min_words:
                    docs.append(doc.replace("\n\n", "\n"))  # one document per docstring
    return docs


def _write_corpus(out: Path, held_out: int = HELD_OUT) -> tuple[Path, list[str]]:
    """Training text (blank-line separated) and the held-out documents (never trained on): the
    source of the minimal pairs and of the held-out masked-token score."""
    docs = stdlib_prose()
    random.Random(0).shuffle(docs)
    train, held = docs[held_out:], docs[:held_out]
    path = out / "corpus" / "stdlib_prose.txt"
    if not path.exists():  # written whole or not at all: a re-run never trains on half of it
        atomic_write_text(path, "\n\n".join(train) + "\n")
    return path, held


def _heldout_store(held: list[str], out: Path) -> Path:
    """A token store of the held-out documents, for the held-out masked-token score."""
    from mlsm.data.corpus import prepare_corpus
    from mlsm.teacher.teacher import default_teacher_path

    text = out / "corpus" / "heldout_prose.txt"
    if not text.exists():
        atomic_write_text(text, "\n\n".join(held) + "\n")
    prepare_corpus([str(text)], str(default_teacher_path()), out / "heldout_store")
    return out / "heldout_store"


def _check_corpus(corpus: str) -> None:
    """--corpus names text files that exist (the study would find out only after minutes)."""
    from mlsm.data.sources import resolve_paths

    try:
        resolve_paths(corpus)
    except UserError as exc:
        raise UserError(f"--corpus {corpus}: {exc}") from None


def find_shared_data(explicit: str | None) -> Path | None:
    """A folder with glue/ and/or blimp/ (like ../shared/data), if one is given or nearby."""
    here = Path(__file__).resolve().parents[3] / "../shared/data"
    candidates = [Path(explicit)] if explicit else [Path.cwd() / "../shared/data", here]
    for path in candidates:
        if (path / "glue").is_dir() or (path / "blimp").is_dir():
            return path.resolve()
    if explicit:
        raise UserError(f"--data {explicit} has neither glue/ nor blimp/; "
                        "point it at a folder holding them")
    return None


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether HF `datasets` may download: never with HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set
    (then no connection is even tried), else a TCP connection to the Hub within `timeout`."""
    import os
    import socket

    flags = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    if any(os.environ.get(v, "") not in ("", "0") for v in flags):
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
    except OSError:
        return False
    return True


def select_eval_data(shared: Path | None, online: Callable[[], bool] = hub_reachable,
                     log: Callable[[str], None] = print) -> tuple[str | None, str | None]:
    """(GLUE folder or "" = HF `datasets` nyu-mll/glue or None = no SST-2; BLiMP folder or
    "nyu-mll/blimp" or None): local data first, else the Hub when reachable, else neither with
    one line saying so. `online` is asked at most once, and only when local data is missing."""
    glue = str(shared / "glue") if shared and (shared / "glue" / "SST-2").is_dir() else None
    blimp = str(shared / "blimp") if shared and (shared / "blimp").is_dir() else None
    if glue is None or blimp is None:
        if online():
            glue = "" if glue is None else glue
            blimp = "nyu-mll/blimp" if blimp is None else blimp
        else:
            missing = " and ".join(n for n, v in (("SST-2", glue), ("BLiMP", blimp)) if v is None)
            log(f"demo: no local data for {missing} and the HF Hub is offline or unreachable: "
                f"skipping {missing} (pass --data PATH holding glue/ and blimp/ to include them)")
    return glue, blimp


def demo_study(out: Path, corpus: str, pairs: Path, heldout: Path, glue: str | None,
               blimp_data: str | None, steps: int, batch: int, seeds: int,
               blimp_pairs: int) -> StudySpec:
    """The demo as a study: MLM vs MLSM on identical batches, the same stages as `mlsm study`."""
    blimp = [str(pairs)] + ([blimp_data] if blimp_data is not None else [])
    return study_from_dict({
        "name": "demo", "out": str(out), "notes": NOTES,
        "corpus": {"sources": [corpus]},
        "base": {"data": {"max_len": 64, "seed": 0},
                 "model": {"arch": "bert", "overrides": dict(STUDENT)},
                 "optim": {"lr": LR, "warmup": WARMUP},
                 "train": {"steps": steps, "batch_size": batch, "log_every": 10}},
        "readiness": [0.5, 1.0],
        "arms": {"mlsm": {"objective": {"name": "mlsm"}, "dictionary": dict(DICTIONARY)},
                 "mlm": {"objective": {"name": "mlm"}}},
        "dictionary": {"n_vectors": N_VECTORS, "max_len": 64},
        # one input kind: on demo-sized students the three kinds tie (measured: 5.874 nats each
        # after 30 steps, unigram 6.206), and each candidate costs a k x |V| update per step
        "probe": {"inputs": ["probs"], "max_steps": 150, "eval_every": 25, "patience": 2,
                  "heldout_batches": 8, "batch_size": 16},
        "finetune": {"tasks": ["sst2"] if glue is not None else [], "data_dir": glue or "",
                     "readiness": [1.0], "seeds": seeds, "lrs": [1e-4], "epochs": 2,
                     "warmup_ratio": 0.1,  # the study default the demo was measured with
                     "max_len": 64, "max_train_examples": 1000},
        "blimp": {"data": blimp, "readiness": [1.0], "heldout_store": str(heldout),
                  "limits": [0] + [blimp_pairs] * (len(blimp) - 1)},
        # the two arms pre-train at once, one thread each (tiny models use a second thread
        # poorly); the evaluation stages then run here one after the other with both threads
        # (as subprocesses they took 25 s longer: start-up, and no gain on 2 cores)
        "executor": {"kind": "local", "jobs": 2, "eval_jobs": 1, "threads": 1},
    })


def run_demo(out: str | Path = "runs/demo", corpus: str | None = None, data: str | None = None,
             steps: int = STEPS, batch: int = BATCH, seeds: int = SEEDS,
             blimp_pairs: int = 10) -> Path:
    """Run the whole demo as a small study; returns the path of the Markdown report."""

    out = Path(out)
    shared = find_shared_data(data)  # bad --data / --corpus: one line before anything is written
    if corpus and not corpus.startswith("hf:"):
        _check_corpus(corpus)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    def log(text: str) -> None:
        print(f"[{time.perf_counter() - start:6.0f} s] {text}", flush=True)

    corpus_path, held = (corpus, []) if corpus else _write_corpus(out)
    if not held:
        held = stdlib_prose()[:HELD_OUT]
    pairs = write_pairs(held, out / PAIR_SET)
    glue, blimp = select_eval_data(shared, log=log)
    spec = demo_study(out, str(corpus_path), pairs, _heldout_store(held, out), glue, blimp,
                      steps, batch, seeds, blimp_pairs)
    log(f"[demo] pre-training both arms at once; their logs: {out / 'logs'}")
    try:
        report = run_study(spec, log=log)
    except Incomplete as exc:  # an arm failed: show what the other one gave, then say so
        if exc.report is not None:
            print_summary(Study(spec, log=log))
        raise
    if report is None:
        raise UserError(f"the demo stopped before its report; see {out / 'status.json'} "
                        "and re-run the same command")
    print_summary(Study(spec, log=log))
    t = os.times()  # this process and its finished children (the pre-training subprocesses)
    cpu = t.user + t.system + t.children_user + t.children_system
    seconds = {"report": str(report), "seconds": round(time.perf_counter() - start, 1),
               "cpu_seconds": round(cpu, 1)}
    atomic_write_text(out / "demo.json", json.dumps(seconds, indent=2) + "\n")
    print(f"report: {report}  ({seconds['seconds']:.0f} s wall, {cpu:.0f} s CPU)")
    return report


# ------------------------------------------------------------ evaluation: pairs, summary


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
    (`mlsm.evaluate.zeroshot.blimp.pair_set_test`, as in the study report: exact binomial over the
    word-order pairs, Wilcoxon across BLiMP's phenomena); per fine-tuned model its mean dev
    score; every stage's wall time. Rows
    whose score is NaN (an empty pair set, a diverged fine-tuning run) are left out, with one
    warning that counts them; so are BLiMP files made from other inputs or settings."""
    lines, skipped = [], []
    # rows made from other settings are left out, as the study's report leaves them out
    for row in blimp_rows(study):
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
    cells: dict[tuple[str, str, str], list[float]] = {}
    for r in study.result_rows(warn=print):  # a line torn by a crash: skipped
        key = (r.get("model", "?"), r.get("task", "?"), r.get("metric", "?"))
        if _finite(r.get("value")):
            cells.setdefault(key, []).append(float(r["value"]))
        else:
            skipped.append(f"{key[0]} {key[1]} seed {r.get('seed')}")
    return [f"{m} {t} {metric}: {100 * sum(v) / len(v):.1f} "
            + ("(1 seed)" if len(v) == 1 else f"(mean of {len(v)} seeds)")
            for (m, t, metric), v in sorted(cells.items())]


def _stage_lines(study: Study) -> list[str]:
    rows = study.stage_runs()
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
