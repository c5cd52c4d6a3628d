"""Dense feature distillation (`feature_kd`): the loss by hand, the early-exit target against HF's
full forward, who reads what (student: corrupted, teacher: unmasked), a pretrain run whose latent
head the probe reads, the plateau probe on it, and a study arm without a dictionary."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from transformers import AutoModel

from mlsm.config import DataConfig, ModelConfig
from mlsm.data.batches import Batch, BatchSource
from mlsm.data.corpus import TokenStore
from mlsm.errors import UserError
from mlsm.models.backbone import build_student
from mlsm.models.heads import LatentHead, read_latent_head
from mlsm.objectives import Context, build_objective, forward_step
from mlsm.objectives.feature_kd import FeatureKD, FeatureKDConfig, teacher_features
from mlsm.run_config import load_config
from mlsm.train.loop import pretrain

from .helpers import TINY_MODEL, overfit_losses, read_metrics, tiny_overrides

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WIDE = {**TINY_MODEL, "hidden_size": 48}  # student d = 48 != the tiny teacher's d_t = 32


def _objective(store_dir: Path, teacher: str, **options: object) -> tuple[FeatureKD, Batch]:
    store = TokenStore.open(store_dir)
    tok = store.load_tokenizer()
    spec = {"name": "feature_kd", "teacher": teacher, "layer": 1, **options}
    obj = build_objective(spec, Context(tok, torch.device("cpu"), 10, str(store_dir), 32))
    batch = BatchSource(store, DataConfig(store=str(store_dir), max_len=32), tok).batch(
        np.arange(8), 0)
    return obj, batch


def _hf_states(teacher_dir: Path, ids: torch.Tensor, mask: torch.Tensor,
               layer: int) -> torch.Tensor:
    """hidden_states[layer] (B, T, d_t) of the teacher's full HF forward (no early exit)."""
    full = AutoModel.from_pretrained(teacher_dir).eval()
    with torch.no_grad():
        return full(input_ids=ids, attention_mask=mask,
                    output_hidden_states=True).hidden_states[layer]


@pytest.mark.parametrize("loss", ["cosine", "mse"])
def test_loss_is_the_by_hand_sum_over_targets(store_dir, teacher_dir, loss) -> None:
    obj, batch = _objective(store_dir, str(teacher_dir), loss=loss)
    student = build_student(ModelConfig(overrides=dict(WIDE)), obj.teacher.tokenizer, 32, 0)
    obj.attach(student)
    head = obj.heads["latent"]
    assert isinstance(head, LatentHead) and not obj.exports_vocab_head
    assert (head.dense.in_features, head.proj.out_features) == (48, 32)  # d -> d_t
    student.eval()  # no dropout: the two passes below must see the same network
    out = forward_step(student, obj, batch)
    # by hand: the teacher's full forward on the unmasked ids, the student on the corrupted ones
    sel = batch.selected
    h = _hf_states(teacher_dir, batch.input_ids, batch.attention_mask, 1)[sel]  # (N, 32)
    target = h / h.norm(dim=-1, keepdim=True)
    with torch.no_grad():
        y = head(student.encode(batch.corrupted_ids, batch.attention_mask)[sel])  # (N, 32)
    cos = (y * target).sum(-1) / y.norm(dim=-1)  # |target| = 1
    sq = ((y - target) ** 2).sum(-1)
    expected = (1 - cos).sum() if loss == "cosine" else sq.sum()
    torch.testing.assert_close(out.loss_sum.detach(), expected, rtol=1e-4, atol=1e-4)
    assert int(out.n_targets) == int(sel.sum()) > 0
    torch.testing.assert_close(out.metrics["cosine"], cos.sum(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.metrics["sq_error"], sq.sum(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layer", [1, 2])
def test_target_is_hf_hidden_state_of_layer_l_normalised_with_early_exit(
        store_dir, teacher_dir, layer) -> None:
    obj, batch = _objective(store_dir, str(teacher_dir), layer=layer)
    assert len(obj.teacher.model.encoder.layer) == layer  # blocks after l are gone: cannot run
    got = obj.targets(batch)  # (N, d_t)
    h = _hf_states(teacher_dir, batch.input_ids, batch.attention_mask, layer)[batch.selected]
    torch.testing.assert_close(got, F.normalize(h, dim=-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.norm(dim=-1), torch.ones(len(got)))
    assert got.dtype == torch.float32


def test_packaged_minilm_target_matches_hf_at_layer_5() -> None:
    """The default teacher (all-MiniLM-L6-v2, layer 5 of 6), padded rows included."""
    from mlsm.teacher.teacher import default_teacher_path, load_teacher

    teacher = load_teacher(None, 5)
    enc = teacher.tokenizer(["the cat sees a small red bird near the river",
                             "a dog runs"], padding=True, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    selected = (mask.bool() & (torch.arange(ids.shape[1]) % 2 == 1))  # (B, T)
    batch = Batch(ids, mask, ~mask.bool(), selected, ids.clone(), torch.arange(2),
                  torch.arange(2), 0)
    got = teacher_features(teacher, batch)
    h = _hf_states(default_teacher_path(), ids, mask, 5)[selected]
    torch.testing.assert_close(got, F.normalize(h, dim=-1), rtol=1e-4, atol=1e-5)
    assert got.shape == (int(selected.sum()), 384)


def test_student_reads_the_corrupted_ids_and_the_teacher_the_unmasked_ones(
        store_dir, teacher_dir) -> None:
    obj, batch = _objective(store_dir, str(teacher_dir))
    sel = batch.selected
    assert (batch.corrupted_ids[sel] != batch.input_ids[sel]).any()  # the test can tell them apart
    student = build_student(ModelConfig(overrides=dict(TINY_MODEL)), obj.teacher.tokenizer, 32, 0)
    obj.attach(student)
    inputs = obj.student_inputs(student, batch, obj.targets(batch))
    assert torch.equal(inputs["input_ids"], batch.corrupted_ids)
    # the targets depend on the original ids only: another corruption leaves them unchanged ...
    other = torch.where(sel, torch.full_like(batch.input_ids, 7), batch.input_ids)
    recorrupted = Batch(**{**batch.__dict__, "corrupted_ids": other})
    torch.testing.assert_close(obj.targets(recorrupted), obj.targets(batch), rtol=0, atol=0)
    # ... and other original ids change them
    edited = Batch(**{**batch.__dict__, "input_ids": batch.corrupted_ids})
    assert not torch.allclose(obj.targets(edited), obj.targets(batch), atol=1e-4)


def test_mismatches_and_bad_options_are_one_line_errors(store_dir, teacher_dir) -> None:
    from mlsm.teacher.teacher import default_teacher_path

    with pytest.raises(UserError, match="tokenises differently.*mlsm prepare"):
        _objective(store_dir, str(default_teacher_path()))  # MiniLM's tokenizer vs the store's
    with pytest.raises(UserError, match="layer 3 does not exist"):
        _objective(store_dir, str(teacher_dir), layer=3)
    with pytest.raises(UserError, match="objective.layer must be"):
        _objective(store_dir, str(teacher_dir), layer=0)
    with pytest.raises(UserError, match="objective.loss"):
        _objective(store_dir, str(teacher_dir), loss="l1")
    ctx = Context(TokenStore.open(store_dir).load_tokenizer(), torch.device("cpu"), 1)
    with pytest.raises(UserError, match="objective.loss"):  # a Config built in Python
        build_objective(FeatureKDConfig(teacher=str(teacher_dir), layer=1, loss="l1"), ctx)


def test_overfitting_one_batch_lowers_the_loss(store_dir, teacher_dir) -> None:
    for loss in ("cosine", "mse"):
        losses = overfit_losses({"name": "feature_kd", "teacher": str(teacher_dir), "layer": 1,
                                 "loss": loss}, store_dir, steps=30)
        assert losses[-1] < 0.5 * losses[0], (loss, losses[0], losses[-1])


@pytest.fixture(scope="module")
def fkd_run(store_dir: Path, teacher_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 16-step feature-KD run of a wider student: another objective and model than conftest's
    shared runs, so its own training (module-scoped: every test here reads it)."""
    out = tmp_path_factory.mktemp("fkd") / "run"
    widths = "{" + ", ".join(f"{k}: {v}" for k, v in WIDE.items()) + "}"
    cfg = load_config(None, tiny_overrides(store_dir, out, **{
        "objective.name": "feature_kd", "objective.teacher": str(teacher_dir),
        "objective.layer": 1, "train.steps": 16, "optim.lr": 3e-3, "model.overrides": widths}))
    return pretrain(cfg)


def test_pretrain_lowers_the_loss_and_saves_a_latent_head_of_teacher_width(fkd_run) -> None:
    metrics = read_metrics(fkd_run)
    assert {"cosine", "sq_error", "pred_norm"} <= metrics[0].keys()
    losses = [m["loss"] for m in metrics]
    assert np.mean(losses[-4:]) < 0.7 * np.mean(losses[:2]), losses
    assert metrics[-1]["cosine"] > metrics[0]["cosine"]
    folder = fkd_run / "checkpoints" / "step-0000016"
    head, meta = read_latent_head(folder)
    assert meta == {"class": "LatentHead", "d": 48, "k": 32}  # k = the teacher's hidden size
    assert isinstance(head, LatentHead) and head(torch.zeros(3, 48)).shape == (3, 32)
    assert json.loads((folder / "heads.json").read_text()).keys() == {"latent"}


def test_plateau_probe_runs_on_a_feature_kd_checkpoint(fkd_run, tmp_path) -> None:
    from mlsm.evaluate.probe.probe_fit import train_probe_to_plateau

    info = train_probe_to_plateau(fkd_run / "checkpoints" / "step-0000016", tmp_path / "probe",
                                  max_steps=30, eval_every=10, select_steps=10, patience=2,
                                  heldout_batches=1, batch_size=8)
    assert info["width"] == 32 and info["heldout_loss"] <= info["unigram_loss"]
    assert (tmp_path / "probe" / "probe.json").is_file() and Path(info["checkpoint"]).is_dir()


def test_a_study_arm_without_a_dictionary_trains_and_gets_its_probe(
        corpus_dir, tokenizer_dir, teacher_dir, tmp_path) -> None:
    from mlsm.study.runner import Study, run_study
    from mlsm.study.spec import load_study

    blimp = tmp_path / "blimp"
    blimp.mkdir()
    pair = {"sentence_good": "the cat sees a dog", "sentence_bad": "dog a sees cat the",
            "UID": "uid_a", "field": "syntax", "linguistics_term": "order", "pairID": "0"}
    (blimp / "uid_a.jsonl").write_text(json.dumps(pair) + "\n")
    out = tmp_path / "study"
    raw = {"name": "fkd", "out": str(out),
           "corpus": {"sources": [str(corpus_dir)], "tokenizer": str(tokenizer_dir)},
           "base": {"data": {"max_len": 32}, "model": {"arch": "bert", "overrides": TINY_MODEL},
                    "train": {"steps": 6, "batch_size": 8, "log_every": 1, "device": "cpu"}},
           "readiness": [1.0],
           "arms": {"mlm": {"objective": {"name": "mlm"}},
                    "fkd": {"objective": {"name": "feature_kd", "layer": 1,
                                          "teacher": str(teacher_dir)}}},
           "probe": {"max_steps": 20, "eval_every": 10, "select_steps": 10,
                     "heldout_batches": 1, "batch_size": 8},
           "blimp": {"data": [str(blimp)], "readiness": [1.0]},
           "executor": {"kind": "local", "threads": 1}}
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(raw))
    spec = load_study(tmp_path / "study.yaml")
    study = Study(spec, log=lambda s: None)
    assert study.is_latent("fkd") and not study.is_latent("mlm")
    assert study.dictionary_path("fkd") is None and study.targets_path("fkd") is None
    cfg = study.arm_config("fkd")
    assert cfg.objective == FeatureKDConfig(teacher=str(teacher_dir), layer=1)
    run_study(spec, stages=["store", "dictionary", "pretrain", "probe"], log=lambda s: None)
    probe = json.loads((out / "runs" / "fkd" / "probe-100" / "probe.json").read_text())
    assert probe["width"] == 32
    assert not (out / "runs" / "mlm" / "probe-100").exists()  # no latent head, no probe


def test_a_feature_kd_arm_reads_the_study_teacher(tmp_path) -> None:
    """A study's `dictionary.teacher` is the teacher whose states the MLSM arms' codes come from;
    the dense control (feature_kd) must distil that same teacher, not the packaged one, unless
    the arm names its own. Logit KD's teacher is a masked LM of its own and is left alone."""
    from mlsm.study.runner import Study
    from mlsm.study.spec import study_from_dict

    teacher = str(tmp_path / "my-teacher")
    raw = {"name": "t", "out": str(tmp_path / "study"),
           "dictionary": {"teacher": teacher},
           "arms": {"fkd": {"objective": {"name": "feature_kd", "layer": 3}},
                    "fkd_own": {"objective": {"name": "feature_kd", "teacher": "other"}},
                    "kd": {"objective": {"name": "kd", "teacher": "an-mlm"}},
                    "mlm": {"objective": {"name": "mlm"}}}}
    study = Study(study_from_dict(raw), log=lambda s: None, create=False)
    assert study.arm_config("fkd").objective.teacher == teacher
    assert study.arm_config("fkd_own").objective.teacher == "other"
    assert study.arm_config("kd").objective.teacher == "an-mlm"
    raw["dictionary"] = {}  # no study teacher: the packaged one, as before (fingerprints kept)
    assert Study(study_from_dict(raw), create=False).arm_config("fkd").objective.teacher == ""
