"""The training loop: exact resume, HF round trip, accumulation exactness, identical batches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from mlsm.errors import UserError
from mlsm.run_config import load_config

from .helpers import check_resume, overfit_losses, read_metrics, train_tiny


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def test_run_dir_is_self_describing(store_dir: Path, tmp_path: Path) -> None:
    run = train_tiny(store_dir, tmp_path / "r")
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["train"]["steps"] == 6 and cfg["data"]["store"] == str(store_dir)
    assert "git_revision" in json.loads((run / "run.json").read_text())
    steps = [m["step"] for m in read_metrics(run)]
    assert steps == [1, 2, 3, 4, 5, 6]
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    # readiness 10/25/50/100 % of 6 steps -> steps 1, 2 (1.5 rounds to 2), 3, 6
    assert ckpts == ["step-0000001", "step-0000002", "step-0000003", "step-0000006"]
    info = json.loads((run / "checkpoints" / "step-0000003" / "checkpoint.json").read_text())
    assert info["readiness"] == 0.5 and info["objective"] == "mlm"
    with pytest.raises(UserError, match="--resume"):
        train_tiny(store_dir, tmp_path / "r")  # never silently overwrite a run


def test_resume_is_exact(store_dir: Path, tmp_path: Path) -> None:
    # dropout stays on (BERT default 0.1): the per-step dropout seed must be restored too
    check_resume(store_dir, tmp_path, at=3)


def test_accumulation_matches_full_batch(store_dir: Path, tmp_path: Path) -> None:
    nodrop = (
        "{hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 2, intermediate_size: 64, "
        "hidden_dropout_prob: 0.0, attention_probs_dropout_prob: 0.0}"
    )
    one = train_tiny(store_dir, tmp_path / "one", **{"model.overrides": nodrop, "train.steps": 3})
    acc = train_tiny(
        store_dir,
        tmp_path / "acc",
        **{"model.overrides": nodrop, "train.steps": 3, "train.micro_batch_size": 2},
    )
    a, b = (
        _weights(one / "checkpoints" / "step-0000003"),
        _weights(acc / "checkpoints" / "step-0000003"),
    )
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-6)
    digests = [[m["batch_digest"] for m in read_metrics(run)] for run in (one, acc)]
    assert digests[0] == digests[1]
    # per step: the mean loss and the pre-clip gradient norm (clipping and AdamW hide a wrong scale)
    for key in ("loss", "grad_norm", "n_targets"):
        got, want = [m[key] for m in read_metrics(acc)], [m[key] for m in read_metrics(one)]
        assert got == pytest.approx(want, rel=1e-5), key


def test_batches_do_not_depend_on_model_or_train_seed(store_dir: Path, tmp_path: Path) -> None:
    a = train_tiny(store_dir, tmp_path / "a", **{"train.steps": 3})
    b = train_tiny(
        store_dir, tmp_path / "b", **{"train.steps": 3, "model.arch": "roberta", "train.seed": 5}
    )
    c = train_tiny(store_dir, tmp_path / "c", **{"train.steps": 3, "data.seed": 1})
    da, db, dc = ([m["batch_digest"] for m in read_metrics(r)] for r in (a, b, c))
    assert da == db and da != dc
    assert [m["n_targets"] for m in read_metrics(a)] == [m["n_targets"] for m in read_metrics(b)]


def test_mlm_loss_falls_when_overfitting_one_batch(store_dir: Path) -> None:
    losses = overfit_losses({"name": "mlm"}, store_dir, steps=30)
    assert losses[-1] < 0.5 * losses[0]


def test_config_errors_are_one_line(store_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="valid keys of optim: lr"):
        load_config(None, ["optim.lrr=3e-4"])
    with pytest.raises(UserError, match="valid groups"):
        load_config(None, ["trian.steps=3"])
    assert load_config(None, ["optim.lr=3e-4"]).optim.lr == 3e-4  # YAML 1.1 reads this as a string
    with pytest.raises(UserError, match="optim.lr must be of type float"):
        load_config(None, ["optim.lr=fast"])
    with pytest.raises(UserError, match="train.steps must be of type int"):
        load_config(None, ["train.steps=ten"])
    with pytest.raises(UserError, match="not a field of BertConfig"):
        train_tiny(store_dir, tmp_path / "x", **{"model.overrides": "{hiden_size: 8}"})
    with pytest.raises(UserError, match="unknown objective.name"):
        train_tiny(store_dir, tmp_path / "y", **{"objective.name": "mlmm"})
