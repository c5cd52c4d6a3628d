"""Every supported model family against HF itself: the exported checkpoint loads in
`AutoModelForMaskedLM` with every tensor (nothing missing, nothing re-initialised) and gives the
trained student's logits; the MLM loss equals HF's own `*ForMaskedLM(..., labels=...)` loss."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForMaskedLM

from mlsm.config import DataConfig, ModelConfig
from mlsm.data.batches import BatchSource
from mlsm.data.corpus import TokenStore
from mlsm.models.backbone import build_student
from mlsm.models.heads import mlm_head_fn
from mlsm.objectives import Context, TrainModule, build_objective, forward_step
from mlsm.train.checkpoint import save_checkpoint

from .helpers import TINY_MODEL

FAMILIES = ["bert", "roberta", "deberta-v2", "modernbert", "distilbert", "electra", "xlm-roberta"]

# DistilBERT names its sizes differently
_DISTIL = {"dim": 32, "n_layers": 2, "n_heads": 2, "hidden_dim": 64}


def _setup(arch: str, store_dir: Path):
    store = TokenStore.open(store_dir)
    tok = store.load_tokenizer()
    sizes = _DISTIL if arch == "distilbert" else TINY_MODEL
    student = build_student(ModelConfig(arch=arch, overrides=dict(sizes)), tok, 32, seed=0)
    obj = build_objective({"name": "mlm"}, Context(tok, torch.device("cpu"), 4, str(store_dir), 32))
    obj.attach(student)
    source = BatchSource(store, DataConfig(store=str(store_dir), max_len=32), tok)
    batch = source.batch(np.arange(8), 0)
    return student, obj, batch, tok


@pytest.mark.parametrize("arch", FAMILIES)
def test_checkpoint_loads_in_hf_with_the_trained_students_logits(arch: str, store_dir: Path,
                                                                 tmp_path: Path) -> None:
    student, obj, batch, tok = _setup(arch, store_dir)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-2)
    init = {k: v.clone() for k, v in student.hf.state_dict().items()}
    for _ in range(3):  # train every tensor away from its initialisation, heads included
        out = forward_step(student, obj, batch)
        (out.loss_sum / out.n_targets).backward()
        opt.step()
        opt.zero_grad()
    assert any(not torch.equal(v, init[k]) for k, v in student.hf.state_dict().items())
    module = TrainModule(student, obj)
    folder = save_checkpoint(tmp_path / "step-0000003", module, tok, {"step": 3}, {"step": 3})
    hf, info = AutoModelForMaskedLM.from_pretrained(folder, output_loading_info=True)
    assert (not info["missing_keys"] and not info["unexpected_keys"]
            and not info["mismatched_keys"]), info
    student.eval()
    hf.eval()
    with torch.no_grad():
        encoded = student.encode(batch.corrupted_ids, batch.attention_mask)
        mine = student.vocab_logits(encoded[batch.selected])
        theirs = hf(input_ids=batch.corrupted_ids,
                    attention_mask=batch.attention_mask).logits[batch.selected]
        hidden = hf.base_model(input_ids=batch.corrupted_ids, attention_mask=batch.attention_mask)
        sparse = mlm_head_fn(hf)(hidden.last_hidden_state[batch.selected])  # (N, d) -> (N, V)
    torch.testing.assert_close(theirs, mine, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sparse, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", FAMILIES)
def test_mlm_loss_equals_hf_masked_lm_loss(arch: str, store_dir: Path) -> None:
    student, obj, batch, _ = _setup(arch, store_dir)
    student.eval()
    with torch.no_grad():
        out = forward_step(student, obj, batch)
        # HF's reference: labels are the ORIGINAL ids at the selected positions, -100 elsewhere
        labels = torch.where(batch.selected, batch.input_ids,
                             torch.full_like(batch.input_ids, -100))
        ref = student.hf(input_ids=batch.corrupted_ids, attention_mask=batch.attention_mask,
                         labels=labels).loss
    assert int(out.n_targets) == int(batch.selected.sum()) > 0
    assert not torch.equal(batch.corrupted_ids[batch.selected], batch.input_ids[batch.selected])
    torch.testing.assert_close(out.loss_sum / out.n_targets, ref, rtol=1e-5, atol=1e-5)
