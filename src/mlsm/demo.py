"""`mlsm demo`: MLSM against MLM end to end, offline, in minutes on a laptop CPU.

The demo is a small study (`mlsm.study`, the code path of `mlsm study`):
1. corpus: English prose every Python installation carries (pydoc's topic pages and the standard
   library's docstrings), or --corpus PATH / hf:NAME; 300 documents are held out;
2. a token store with the packaged all-MiniLM-L6-v2 tokenizer (student and teacher must agree);
3. a dictionary (k = 4d = 1536, λ = 0.05) on the teacher's layer-5 states;
4. two tiny students pre-trained on identical batches: MLSM and MLM;
5. the MLSM model's linear probe, trained to a held-out plateau, so both can be scored by PLL;
6. zero-shot minimal pairs from the held-out prose (a real sentence vs its words shuffled, vs two
   words swapped) scored by PLL, and held-out masked-token accuracy — signal even offline;
   with GLUE / BLiMP data (--data, ../shared/data, or HF `datasets` when online) also SST-2
   fine-tuning with paired seeds and a BLiMP subset;
7. the study report (Markdown + PNGs) and a summary table.
Every stage is skipped when its output already exists, so an interrupted demo resumes.
"""

from __future__ import annotations

import ast
import json
import random
import sysconfig
import time
from pathlib import Path

from mlsm.errors import UserError
from mlsm.fileio import atomic_write_text
from mlsm.study.runner import Study, run_study
from mlsm.study.spec import StudySpec, study_from_dict

STUDENT = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 512}


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


def _write_corpus(out: Path, held_out: int = 300) -> tuple[Path, list[str]]:
    """Training text (blank-line separated) and held-out documents for the word-order task."""
    docs = stdlib_prose()
    random.Random(0).shuffle(docs)
    train, held = docs[held_out:], docs[:held_out]
    path = out / "corpus" / "stdlib_prose.txt"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n\n".join(train) + "\n")
    return path, held


def _word_order_task(held: list[str], out: Path, n: int = 1600) -> Path:
    """SST-2-format task from held-out prose: label 1 = a real sentence, 0 = its words shuffled."""
    root = out / "tasks"
    folder = root / "WordOrder"
    if (folder / "dev.tsv").exists():
        return root
    rng = random.Random(0)
    sents = [s.strip().replace("\t", " ").replace("\n", " ") for d in held for s in d.split(". ")]
    sents = [s for s in sents if 6 <= len(s.split()) <= 30]
    rows = []
    for s in sents[:n]:
        words = s.split()
        if rng.random() < 0.5:
            rng.shuffle(words)
            rows.append((" ".join(words), 0))
        else:
            rows.append((s, 1))
    folder.mkdir(parents=True, exist_ok=True)
    cut = int(0.8 * len(rows))
    for name, part in (("train.tsv", rows[:cut]), ("dev.tsv", rows[cut:])):
        (folder / name).write_text("sentence\tlabel\n" + "".join(f"{s}\t{y}\n" for s, y in part))
    return root


def find_shared_data(explicit: str | None) -> Path | None:
    """A folder with glue/ and/or blimp/ (like ../shared/data), if one is given or nearby."""
    candidates = [Path(explicit)] if explicit else [Path.cwd() / "../shared/data", Path(__file__).resolve().parents[3] / "../shared/data"]
    for path in candidates:
        if (path / "glue").is_dir() or (path / "blimp").is_dir():
            return path.resolve()
    if explicit:
        raise UserError(f"--data {explicit} has neither glue/ nor blimp/; point it at a folder holding them")
    return None


def _online() -> bool:
    import os

    return not any(os.environ.get(v, "") not in ("", "0") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def demo_study(out: Path, corpus: str, pairs: Path, shared: Path | None, steps: int, batch: int,
               seeds: int, blimp_pairs: int, dictionary_vectors: int) -> StudySpec:
    """The demo as a study: MLM vs MLSM (l = 5) on identical batches, the same stages as `mlsm study`."""
    if shared is not None and (shared / "glue" / "SST-2").is_dir():
        glue: str | None = str(shared / "glue")
    else:
        glue = "" if _online() else None  # "" = HF datasets (nyu-mll/glue)
    blimp = [str(pairs)]
    if shared is not None and (shared / "blimp").is_dir():
        blimp.append(str(shared / "blimp"))
    elif _online():
        blimp.append("nyu-mll/blimp")
    return study_from_dict({
        "name": "demo", "out": str(out),
        "notes": "Tiny students (2 layers x 128) pre-trained for minutes; fixed a priori: lr 1e-3 with 5 % warmup, "
                 "fine-tuning lr 1e-4 for 3 epochs on <= 2000 examples. Zero-shot pairs: a held-out sentence of "
                 "prose vs the same words shuffled, and vs two of its words swapped (PLL, no training).",
        "corpus": {"sources": [corpus]},
        "base": {"data": {"max_len": 128, "seed": 0}, "model": {"arch": "bert", "overrides": dict(STUDENT)},
                 "optim": {"lr": 1e-3, "warmup": 0.05}, "train": {"steps": steps, "batch_size": batch, "log_every": 5}},
        "readiness": [0.5, 1.0],
        "arms": {"mlsm": {"objective": {"name": "mlsm"}, "dictionary": {"layer": 5, "k": 1536, "lam": 0.05}},
                 "mlm": {"objective": {"name": "mlm"}}},
        "dictionary": {"n_vectors": dictionary_vectors},
        # one input kind: on demo-sized students the three kinds tie (measured: 5.874 nats each after
        # 30 steps, unigram 6.206), and each candidate costs a k x |V| = 1536 x 30522 update per step
        "probe": {"inputs": ["probs"], "max_steps": 90, "eval_every": 15, "patience": 2, "heldout_batches": 4, "batch_size": 8},
        "finetune": {"tasks": ["sst2"] if glue is not None else [], "data_dir": glue or "", "readiness": [1.0],
                     "seeds": seeds, "lrs": [1e-4], "epochs": 3, "max_train_examples": 2000},
        "blimp": {"data": blimp, "readiness": [1.0], "limits": [0] + [blimp_pairs] * (len(blimp) - 1)},
        "executor": {"kind": "local", "threads": 0},
    })


def run_demo(out: str | Path = "runs/demo", corpus: str | None = None, data: str | None = None,
             steps: int = 300, batch: int = 16, dictionary_vectors: int = 8192,
             seeds: int = 2, blimp_pairs: int = 20) -> Path:
    """Run the whole demo as a small study; returns the path of the Markdown report."""
    from mlsm.demo_report import print_summary, write_pairs

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    corpus_path, held = (corpus, []) if corpus else _write_corpus(out)
    if not held:
        held = stdlib_prose()[:300]
    pairs = write_pairs(held, out / "pairs")
    spec = demo_study(out, str(corpus_path), pairs, find_shared_data(data), steps, batch, seeds, blimp_pairs, dictionary_vectors)

    def log(text: str) -> None:
        print(f"[{time.perf_counter() - start:6.0f} s] {text}", flush=True)

    report = run_study(spec, log=log)
    if report is None:
        raise UserError(f"the demo stopped before its report; see {out / 'status.json'} and re-run the same command")
    print_summary(Study(spec, log=log))
    print(f"report: {report}")
    seconds = round(time.perf_counter() - start, 1)
    summary = {"report": str(report), "seconds": seconds}
    atomic_write_text(out / "demo.json", json.dumps(summary, indent=2))
    return report
