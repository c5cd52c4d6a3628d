"""Validation during pre-training (`train.eval_every`, issue #54 item 8): the held-out numbers in
metrics.jsonl are those the held-out readout computes independently on the saved checkpoint, and
validating changes no weight."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mlsm.data.batches import BatchSource
from mlsm.data.corpus import TokenStore
from mlsm.evaluate.zeroshot.heldout import heldout_steps, masked_token_scores
from mlsm.evaluate.zeroshot.pll import load_masked_lm
from mlsm.run_config import load_config
from mlsm.train.loop import pretrain

from .helpers import read_metrics, tiny_overrides

STEPS = 6


def _run(store: Path, out: Path, **extra: object) -> Path:
    cfg = load_config(None, tiny_overrides(store, out, **{"train.steps": STEPS,
                                                           "train.log_every": 5,
                                                           "train.readiness": "[1.0]", **extra}))
    return pretrain(cfg) / "checkpoints" / f"step-{STEPS:07d}"


def test_validation_logs_the_heldout_readout_and_changes_no_weight(store_dir: Path,
                                                                   tmp_path: Path) -> None:
    plain = _run(store_dir, tmp_path / "plain")
    checked = _run(store_dir, tmp_path / "val", **{"train.eval_every": 2,
                                                   "train.eval_batches": 2})
    a, b = load_file(plain / "model.safetensors"), load_file(checked / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    rows = read_metrics(tmp_path / "val")
    val = {r["step"]: r for r in rows if "val_loss" in r}
    assert sorted(val) == [2, 4, 6]  # every 2 steps and the last; 5 is a plain log line
    assert "val_loss" not in next(r for r in rows if r["step"] == 5)
    assert not any("val_loss" in r for r in read_metrics(tmp_path / "plain"))

    # the same numbers from the readout of the saved checkpoint on the readout's held-out chunks
    cfg = json.loads((checked / "checkpoint.json").read_text())["config"]
    batch = cfg["train"]["batch_size"]
    store = TokenStore.open(store_dir)
    model, tokenizer = load_masked_lm(str(checked))
    source = BatchSource(store, load_config(None, tiny_overrides(store_dir, tmp_path)).data,
                         tokenizer)
    uniform = torch.full((len(tokenizer),), -torch.log(torch.tensor(float(len(tokenizer)))))
    ref = masked_token_scores(model, source, heldout_steps(checked, batch, 2), batch, uniform)
    assert val[STEPS]["val_loss"] == pytest.approx(ref["loss"], rel=1e-4)
    # the logged rate is a float32 ratio (rounding ~6e-8); a wrong count is off by >= 1/n
    assert val[STEPS]["val_accuracy"] == pytest.approx(ref["top1"], abs=1e-6)
