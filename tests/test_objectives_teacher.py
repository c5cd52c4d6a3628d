"""Teacher-based objectives: KD, MTL (MLSM + κ·MLM) and the naive MLSM recipe."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForMaskedLM, AutoTokenizer

from mlsm.config import DataConfig, ModelConfig
from mlsm.data.batches import BatchSource
from mlsm.data.corpus import TokenStore
from mlsm.errors import UserError
from mlsm.models.backbone import build_student
from mlsm.objectives import Context, build_objective, forward_step
from mlsm.run_config import load_config
from mlsm.teacher.sparse_coding import objective as lasso_objective
from mlsm.teacher.sparse_coding import sparse_encode
from mlsm.train.loop import pretrain

from .helpers import TINY_MODEL, check_resume, overfit_losses, tiny_overrides


def _setup(store_dir: Path, spec: dict):
    """(objective, student in eval mode with the objective's heads, one fixed batch)."""
    store = TokenStore.open(store_dir)
    tok = store.load_tokenizer()
    obj = build_objective(spec, Context(tok, torch.device("cpu"), 10, str(store_dir), 32))
    student = build_student(ModelConfig(overrides=dict(TINY_MODEL)), tok, 32, 0)
    obj.attach(student)
    student.eval()  # no dropout: repeated passes must see the same network
    source = BatchSource(store, DataConfig(store=str(store_dir), max_len=32), tok)
    batch = source.batch(np.arange(8), 0)
    return obj, student, batch


def _mlsm_spec(name: str, teacher_dir: Path, dictionary_path: Path, **extra) -> dict:
    return {"name": name, "dictionary": str(dictionary_path), "teacher": str(teacher_dir), **extra}


# ----------------------------------------------------------------------------- KD


def test_kd_is_scaled_kl_to_the_full_teacher(store_dir, teacher_dir) -> None:
    obj, student, batch = _setup(store_dir,
                                 {"name": "kd", "teacher": str(teacher_dir), "temperature": 2.0})
    assert obj.exports_vocab_head
    out = forward_step(student, obj, batch)
    # independent reference: the teacher's *full* HF forward (logits at every position)
    full = AutoModelForMaskedLM.from_pretrained(teacher_dir).eval()
    with torch.no_grad():
        t = full(input_ids=batch.corrupted_ids,
                 attention_mask=batch.attention_mask).logits[batch.selected]
        s = student.hf(input_ids=batch.corrupted_ids,
                       attention_mask=batch.attention_mask).logits[batch.selected]
    p, q = torch.softmax(t / 2, -1), torch.softmax(s / 2, -1)
    torch.testing.assert_close(p.sum(1), torch.ones(len(p)))
    kl = (p * (p.log() - q.log())).sum(1)  # (N,)
    assert (kl >= 0).all()
    torch.testing.assert_close(out.loss_sum.detach(), 4.0 * kl.sum(), rtol=1e-4, atol=1e-4)
    assert int(out.n_targets) == int(batch.selected.sum())


def test_kd_loss_falls(store_dir, teacher_dir) -> None:
    losses = overfit_losses({"name": "kd", "teacher": str(teacher_dir)}, store_dir, steps=25)
    assert losses[-1] < 0.6 * losses[0]


def test_kd_needs_an_mlm_head(store_dir) -> None:
    from mlsm.teacher.teacher import default_teacher_path

    with pytest.raises(UserError, match="no MLM head"):
        _setup(store_dir, {"name": "kd", "teacher": str(default_teacher_path())})
    with pytest.raises(UserError, match="objective.teacher is not set"):
        _setup(store_dir, {"name": "kd"})
    with pytest.raises(UserError, match="temperature"):
        _setup(store_dir, {"name": "kd", "teacher": "x", "temperature": 0.0})


def test_kd_run_resumes(store_dir, teacher_dir, tmp_path) -> None:
    check_resume(store_dir, tmp_path, at=2, steps=4,
                 **{"objective.name": "kd", "objective.teacher": str(teacher_dir)})


# ----------------------------------------------------------------------------- MTL


def test_mtl_is_mean_mlsm_plus_kappa_mean_mlm(store_dir, teacher_dir, dictionary_path) -> None:
    obj, student, batch = _setup(store_dir,
                                 _mlsm_spec("mtl", teacher_dir, dictionary_path, kappa=0.25))
    assert "latent" in obj.exported_heads() and obj.exports_vocab_head
    out = forward_step(student, obj, batch)
    # the two parts, separately
    a, b = forward_step(student, obj.mlsm, batch), forward_step(student, obj.mlm, batch)
    expected = a.loss_sum / a.n_targets + 0.25 * b.loss_sum / b.n_targets
    torch.testing.assert_close((out.loss_sum / out.n_targets).detach(), expected.detach(),
                               rtol=1e-5, atol=1e-6)
    assert int(out.n_targets) == int(batch.selected.sum())
    losses = overfit_losses(_mlsm_spec("mtl", teacher_dir, dictionary_path), store_dir, steps=25)
    assert losses[-1] < 0.6 * losses[0]


def test_mtl_checkpoint_exports_both_heads(store_dir, teacher_dir, dictionary_path,
                                           tmp_path) -> None:
    cfg = load_config(None, tiny_overrides(store_dir, tmp_path / "run", **{
        "objective.name": "mtl", "objective.dictionary": str(dictionary_path),
        "objective.teacher": str(teacher_dir), "objective.kappa": 1.0, "train.steps": 2}))
    folder = pretrain(cfg) / "checkpoints" / "step-0000002"
    mlm = AutoModelForMaskedLM.from_pretrained(folder)  # vocabulary head
    assert mlm.config.vocab_size == len(AutoTokenizer.from_pretrained(folder))
    heads = load_file(folder / "heads.safetensors")  # latent head
    assert heads["latent.proj.weight"].shape == (64, 32)


def test_mtl_run_resumes(store_dir, teacher_dir, dictionary_path, tmp_path) -> None:
    check_resume(store_dir, tmp_path, at=2, steps=4,
                 files=("model.safetensors", "heads.safetensors"), **{
                     "objective.name": "mtl", "objective.dictionary": str(dictionary_path),
                     "objective.teacher": str(teacher_dir)})


# ----------------------------------------------------------------------------- naive MLSM


def test_naive_runs_every_teacher_layer_and_its_logits(store_dir, teacher_dir,
                                                       dictionary_path) -> None:
    obj, student, batch = _setup(store_dir, _mlsm_spec("mlsm_naive", teacher_dir, dictionary_path))
    ran: list[str] = []
    layers = obj.teacher.base_model.encoder.layer
    assert len(layers) == 2  # nothing dropped, although the dictionary lives on layer 1
    for i, layer in enumerate(layers):
        layer.register_forward_hook(lambda *_, i=i: ran.append(f"layer{i}"))
    obj.teacher.cls.register_forward_hook(lambda *_: ran.append("mlm_head"))
    head = obj.heads["naive"]
    assert head.out_features == 200 + 64  # |V| + k
    out = forward_step(student, obj, batch)
    assert ran == ["layer0", "layer1", "mlm_head"]
    assert out.loss_sum >= 0
    # FISTA-100 codes are close to the exact optimum of the same problem
    codes = obj.codes(batch)
    with torch.no_grad():
        h = obj.teacher(input_ids=batch.input_ids,
                        output_hidden_states=True).hidden_states[1][batch.selected]
    x = torch.nn.functional.normalize(h, dim=-1)
    exact = sparse_encode(x, obj.atoms, obj.lam)
    gap = (lasso_objective(x, obj.atoms, codes, obj.lam)
           - lasso_objective(x, obj.atoms, exact, obj.lam))
    assert gap.min() > -1e-5 and gap.mean() < 1e-2


def test_naive_loss_falls(store_dir, teacher_dir, dictionary_path) -> None:
    losses = overfit_losses(_mlsm_spec("mlsm_naive", teacher_dir, dictionary_path), store_dir,
                            steps=25)
    assert losses[-1] < 0.6 * losses[0]


# ----------------------------------------------------------------------------- agreement


@pytest.fixture(scope="module")
def foreign_tokenizer_teacher(teacher_dir, tmp_path_factory) -> Path:
    """The fixture teacher's weights saved with another tokenizer (MiniLM's)."""
    from mlsm.teacher.teacher import default_teacher_path

    out = tmp_path_factory.mktemp("foreign")
    AutoModelForMaskedLM.from_pretrained(teacher_dir).save_pretrained(out)
    AutoTokenizer.from_pretrained(default_teacher_path()).save_pretrained(out)
    return out


@pytest.mark.parametrize("name", ["mlsm", "kd", "mlsm_naive", "mtl"])
def test_tokenizer_mismatch_is_one_line_error(name, store_dir, foreign_tokenizer_teacher,
                                              dictionary_path) -> None:
    spec = _mlsm_spec(name, foreign_tokenizer_teacher, dictionary_path)
    if name == "kd":
        spec = {"name": "kd", "teacher": str(foreign_tokenizer_teacher)}
    # the loader refuses a tokenizer with more ids than the embeddings; one that fits is refused
    # by the objective ("tokenises differently"): either way, one line
    with pytest.raises(UserError, match="tokenises differently|another model.s") as err:
        _setup(store_dir, spec)
    assert "\n" not in str(err.value)


def test_naive_mismatches(store_dir, teacher_dir, dictionary_path) -> None:
    with pytest.raises(UserError, match="layer"):
        _setup(store_dir, _mlsm_spec("mlsm_naive", teacher_dir, dictionary_path, layer=2))
    with pytest.raises(UserError, match="layer 7 does not exist"):
        _setup(store_dir, _mlsm_spec("mlsm_naive", teacher_dir, dictionary_path, layer=7))
    with pytest.raises(UserError, match="kappa"):
        _setup(store_dir, _mlsm_spec("mtl", teacher_dir, dictionary_path, kappa=-1.0))
