"""Shared fixtures: a small synthetic corpus, a tokenizer trained on it, and its token store."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"

_WORDS = ["the", "a", "cat", "dog", "bird", "sees", "chases", "likes", "small", "big", "red", "green", "house", "tree", "river", "runs", "sleeps", "quickly", "slowly", "and", "but", "because", "when", "old", "young", "child", "teacher", "reads", "writes", "book", "letter", "city", "village", "walks", "near", "under", "over", "happy", "sad", "music", "plays", "loud", "quiet"]


def make_text(n_docs: int, seed: int = 0, sentences: int = 8) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        sents = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 12))).capitalize() + "." for _ in range(sentences)]
        docs.append(" ".join(sents))
    return docs


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    (root / "a.txt").write_text("\n\n".join(make_text(40, seed=1)) + "\n")
    import gzip
    import json

    with gzip.open(root / "b.jsonl.gz", "wt") as fh:
        for doc in make_text(40, seed=2):
            fh.write(json.dumps({"text": doc, "id": 1}) + "\n")
    return root


@pytest.fixture(scope="session")
def tokenizer_dir(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mlsm.data.tokenizer import train_tokenizer

    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(str(corpus_dir), out, kind="wordpiece", vocab_size=200)
    return out


@pytest.fixture(scope="session")
def store_dir(corpus_dir: Path, tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mlsm.data.corpus import prepare_corpus

    out = tmp_path_factory.mktemp("stores") / "store"
    prepare_corpus(str(corpus_dir), str(tokenizer_dir), out)
    return out


TINY_MODEL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}


def tiny_overrides(store: Path, out: Path, **extra: object) -> list[str]:
    """key=value overrides for a seconds-long CPU run on the fixture store."""
    base = {
        "data.store": str(store), "data.max_len": 32, "train.out": str(out), "train.steps": 6,
        "train.batch_size": 8, "train.log_every": 1, "train.device": "cpu", "optim.lr": 1e-3,
        "model.overrides": "{" + ", ".join(f"{k}: {v}" for k, v in TINY_MODEL.items()) + "}",
    }
    base.update({k: v for k, v in extra.items()})
    return [f"{k}={v}" for k, v in base.items()]


def overfit_losses(spec: dict, store: Path, steps: int = 30, lr: float = 3e-3, arch: str = "bert") -> list[float]:
    """Train a tiny student with objective `spec` on one fixed batch; return the loss per step.

    Uses the library's own pieces (store, batches, student, objective) and the contract's
    normalisation (loss_sum / n_targets), without the loop, so every objective can be checked.
    """
    import torch

    from mlsm.config import DataConfig, ModelConfig
    from mlsm.data.batches import BatchSource
    from mlsm.data.corpus import TokenStore
    from mlsm.models.backbone import build_student
    from mlsm.objectives import Context, build_objective

    st = TokenStore.open(store)
    tok = st.load_tokenizer()
    ctx = Context(tok, torch.device("cpu"), steps, str(store), 32)
    objective = build_objective(spec, ctx)
    student = build_student(ModelConfig(arch=arch, overrides=dict(TINY_MODEL)), tok, 32, seed=0)
    objective.attach(student)
    batch = BatchSource(st, DataConfig(store=str(store), max_len=32), tok).batch(np.arange(8), 0)
    opt = torch.optim.AdamW(student.parameters(), lr=lr)
    torch.manual_seed(0)
    losses = []
    for _ in range(steps):
        out = student(objective, batch)
        loss = out.loss_sum / out.n_targets.clamp(min=1)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="session")
def teacher_dir(store_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny BERT masked LM pre-trained by our own `pretrain` on the fixture store."""
    from mlsm.config import load_config
    from mlsm.train.loop import pretrain

    out = tmp_path_factory.mktemp("teacher") / "run"
    cfg = load_config(None, tiny_overrides(store_dir, out, **{"train.steps": 30, "train.readiness": "[1.0]", "optim.lr": 3e-3}))
    pretrain(cfg)
    return out / "checkpoints" / "step-0000030"


@pytest.fixture(scope="session")
def dictionary_path(store_dir: Path, teacher_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A k=64 dictionary on layer 1 of the tiny teacher."""
    from mlsm.data.corpus import TokenStore
    from mlsm.teacher.dictionary import learn_dictionary
    from mlsm.teacher.teacher import load_teacher

    out = tmp_path_factory.mktemp("dict") / "dict.safetensors"
    teacher = load_teacher(str(teacher_dir), layer=1)
    learn_dictionary(TokenStore.open(store_dir), teacher, k=64, lam=0.05, n_vectors=3000, max_len=32, out=out)
    return out
