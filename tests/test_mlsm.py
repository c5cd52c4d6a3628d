"""The MLSM objective: targets, KL, early exit, mismatch errors, checkpoint format, training."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModel

from mlsm.config import DataConfig
from mlsm.data.batches import BatchSource
from mlsm.data.corpus import TokenStore
from mlsm.errors import UserError
from mlsm.models.heads import LatentHead
from mlsm.objectives import Context, build_objective, forward_step
from mlsm.run_config import load_config
from mlsm.teacher.sparse_coding import kkt_violation
from mlsm.train.loop import pretrain

from .helpers import overfit_losses, tiny_overrides


def _objective(store_dir: Path, teacher_dir: Path, dictionary_path: Path, **extra):
    store = TokenStore.open(store_dir)
    tok = store.load_tokenizer()
    spec = {"name": "mlsm", "dictionary": str(dictionary_path), "teacher": str(teacher_dir),
            **extra}
    obj = build_objective(spec, Context(tok, torch.device("cpu"), 10, str(store_dir), 32))
    source = BatchSource(store, DataConfig(store=str(store_dir), max_len=32), tok)
    batch = source.batch(np.arange(8), 0)
    return obj, batch


def test_targets_are_exact_codes_of_unmasked_teacher_states(store_dir, teacher_dir,
                                                            dictionary_path) -> None:
    obj, batch = _objective(store_dir, teacher_dir, dictionary_path)
    codes = obj.coder.codes(batch)  # (N, k)
    assert codes.shape == (int(batch.selected.sum()), 64) and (codes >= 0).all()
    # recompute from a full (no early exit) teacher run on the *unmasked* ids
    # D, λ and the layer straight from the dictionary's files, not from the object under test
    meta = json.loads(dictionary_path.with_suffix(".json").read_text())
    atoms = load_file(dictionary_path)["atoms"]  # (d, k)
    full = AutoModel.from_pretrained(teacher_dir).eval()
    with torch.no_grad():
        h = full(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                 output_hidden_states=True).hidden_states[meta["layer"]]
    x = torch.nn.functional.normalize(h[batch.selected], dim=-1)
    assert kkt_violation(x, atoms, codes, meta["lam"]).max() < 1e-4
    assert (codes.sum(1) > 0).float().mean() > 0.5


def test_teacher_exits_early(store_dir, teacher_dir, dictionary_path) -> None:
    obj, batch = _objective(store_dir, teacher_dir, dictionary_path)
    model = obj.coder.teacher.model
    assert len(model.encoder.layer) == 1  # layer 2 of 2 is gone: it cannot run


def test_loss_is_kl_and_falls(store_dir, teacher_dir, dictionary_path) -> None:
    obj, batch = _objective(store_dir, teacher_dir, dictionary_path)
    from mlsm.config import ModelConfig
    from mlsm.models.backbone import build_student

    from .helpers import TINY_MODEL

    student = build_student(ModelConfig(overrides=dict(TINY_MODEL)), obj.coder.teacher.tokenizer,
                            32, 0)
    obj.attach(student)
    assert isinstance(obj.heads["latent"], LatentHead) and not obj.exports_vocab_head
    student.eval()  # no dropout: the two passes below must see the same network
    out = forward_step(student, obj, batch)
    # independent KL: p from the codes, q from the head; scipy-free: sum p (log p - log q)
    codes = obj.coder.codes(batch)
    keep = codes.sum(1) > 0
    p = codes[keep] / codes[keep].sum(1, keepdim=True)
    with torch.no_grad():
        h = student.encode(batch.corrupted_ids, batch.attention_mask)[batch.selected][keep]
        q = torch.softmax(obj.heads["latent"](h), -1)
    expected = torch.where(p > 0, p * (p.log() - q.log()), torch.zeros_like(p)).sum()
    torch.testing.assert_close(out.loss_sum.detach(), expected, rtol=1e-4, atol=1e-4)
    assert out.loss_sum >= 0 and int(out.n_targets) == int(keep.sum())
    torch.testing.assert_close(p.sum(1), torch.ones(len(p)))
    losses = overfit_losses({"name": "mlsm", "dictionary": str(dictionary_path),
                             "teacher": str(teacher_dir)}, store_dir, steps=30)
    assert losses[-1] < 0.6 * losses[0]


def test_mismatches_are_one_line_errors(store_dir, teacher_dir, dictionary_path) -> None:
    from mlsm.teacher.teacher import default_teacher_path

    with pytest.raises(UserError, match="hidden size"):  # MiniLM d=384 vs dictionary d=32
        _objective(store_dir, default_teacher_path(), dictionary_path)
    with pytest.raises(UserError, match="layer"):
        _objective(store_dir, teacher_dir, dictionary_path, layer=2)
    with pytest.raises(UserError, match="dictionary is not set"):
        _objective(store_dir, teacher_dir, "")


def test_mlsm_run_checkpoint_is_backbone_plus_head(store_dir, teacher_dir, dictionary_path,
                                                   tmp_path) -> None:
    cfg = load_config(None, tiny_overrides(store_dir, tmp_path / "run", **{
        "objective.name": "mlsm", "objective.dictionary": str(dictionary_path),
        "objective.teacher": str(teacher_dir), "train.steps": 3}))
    run = pretrain(cfg)
    folder = run / "checkpoints" / "step-0000003"
    backbone = AutoModel.from_pretrained(folder)
    assert backbone.config.hidden_size == 32
    latent = json.loads((folder / "heads.json").read_text())["latent"]
    head = LatentHead(**{k: v for k, v in latent.items() if k in ("d", "k")})
    head.load_state_dict({k.removeprefix("latent."): v
                          for k, v in load_file(folder / "heads.safetensors").items()})
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert {"kl", "target_entropy", "nnz", "top1_agreement", "dropped"} <= metrics[0].keys()
    # same data seed -> the same batches as an MLM run
    mlm = pretrain(load_config(None,
                               tiny_overrides(store_dir, tmp_path / "mlm", **{"train.steps": 3})))
    mlm_metrics = [json.loads(x) for x in (mlm / "metrics.jsonl").read_text().splitlines()]
    assert [m["batch_digest"] for m in metrics] == [m["batch_digest"] for m in mlm_metrics]
    # a second fresh run with the same seeds is bit-identical, heads included
    cfg.train.out = str(tmp_path / "again")
    again = pretrain(cfg) / "checkpoints" / "step-0000003"
    for name in ("model.safetensors", "heads.safetensors"):
        a, b = load_file(folder / name), load_file(again / name)
        assert all(torch.equal(a[k], b[k]) for k in a), name
