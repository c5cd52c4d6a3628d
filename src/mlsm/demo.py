"""`mlsm demo`: MLSM against MLM end to end, offline, in minutes on a laptop CPU.

1. corpus: English prose every Python installation carries (pydoc's topic pages and the standard
   library's docstrings), or --corpus PATH / hf:NAME;
2. a token store with the packaged all-MiniLM-L6-v2 tokenizer (student and teacher must agree);
3. a dictionary (k = 4d = 1536, λ = 0.05) on the teacher's layer-5 states;
4. two tiny students pre-trained on identical batches: MLSM and MLM;
5. the MLSM model's linear probe (10 % of the steps), so both can be scored by PLL;
6. fine-tuning of both on one small task (SST-2 when GLUE data is found, else a word-order task
   made from held-out prose) with paired seeds, and a BLiMP subset when BLiMP data is found;
7. a report (Markdown + PNGs) and a summary table.
Every stage is skipped when its output already exists, so an interrupted demo resumes.
"""

from __future__ import annotations

import ast
import json
import random
import sysconfig
import time
from pathlib import Path
from typing import Any

from mlsm.config import config_from_dict
from mlsm.data.corpus import TokenStore, prepare_corpus
from mlsm.errors import UserError
from mlsm.evaluate.probe import load_scorer, run_probe
from mlsm.teacher.dictionary import learn_dictionary
from mlsm.teacher.teacher import default_teacher_path, load_teacher
from mlsm.train.checkpoint import list_checkpoints
from mlsm.train.loop import pretrain

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


def _run_config(objective: dict[str, Any], store: Path, out: Path, steps: int, batch: int) -> Any:
    return config_from_dict({
        "data": {"store": str(store), "max_len": 128, "seed": 0},
        "model": {"arch": "bert", "overrides": dict(STUDENT)},
        "objective": objective,
        "optim": {"lr": 1e-3, "warmup": 0.05},
        "train": {"steps": steps, "batch_size": batch, "out": str(out), "log_every": 5},
    })


def _pretrain_once(cfg: Any) -> Path:
    """Pre-train unless the run is complete; resume it when it was interrupted."""
    run = Path(cfg.train.out)
    done = [s for s, _ in list_checkpoints(run)]
    if cfg.train.steps not in done:
        pretrain(cfg, resume="auto")  # auto: a new or empty run directory starts fresh
    return run / "checkpoints" / f"step-{cfg.train.steps:07d}"


def find_shared_data(explicit: str | None) -> Path | None:
    """A folder with glue/ and/or blimp/ (like ../shared/data), if one is given or nearby."""
    candidates = [Path(explicit)] if explicit else [Path.cwd() / "../shared/data", Path(__file__).resolve().parents[3] / "../shared/data"]
    for path in candidates:
        if (path / "glue").is_dir() or (path / "blimp").is_dir():
            return path.resolve()
    if explicit:
        raise UserError(f"--data {explicit} has neither glue/ nor blimp/; point it at a folder holding them")
    return None


def run_demo(out: str | Path = "runs/demo", corpus: str | None = None, data: str | None = None,
             steps: int = 300, batch: int = 16, dictionary_vectors: int = 8192,
             seeds: int = 2, blimp_pairs: int = 20) -> Path:
    """Run the whole demo; returns the path of the Markdown report."""
    from mlsm.demo_report import finetune_both, score_blimp, write_report

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    def stage(text: str) -> None:
        print(f"[{time.perf_counter() - start:6.0f} s] {text}", flush=True)

    teacher_path = default_teacher_path()
    corpus_path, held = (corpus, []) if corpus else _write_corpus(out)
    stage(f"1/6 token store from {corpus_path}")
    store = prepare_corpus(str(corpus_path), str(teacher_path), out / "store")
    stage(f"    {store.n_tokens:,} tokens in {store.n_docs:,} documents")
    dict_path = out / "dictionary.safetensors"
    if not dict_path.exists():
        stage(f"2/6 dictionary on MiniLM layer 5 (k = 1536, lambda = 0.05, {dictionary_vectors:,} vectors)")
        teacher = load_teacher(None, layer=5)
        learn_dictionary(TokenStore.open(store.path), teacher, k=1536, lam=0.05, n_vectors=dictionary_vectors, out=dict_path)
    stage(f"3/6 pre-training MLSM and MLM students on identical batches ({steps} steps x {batch} x 128)")
    mlsm_ckpt = _pretrain_once(_run_config({"name": "mlsm", "dictionary": str(dict_path), "layer": 5}, store.path, out / "mlsm", steps, batch))
    mlm_ckpt = _pretrain_once(_run_config({"name": "mlm"}, store.path, out / "mlm", steps, batch))
    stage("4/6 linear probe for the MLSM model (10 % of the steps)")
    probe_steps = max(1, steps // 10)
    probe_run = out / "mlsm" / "probe"
    if not (probe_run / "checkpoints" / f"step-{probe_steps:07d}").exists():
        run_probe(mlsm_ckpt, steps=probe_steps, out=str(probe_run), overrides=["optim.lr=1e-2"],
                  resume="auto")
    probe_ckpt = probe_run / "checkpoints" / f"step-{probe_steps:07d}"
    shared = find_shared_data(data)
    stage("5/6 fine-tuning both models")
    results, task = finetune_both({"mlsm": mlsm_ckpt, "mlm": mlm_ckpt}, shared, held, out, seeds, _word_order_task)
    blimp = {}
    if shared and (shared / "blimp").is_dir():
        stage(f"    BLiMP subset ({blimp_pairs} pairs per phenomenon)")
        blimp = score_blimp({"mlsm": load_scorer(probe_ckpt), "mlm": load_scorer(mlm_ckpt)}, shared / "blimp", blimp_pairs, out)
    stage("6/6 report")
    report = write_report(out, {"mlsm": out / "mlsm", "mlm": out / "mlm"}, results, task, blimp)
    stage("done")
    (out / "demo.json").write_text(json.dumps({"report": str(report), "task": task}, indent=2))
    return report
