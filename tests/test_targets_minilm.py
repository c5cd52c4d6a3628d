"""Stored targets equal online targets on the real teacher (all-MiniLM-L6-v2, layer 5, k = 1536,
λ = 0.05), where many codes have more non-zeros than the old fixed top-32 rows could hold."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mlsm.config import DataConfig
from mlsm.data.batches import BatchSource
from mlsm.data.corpus import TokenStore, prepare_corpus
from mlsm.objectives import Context, build_objective
from mlsm.teacher.dictionary import Dictionary, save_dictionary
from mlsm.teacher.targets import TargetStore, build_target_store
from mlsm.teacher.teacher import default_teacher_path, load_teacher

from .helpers import SHARED

CORPUS = SHARED / "corpus" / "enwiki_2015_prefix"
pytestmark = pytest.mark.skipif(not CORPUS.is_dir(), reason="../shared/data/corpus is absent")


def _docs(split: str, n: int) -> list[str]:
    with gzip.open(CORPUS / f"{split}.jsonl.gz", "rt", encoding="utf-8") as fh:
        return [json.loads(next(fh))["text"][:2000] for _ in range(n)]


def _dictionary(teacher, k: int = 1536) -> Dictionary:
    """Atoms = ℓ2-normalised layer-5 states of training text: a real dictionary of the teacher's
    space (learning one would only make the test slower; the store must be exact for any D)."""
    enc = teacher.tokenizer(
        _docs("train", 60), truncation=True, max_length=128, padding=True, return_tensors="pt"
    )
    with torch.no_grad():
        h = teacher.hidden_states(enc["input_ids"], enc["attention_mask"])  # (B, T, d)
    states = F.normalize(h[enc["attention_mask"].bool()].float(), dim=-1)  # (N, d)
    pick = torch.randperm(len(states), generator=torch.Generator().manual_seed(0))[:k]
    return Dictionary(
        states[pick].T.contiguous(), {"lam": 0.05, "layer": teacher.layer, "teacher": teacher.name}
    )


def test_stored_targets_equal_online_targets_on_minilm(tmp_path: Path) -> None:
    teacher = load_teacher(None, 5)
    (tmp_path / "valid.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in _docs("valid", 20))
    )
    store = prepare_corpus(
        str(tmp_path / "valid.jsonl"), str(default_teacher_path()), tmp_path / "store"
    )
    dict_path = save_dictionary(_dictionary(teacher), tmp_path / "dict.safetensors")
    targets = build_target_store(
        store.path, dict_path, teacher, 128, tmp_path / "targets", batch_size=16
    )
    meta = TargetStore.open(targets).meta
    assert meta["truncated"] == 0 and meta["nnz"] is None

    tok = TokenStore.open(store.path).load_tokenizer()
    ctx = Context(tok, torch.device("cpu"), 10, str(store.path), 128)
    stored = build_objective({"name": "mlsm", "targets": str(targets)}, ctx)
    online = build_objective({"name": "mlsm", "dictionary": str(dict_path)}, ctx)
    source = BatchSource(store, DataConfig(store=str(store.path), max_len=128, seed=1), tok)
    batch = source.batch(np.arange(16), 0)
    a, b = stored.coder.codes(batch), online.coder.codes(batch)  # (N, k)
    support = (b > 0).sum(1)
    assert int((support > 32).sum()) > 0, (
        "no code is wider than 32: the test would not see truncation"
    )
    assert torch.equal(a > 0, b > 0)  # the same support at every selected position
    torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-7)  # fp16 storage: 2^-11 relative rounding
