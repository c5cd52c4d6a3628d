"""MAE-LM and MAE-MLSM: what the encoder really sees, the split, losses, export, exact resume."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModel

from mlsm.config import DataConfig, ModelConfig
from mlsm.data.batches import BatchSource
from mlsm.data.corpus import TokenStore
from mlsm.errors import UserError
from mlsm.models.backbone import build_student
from mlsm.models.mae import DECODER, split_encoder_input
from mlsm.objectives import Context, build_objective, forward_step
from mlsm.run_config import load_config
from mlsm.train.loop import pretrain

from .helpers import TINY_MODEL, check_resume, overfit_losses, read_metrics, tiny_overrides


def _setup(store_dir: Path, spec: dict, arch: str = "bert", mask_rate: float = 0.15):
    store = TokenStore.open(store_dir)
    tok = store.load_tokenizer()
    student = build_student(ModelConfig(arch=arch, overrides=dict(TINY_MODEL)), tok, 32, seed=0)
    obj = build_objective(spec, Context(tok, torch.device("cpu"), 6, str(store_dir), 32))
    obj.attach(student)
    source = BatchSource(store, DataConfig(store=str(store_dir), max_len=32, mask_rate=mask_rate),
                         tok)
    return student.eval(), obj, source.batch(np.arange(8), 0), tok


def _record_encoder_inputs(student) -> tuple[list, list]:
    """Forward pre-hooks: ids entering the word embeddings, kwargs entering the backbone."""
    ids, kwargs = [], []
    student.backbone.get_input_embeddings().register_forward_pre_hook(
        lambda m, a: ids.append(a[0].clone()))
    student.backbone.register_forward_pre_hook(lambda m, a, kw: kwargs.append(kw), with_kwargs=True)
    return ids, kwargs


@pytest.mark.parametrize("arch", ["bert", "roberta"])
def test_encoder_never_receives_mask_and_keeps_positions(arch: str, store_dir: Path) -> None:
    student, obj, batch, tok = _setup(store_dir, {"name": "mae_lm"}, arch, mask_rate=0.4)
    ids, kwargs = _record_encoder_inputs(student)
    with torch.no_grad():
        forward_step(student, obj, batch)
    seen, kw = ids[0], kwargs[0]
    real = kw["attention_mask"].bool()  # (B, K)
    assert not (seen == tok.mask_token_id).any()
    assert int(real.sum()) == int((~batch.selected).sum())  # exactly the unselected tokens
    # each kept token enters with its original position id (RoBERTa offsets by padding_idx + 1)
    offset = student.config.pad_token_id + 1 if arch == "roberta" else 0
    pos = kw["position_ids"] - offset  # (B, K)
    orig = batch.input_ids.gather(1, pos.clamp(min=0))
    assert torch.equal(seen[real], orig[real]) and not batch.selected.gather(1, pos)[real].any()


def test_delta_keeps_that_fraction_as_mask(store_dir: Path) -> None:
    student, obj, batch, tok = _setup(store_dir, {"name": "mae_lm", "delta": 1.0})
    ids, _ = _record_encoder_inputs(student)
    with torch.no_grad():
        forward_step(student, obj, batch)
    # δ=1: all kept as [MASK]
    assert int((ids[0] == tok.mask_token_id).sum()) == int(batch.selected.sum())
    student, obj, batch, tok = _setup(store_dir, {"name": "mae_lm", "delta": 0.5}, mask_rate=0.4)
    ids, _ = _record_encoder_inputs(student)
    with torch.no_grad():
        forward_step(student, obj, batch)
    frac = int((ids[0] == tok.mask_token_id).sum()) / int(batch.selected.sum())
    assert 0.3 < frac < 0.7
    with pytest.raises(UserError, match="delta"):
        _setup(store_dir, {"name": "mae_lm", "delta": 1.5})


def test_batched_split_equals_each_row_alone(store_dir: Path) -> None:
    # padding the kept tokens to a common length must not leak into any row's encoder states
    student, _, batch, tok = _setup(store_dir, {"name": "mae_lm"}, mask_rate=0.4)
    split = split_encoder_input(batch.input_ids, batch.attention_mask, batch.selected,
                                tok.pad_token_id)
    assert len(set(split.attention_mask.sum(1).tolist())) > 1  # rows really differ in length
    with torch.no_grad():
        together = student.encode(split.input_ids, split.attention_mask,
                                  position_ids=split.positions)
        for b in range(len(batch.input_ids)):
            keep = ~batch.selected[b]
            pos = torch.nonzero(keep).T  # (1, n_b)
            alone = student.encode(batch.input_ids[b, keep][None], torch.ones_like(pos),
                                   position_ids=pos)[0]
            torch.testing.assert_close(together[b, : len(alone)], alone, rtol=1e-4, atol=1e-5)


def test_unsupported_arch_is_a_one_line_error(store_dir: Path) -> None:
    with pytest.raises(UserError, match="position ids"):
        _setup(store_dir, {"name": "mae_lm"}, "deberta-v2")


def test_losses_fall(store_dir: Path, teacher_dir: Path, dictionary_path: Path) -> None:
    losses = overfit_losses({"name": "mae_lm"}, store_dir, steps=12)
    assert losses[-1] < 0.8 * losses[0]
    spec = {"name": "mae_mlsm", "dictionary": str(dictionary_path), "teacher": str(teacher_dir)}
    losses = overfit_losses(spec, store_dir, steps=15)
    assert losses[-1] < 0.65 * losses[0]


def test_mae_lm_run_exports_encoder_and_resumes_exactly(store_dir: Path, tmp_path: Path) -> None:
    extra = {"objective.name": "mae_lm"}
    full = pretrain(load_config(None, tiny_overrides(store_dir, tmp_path / "full", **extra)))
    # encoder and decoder both exact, and a real resume
    check_resume(store_dir, tmp_path / "resume", at=3,
                 files=("model.safetensors", "heads.safetensors"), **extra)
    folder = full / "checkpoints" / "step-0000006"
    encoder = AutoModel.from_pretrained(folder)
    assert encoder.config.hidden_size == 32
    assert not any(k.startswith("cls.") for k in load_file(folder / "model.safetensors"))
    meta = json.loads((folder / "heads.json").read_text())
    assert meta[DECODER]["layers"] == 2 and meta[DECODER]["width"] == 32
    mlm = pretrain(load_config(None, tiny_overrides(store_dir, tmp_path / "mlm")))
    ours, theirs = read_metrics(full), read_metrics(mlm)
    assert [m["batch_digest"] for m in ours] == [m["batch_digest"] for m in theirs]
    assert [m["n_targets"] for m in ours] == [m["n_targets"] for m in theirs]


def test_mae_mlsm_run_checkpoint(store_dir: Path, teacher_dir: Path, dictionary_path: Path,
                                 tmp_path: Path) -> None:
    run = pretrain(load_config(None, tiny_overrides(store_dir, tmp_path / "run", **{
        "objective.name": "mae_mlsm", "objective.dictionary": str(dictionary_path),
        "objective.teacher": str(teacher_dir), "train.steps": 3, "objective.decoder_width": 16})))
    folder = run / "checkpoints" / "step-0000003"
    AutoModel.from_pretrained(folder)
    heads = load_file(folder / "heads.safetensors")
    assert any(k.startswith("latent.") for k in heads)
    assert any(k.startswith(f"{DECODER}.") for k in heads)
    assert {"kl", "top1_agreement"} <= read_metrics(run)[0].keys()



def test_mae_lm_loss_recomputed_row_by_row(store_dir: Path) -> None:
    # independent of split/scatter: each row's kept tokens alone through the encoder (original
    # positions), written back into a full-length sequence by hand, the decoder's layers applied
    # step by step, the tied head as a plain matmul, cross-entropy with the ORIGINAL ids
    student, obj, batch, tok = _setup(store_dir, {"name": "mae_lm"}, mask_rate=0.3)
    dec, head = obj.exported_heads()[DECODER], obj.exported_heads()["mae_lm_head"]
    emb = student.backbone.get_input_embeddings().weight  # (V, d)
    total = torch.zeros(())
    with torch.no_grad():
        out = forward_step(student, obj, batch)
        for b in range(len(batch.input_ids)):
            sel = batch.selected[b]  # (T,)
            pos = torch.nonzero(~sel).T  # (1, n_b) original positions of the kept tokens
            enc = student.encode(batch.input_ids[b, ~sel][None], torch.ones_like(pos),
                                 position_ids=pos)[0]  # (n_b, d)
            x = torch.zeros(len(sel), dec.mask_embedding.numel())
            x[~sel] = dec.proj_in(enc)
            x[sel] = dec.mask_embedding
            x = dec.norm(x + dec.positions.weight[: len(sel)])[None]  # (1, T, w)
            for layer in dec.layers:
                x = layer(x)
            h = dec.proj_out(x)[0][sel]  # (n_sel, d)
            logits = torch.nn.functional.gelu(head.dense(h))
            logits = head.norm(logits) @ emb.T + head.bias  # (n_sel, V)
            total += torch.nn.functional.cross_entropy(logits, batch.input_ids[b, sel],
                                                       reduction="sum")
    assert int(out.n_targets) == int(batch.selected.sum())
    torch.testing.assert_close(out.loss_sum, total, rtol=1e-5, atol=1e-4)
