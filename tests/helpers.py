"""Helpers shared by the test modules: the synthetic corpus's text, the tiny model's overrides and
a tiny training, the settings of conftest's two shared runs, an objective's overfit losses, a
run's metrics, the resume check, the CLI's verbs, and the PLL and BLiMP tests' tiny vocabulary,
models and scorers. Fixtures live in conftest.py; these are plain functions and constants a test
module imports (`from .helpers import tiny_overrides`)."""

from __future__ import annotations

import fcntl
import os
import random
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from mlsm.locking import lock_path

if TYPE_CHECKING:
    from transformers import BertForMaskedLM

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"

WORDS = ["the", "a", "cat", "dog", "bird", "sees", "chases", "likes", "small", "big", "red",
         "green", "house", "tree", "river", "runs", "sleeps", "quickly", "slowly", "and", "but",
         "because", "when", "old", "young", "child", "teacher", "reads", "writes", "book",
         "letter", "city", "village", "walks", "near", "under", "over", "happy", "sad", "music",
         "plays", "loud", "quiet"]


def make_text(n_docs: int, seed: int = 0, sentences: int = 8) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        sents = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))).capitalize() + "."
                 for _ in range(sentences)]
        docs.append(" ".join(sents))
    return docs


TINY_MODEL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
              "intermediate_size": 64}


def tiny_overrides(store: Path, out: Path, **extra: object) -> list[str]:
    """key=value overrides for a seconds-long CPU run on the fixture store."""
    base = {
        "data.store": str(store), "data.max_len": 32, "train.out": str(out), "train.steps": 6,
        "train.batch_size": 8, "train.log_every": 1, "train.device": "cpu", "optim.lr": 1e-3,
        "model.overrides": "{" + ", ".join(f"{k}: {v}" for k, v in TINY_MODEL.items()) + "}",
    }
    base.update({k: v for k, v in extra.items()})
    return [f"{k}={v}" for k, v in base.items()]


def overfit_losses(spec: dict, store: Path, steps: int = 30, lr: float = 3e-3,
                   arch: str = "bert") -> list[float]:
    """Train a tiny student with objective `spec` on one fixed batch; return the loss per step.

    Uses the library's own pieces (store, batches, student, objective) and the contract's
    normalisation (loss_sum / n_targets), without the loop, so every objective can be checked.
    """
    import torch

    from mlsm.config import DataConfig, ModelConfig
    from mlsm.data.batches import BatchSource
    from mlsm.data.corpus import TokenStore
    from mlsm.models.backbone import build_student
    from mlsm.objectives import Context, TrainModule, build_objective, forward_step

    st = TokenStore.open(store)
    tok = st.load_tokenizer()
    ctx = Context(tok, torch.device("cpu"), steps, str(store), 32)
    objective = build_objective(spec, ctx)
    student = build_student(ModelConfig(arch=arch, overrides=dict(TINY_MODEL)), tok, 32, seed=0)
    objective.attach(student)
    batch = BatchSource(st, DataConfig(store=str(store), max_len=32), tok).batch(np.arange(8), 0)
    opt = torch.optim.AdamW(TrainModule(student, objective).parameters(), lr=lr)  # heads included
    torch.manual_seed(0)
    losses = []
    for _ in range(steps):
        out = forward_step(student, objective, batch)
        loss = out.loss_sum / out.n_targets.clamp(min=1)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def read_metrics(run: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _perturb(folder: Path) -> None:
    """Nudge every floating tensor of a checkpoint's model.safetensors (so a run resumed from it
    ends elsewhere, unless it ignored the checkpoint)."""
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    save_file({k: v + 0.01 if v.is_floating_point() else v for k, v in weights.items()},
              folder / "model.safetensors", metadata={"format": "pt"})


def check_resume(store: Path, tmp: Path, at: int = 3, steps: int = 6,
                 files: tuple[str, ...] = ("model.safetensors",), **extra: object) -> None:
    """Resume must be a resume, not a restart that happens to end in the same place.

    1. A run resumed from checkpoint `at` ends bit-identical to the uninterrupted run and its
       metrics hold each step exactly once, with the same values as the uninterrupted run.
    2. Resumed into an empty run directory from a perturbed copy of that checkpoint, the process
       logs steps at+1..steps only (it started at the checkpoint's step) and ends elsewhere
       (it started from the checkpoint's weights).
    """
    import json
    import shutil

    import torch
    from safetensors.torch import load_file

    from mlsm.run_config import load_config
    from mlsm.train.loop import pretrain

    cfg = lambda out: load_config(  # noqa: E731
        None, tiny_overrides(store, out, **{"train.steps": steps, **extra}))
    full = pretrain(cfg(tmp / "full"))
    final = f"checkpoints/step-{steps:07d}"
    part = tmp / "part"
    shutil.copytree(full, part)
    for folder in (part / "checkpoints").glob("step-*"):
        if int(folder.name.removeprefix("step-")) > at:
            shutil.rmtree(folder)
    pretrain(cfg(part), resume=str(part / "checkpoints" / f"step-{at:07d}"))
    for name in files:
        a, b = load_file(full / final / name), load_file(part / final / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    timing = ("tokens_per_s", "flops_per_s", "mfu")  # wall-clock rates differ between runs

    def drop(rows: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if k not in timing} for r in rows]
    assert [m["step"] for m in read_metrics(part)] == list(range(1, steps + 1))
    assert drop(read_metrics(part)) == drop(read_metrics(full))
    # run.json keeps where the run started and adds each resumed segment's provenance
    marker = json.loads((part / "run.json").read_text())
    assert "resumed" not in json.loads((full / "run.json").read_text())
    assert [r["from_step"] for r in marker["resumed"]] == [at], marker
    assert marker["resumed"][0]["git_revision"] == marker["git_revision"]  # same code here
    # 2. perturbed checkpoint, fresh run directory
    nudged = tmp / "nudged" / f"step-{at:07d}"
    shutil.copytree(full / "checkpoints" / f"step-{at:07d}", nudged)
    _perturb(nudged)
    other = pretrain(cfg(tmp / "other"), resume=str(nudged))
    assert [m["step"] for m in read_metrics(other)] == list(range(at + 1, steps + 1))
    a = load_file(full / final / "model.safetensors")
    b = load_file(other / final / "model.safetensors")
    assert any(not torch.equal(a[k], b[k]) for k in a), (
        "a run resumed from a perturbed checkpoint ended unchanged")


MLM_RUN = {"train.steps": 8, "train.threads": 1}
"""The session's tiny MLM run (conftest `mlm_run`) beyond tiny_overrides: 8 steps, so its
readiness checkpoints are steps 1, 2, 4 and 8 (10 % of 8 rounds to 1); one torch thread. A test
that resumes a copy of the run passes these same settings."""

MLSM_RUN = {"objective.name": "mlsm", "train.steps": 30, "optim.lr": 3e-3,
            "train.readiness": "[0.5, 1.0]", "train.threads": 1}
"""The session's tiny MLSM run (conftest `mlsm_run`) beyond tiny_overrides and its teacher and
dictionary: 30 steps at the teacher's learning rate, enough for a probe to beat the unigram;
checkpoints at steps 15 (50 %) and 30."""


def last_checkpoint(run: Path) -> Path:
    """The newest checkpoint folder of a finished run (checkpoints/step-N, N largest)."""
    return max((run / "checkpoints").glob("step-*"))


def snapshot(folder: Path) -> list[tuple[str, int, int]]:
    """(path, size, mtime in ns) of everything under `folder`: what a test that writes into a
    shared run changes. os.walk, not Path.rglob: it runs after every test (~0.2 ms a run)."""
    import os

    found = []
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(root, name)
            stat = os.lstat(path)
            found.append((path, stat.st_size, stat.st_mtime_ns))
    return sorted(found)


def train_tiny(store: Path, out: Path, resume: str | None = None, **extra: object) -> Path:
    """`pretrain` a tiny run (tiny_overrides plus `extra`) into `out`, in this process."""
    from mlsm.run_config import load_config
    from mlsm.train.loop import pretrain

    return pretrain(load_config(None, tiny_overrides(store, out, **extra)), resume=resume)


def cli_verbs() -> dict[str, object]:
    """The `mlsm` verbs and their argparse sub-parsers."""
    import argparse

    from mlsm.cli import build_parser

    parser, _ = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


# PLL, scoring, BLiMP and rank tests: a tiny WordPiece vocabulary, a tiny BERT, the brute-force
# PLL reference and a closed-form scorer

VOCAB = [
    "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "a", "cat", "dog", "fox", "run", "walk",
    "jump", "quick", "brown", "lazy", "over", "is", "are", "was", "who", "he", "she", "they", "it",
    "##s", "##ing", "##ed", "##ly", "##er", "un", "##believ", "##able", ".", ",", "?", "!", "'",
]

SENTENCES = [
    "the quick brown fox jumped over the lazy dog.",
    "cats run.",
    "unbelievable!",
    "she walks quickly, he runs slowly?",
    "the dogs are walking",
    "it",
    "they jumped over the quick brown foxes who was running, unbelievably.",
    "cats run.",  # duplicate: scored once, reported twice
]


def make_tokenizer(folder: Path):
    """A real fast WordPiece tokenizer from a tiny vocabulary (offline, no hub)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    import json

    from transformers import AutoTokenizer

    config = {"tokenizer_class": "BertTokenizer", "do_lower_case": True, "model_max_length": 64}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return AutoTokenizer.from_pretrained(str(folder))


def tiny_bert(seed: int = 0, vocab_size: int = len(VOCAB)) -> BertForMaskedLM:
    """A randomly initialised 2-layer BERT masked LM over `vocab_size` tokens, in eval mode."""
    import torch
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64,
    )
    return BertForMaskedLM(config).eval()


def word_starts(tokens: list[str]) -> list[bool]:
    # WordPiece marks continuation pieces with "##": an independent source of word boundaries.
    return [not t.startswith("##") for t in tokens]


def brute_force_pll(model, tokenizer, sentence: str, variant: str) -> list[float]:
    """Reference: one full forward per masked copy, logits from model(...).logits, log_softmax."""
    import torch

    ids = tokenizer(sentence)["input_ids"]
    tokens = tokenizer.convert_ids_to_tokens(ids)
    starts = word_starts(tokens)
    scores = []
    for t in range(1, len(ids) - 1):  # [CLS] ... [SEP]: never scored
        copy = list(ids)
        copy[t] = tokenizer.mask_token_id
        if variant == "within_word_l2r":
            j = t + 1
            while j < len(ids) - 1 and not starts[j]:
                copy[j] = tokenizer.mask_token_id
                j += 1
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([copy])).logits[0, t]
        scores.append(torch.log_softmax(logits.double(), -1)[ids[t]].item())
    return scores


class PositionalScorer:
    """A non-HF scorer: p(token | position) from a fixed table, context ignored.

    PLL then has a closed form, sum_t log_softmax(table[t])[w_t], which checks that rows come back
    in the order of `select` and that the protocol path needs nothing from HF. It also records
    what it was shown, to check the masking pattern.
    """

    def __init__(self, vocab_size: int, max_len: int = 64):
        import torch

        gen = torch.Generator().manual_seed(3)
        self.table = torch.randn(max_len, vocab_size, generator=gen)  # (T_max, V)
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def logits_at(self, input_ids, attention_mask, select):
        self.seen.append((input_ids.clone(), select.clone()))
        positions = select.nonzero()[:, 1]  # (N,) row-major, one per row here
        return self.table[positions]  # (N, V)


# BLiMP tests: a context-free scorer and the pairs of a tiny BLiMP folder (conftest `blimp_dir`)


class UnigramScorer:
    """Context-free `MaskedScorer`: the same logits at every position, so PLL(s) = sum log q(w).

    "cat" is far likelier than "dog", so a pair prefers whichever sentence has "cat".
    """

    def __init__(self):
        import torch

        self.logits = torch.zeros(len(VOCAB))
        self.logits[VOCAB.index("cat")] = 5.0
        self.logits[VOCAB.index("dog")] = -5.0

    def logits_at(self, input_ids, attention_mask, select):
        return self.logits.expand(int(select.sum()), -1)  # (N, V)


def blimp_row(good: str, bad: str, uid: str, field: str, term: str = "agr", pid: int = 0) -> dict:
    """One BLiMP pair as a line of the dataset's jsonl files."""
    return {"sentence_good": good, "sentence_bad": bad, "field": field, "linguistics_term": term,
            "UID": uid, "pairID": str(pid)}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """`rows` as jsonl, gzipped when the name ends in .gz."""
    import gzip
    import json

    text = "".join(json.dumps(r) + "\n" for r in rows)
    if path.name.endswith(".gz"):
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text)


RIGHT, WRONG, TIE = ("the cat", "the dog"), ("the dog", "the cat"), ("the cat", "the cat")


def lock_held(folder: str | os.PathLike) -> bool:
    """Whether some process holds the lock of `folder` (`mlsm.locking`), read from /proc/locks so
    that looking never takes the lock (which could make the run being watched refuse to start);
    elsewhere a brief try-lock."""
    path = lock_path(folder)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    try:
        table = Path("/proc/locks").read_text().split("\n")
    except OSError:
        return _try_lock(path)
    want = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    for line in table:
        fields = line.split()
        if "FLOCK" in fields and len(fields) > 5 and fields[5].count(":") == 2:
            major, minor, ino = fields[5].split(":")
            if (int(major, 16), int(minor, 16), int(ino)) == want:
                return True
    return False


def _try_lock(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False
