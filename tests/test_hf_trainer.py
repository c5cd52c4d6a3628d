"""`MLSMTrainer` (mlsm.integrations.transformers): one optimizer step through `transformers.Trainer`
is one step of `mlsm pretrain` on the same batch, and its checkpoints are mlsm checkpoints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from mlsm.config import DataConfig
from mlsm.data.batches import BatchSource
from mlsm.data.corpus import TokenStore
from mlsm.models.backbone import build_student
from mlsm.run_config import load_config
from mlsm.train import loop
from mlsm.train.loop import pretrain
from tests.helpers import TINY_MODEL, read_metrics, tiny_overrides

pytest.importorskip("accelerate")  # transformers.Trainer needs it (the `hf` extra)

from transformers import TrainerCallback, TrainingArguments  # noqa: E402

from mlsm.integrations.transformers import (  # noqa: E402
    MLSMCollator,
    MLSMDataset,
    MLSMTrainer,
)

NO_DROPOUT = {**TINY_MODEL, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
BATCH, MICRO, LR = 8, 4, 1e-3


def _cfg(store: Path, out: Path, objective: dict, steps: int = 1):
    extra = {"train.steps": steps, "train.batch_size": BATCH, "train.micro_batch_size": MICRO,
             "train.readiness": "[1.0]", "optim.warmup": 0, "optim.clip": 0.0,
             "optim.lr": LR, "optim.weight_decay": 0.01, "optim.eps": 1e-6,
             "model.overrides": "{" + ", ".join(f"{k}: {v}" for k, v in NO_DROPOUT.items()) + "}",
             **{f"objective.{k}": v for k, v in objective.items()}}
    return load_config(None, tiny_overrides(store, out, **extra))


def _mlsm_step(cfg, monkeypatch) -> tuple[dict[str, torch.Tensor], Path]:
    """Run `mlsm pretrain` and record the gradients its loop hands to the optimizer."""
    grads: dict[str, torch.Tensor] = {}
    finish = loop._finish_gradients

    def recording(module, *args):
        norm = finish(module, *args)
        grads.update({n: p.grad.clone() for n, p in module.named_parameters()
                      if p.grad is not None})
        return norm

    monkeypatch.setattr(loop, "_finish_gradients", recording)
    return grads, pretrain(cfg)


class _Grads(TrainerCallback):
    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        if not self.grads:
            self.grads = {n: p.grad.clone() for n, p in model.named_parameters()
                          if p.grad is not None}


def _trainer(cfg, out: Path, steps: int = 1, **kw) -> tuple[MLSMTrainer, _Grads]:
    store = TokenStore.open(cfg.data.store)
    tok = store.load_tokenizer()
    model = build_student(cfg.model, tok, cfg.data.max_len, cfg.train.seed).hf  # pretrain's init
    args = TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=BATCH // MICRO, learning_rate=LR, weight_decay=0.01,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-6, warmup_steps=0,
        lr_scheduler_type="linear", max_grad_norm=0.0, optim="adamw_torch", use_cpu=True,
        report_to=[], logging_steps=1, seed=cfg.train.seed, dataloader_num_workers=0,
        disable_tqdm=True, **{"save_strategy": "no", **kw})
    spec = {k: v for k, v in vars(cfg.objective).items()}
    grads = _Grads()
    trainer = MLSMTrainer(model=model, args=args, objective=spec, processing_class=tok,
                          train_dataset=MLSMDataset(store, DataConfig(**vars(cfg.data))),
                          callbacks=[grads])
    return trainer, grads


OBJECTIVES = {
    "mlsm": lambda d, t: {"name": "mlsm", "dictionary": str(d), "teacher": str(t)},
    "mtl": lambda d, t: {"name": "mtl", "dictionary": str(d), "teacher": str(t)},
    "kd": lambda d, t: {"name": "kd", "teacher": str(t)},
}


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_one_trainer_step_is_one_pretrain_step(name, store_dir, teacher_dir, dictionary_path,
                                               tmp_path, monkeypatch) -> None:
    """Same init, same batch (mlsm's batch iterator, two micro-batches of unequal target counts):
    the Trainer's loss, its gradients before the optimizer step (student and heads) and the weights
    after it equal those of `mlsm pretrain`."""
    cfg = _cfg(store_dir, tmp_path / "run", OBJECTIVES[name](dictionary_path, teacher_dir))
    want_grads, run = _mlsm_step(cfg, monkeypatch)
    want_loss = read_metrics(run)[0]["loss"]
    trainer, got = _trainer(cfg, tmp_path / "hf")
    result = trainer.train()
    assert result.training_loss == pytest.approx(want_loss, rel=1e-6, abs=0)
    assert got.grads.keys() == want_grads.keys() and any(k.startswith("student.")
                                                         for k in got.grads)
    for key, want in want_grads.items():
        torch.testing.assert_close(got.grads[key], want, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, key=key: f"{key}: {m}")
    trainer.save_model(str(tmp_path / "hf" / "final"))
    mine = tmp_path / "hf" / "final"
    theirs = run / "checkpoints" / "step-0000001"
    for file in ["model.safetensors", *(["heads.safetensors"] if name != "kd" else [])]:
        a, b = load_file(mine / file), load_file(theirs / file)
        assert a.keys() == b.keys(), file
        for key in a:
            _same_update(a[key], b[key], key)
    info = json.loads((mine / "checkpoint.json").read_text())
    assert (info["step"], info["objective"], info["readiness"]) == (1, name, 1.0)
    # the Trainer's own reporting carries mlsm's numbers: the objective's metrics (kl, nnz, ...)
    # as metrics.jsonl logs them, and total_flos = the FLOPs `mlsm pretrain` counts per step
    record, logged = read_metrics(run)[0], trainer.state.log_history[0]
    own = set(record) - {"step", "loss", "lr", "grad_norm", "tokens_per_s", "tokens",
                         "n_targets", "batch_digest", "flops_per_step", "flops_per_s", "mfu"}
    assert own and own <= set(logged), (own, logged)
    for key in own:
        assert logged[key] == pytest.approx(record[key], rel=1e-5, abs=1e-7), key
    assert trainer.state.total_flos == pytest.approx(record["flops_per_step"], rel=1e-9)


def test_collator_masks_as_mlsm(store_dir) -> None:
    """Rows from MLSMDataset, in any order, give the rows of mlsm's own batch; a row without a
    sample index is keyed by its content (same row, same mask; other row, other mask)."""
    store = TokenStore.open(store_dir)
    tok = store.load_tokenizer()
    data = DataConfig(store=str(store_dir), max_len=32, seed=3)
    dataset = MLSMDataset(store, data)
    want = BatchSource(store, data, tok).batch(np.arange(8), 0)

    class Nothing(torch.nn.Module):
        def targets(self, batch):
            return None

        def target_count(self, batch, targets):
            return batch.selected.sum()

    collate = MLSMCollator(tok, Nothing(), data)
    order = [5, 2, 7, 0, 1, 6, 3, 4]
    got = collate([dataset[i] for i in order])
    for field in ("input_ids", "selected", "corrupted_ids", "chunks"):
        assert torch.equal(got[field], getattr(want, field)[order]), field
    assert int(got["n_targets"]) == int(want.selected.sum())
    bare = [{"input_ids": dataset[i]["input_ids"].tolist()} for i in (0, 1, 0)]
    rows = collate(bare)["selected"]
    assert torch.equal(rows[0], rows[2]) and not torch.equal(rows[0], rows[1])


def test_trainer_checkpoint_is_read_by_mlsm_verbs(store_dir, teacher_dir, dictionary_path,
                                                  tmp_path) -> None:
    """A checkpoint the Trainer writes during training is an mlsm checkpoint: `mlsm probe` trains
    its probe, `mlsm blimp` scores through it, `mlsm export` exports it, and the Trainer resumes
    from it."""
    from mlsm.cli import main

    cfg = _cfg(store_dir, tmp_path / "unused", OBJECTIVES["mlsm"](dictionary_path, teacher_dir))
    out = tmp_path / "hf"
    trainer, _ = _trainer(cfg, out, steps=2, save_strategy="steps", save_steps=2)
    trainer.train()
    folder = out / "checkpoint-2"
    assert (folder / "checkpoint.json").is_file() and (folder / "optimizer.pt").is_file()
    probe = tmp_path / "probe"
    assert main(["probe", str(folder), "--steps", "2", "--out", str(probe)]) == 0
    data = tmp_path / "blimp"
    data.mkdir()
    rows = [{"sentence_good": "the cat sees a dog.", "sentence_bad": "cat the sees dog a.",
             "UID": "order", "pairID": "0", "field": "syntax", "linguistics_term": "order"}]
    (data / "order.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    probed = probe / "checkpoints" / "step-0000002"
    assert main(["blimp", str(probed), "--data", str(data), "--out", str(tmp_path / "b")]) == 0
    assert main(["export", str(folder), "--out", str(tmp_path / "e")]) == 0
    # the Trainer resumes from its own checkpoint (weights through mlsm's loader)
    again, _ = _trainer(cfg, tmp_path / "again", steps=2)
    again.train(resume_from_checkpoint=str(folder))
    a = load_file(folder / "heads.safetensors")
    again.save_model(str(tmp_path / "again" / "final"))
    b = load_file(tmp_path / "again" / "final" / "heads.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)  # step 2 of 2: nothing left to train


def test_example_script_runs(store_dir, tokenizer_dir, teacher_dir, dictionary_path,
                             tmp_path) -> None:
    """examples/hf_trainer_mlsm.py, the script of docs/huggingface.md, at tiny size."""
    script = Path(__file__).resolve().parents[1] / "examples" / "hf_trainer_mlsm.py"
    text = tmp_path / "train.txt"
    text.write_text("\n".join(["the cat sees a dog and the dog sees a cat."] * 40) + "\n")
    out = tmp_path / "out"
    cmd = [sys.executable, str(script), "--train-file", str(text), "--tokenizer",
           str(teacher_dir), "--dictionary", str(dictionary_path), "--teacher", str(teacher_dir),
           "--output-dir", str(out), "--max-steps", "2", "--batch-size", "4", "--max-len", "32",
           "--tiny"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (out / "checkpoint.json").is_file() and (out / "heads.safetensors").is_file()
    assert "generated_from_trainer" in (out / "README.md").read_text()  # create_model_card()


def _same_update(a: torch.Tensor, b: torch.Tensor, key: str) -> None:
    """Weights after one AdamW step: equal (rtol 1e-5, atol 1e-6) except where the gradient sits
    at the noise floor. Adam's first step moves each weight by about lr * g / (|g| + eps), so a
    gradient of ~1e-7 (an unused position's) that the two sides reduce in another order can move
    by up to lr: allow that on at most 0.1 % of a tensor's elements, never more than 2 lr. A
    different lr, weight decay or eps moves almost every element, and fails."""
    diff = (a.float() - b.float()).abs()
    loose = diff > 1e-6 + 1e-5 * b.float().abs()
    assert int(loose.sum()) <= max(1, a.numel() // 1000), (key, int(loose.sum()), a.numel())
    assert float(diff.max()) <= 2 * LR, (key, float(diff.max()))


def test_a_save_killed_over_an_earlier_one_is_refused_and_saving_again_repairs(
        store_dir, teacher_dir, dictionary_path, tmp_path, monkeypatch) -> None:
    """save_model() over an earlier save writes file by file: a kill between left new weights
    beside the earlier checkpoint.json and heads, read as one checkpoint."""
    from mlsm.artifacts.checkpoint import Checkpoint
    from mlsm.errors import UserError
    from mlsm.train import checkpoint as ckpt

    cfg = _cfg(store_dir, tmp_path / "unused", OBJECTIVES["mlsm"](dictionary_path, teacher_dir))
    trainer, _ = _trainer(cfg, tmp_path / "hf")
    folder = tmp_path / "final"
    trainer.save_model(str(folder))
    assert Checkpoint.open(folder).step == 0
    trainer.train()
    real = ckpt.save_model_folder

    def killed(module, tokenizer, where):  # noqa: ANN001
        module.exported_model().save_pretrained(where, safe_serialization=True)
        raise KeyboardInterrupt  # the weights written, the heads and checkpoint.json not

    monkeypatch.setattr(ckpt, "save_model_folder", killed)
    with pytest.raises(KeyboardInterrupt):
        trainer.save_model(str(folder))
    with pytest.raises(UserError, match="save it again") as info:
        Checkpoint.open(folder)
    assert "\n" not in str(info.value)
    monkeypatch.setattr(ckpt, "save_model_folder", real)
    trainer.save_model(str(folder))
    assert Checkpoint.open(folder).step == 1


def test_trainer_resume_refuses_a_dictionary_relearned_in_place(
        store_dir, teacher_dir, dictionary_path, tmp_path) -> None:
    """`mlsm pretrain --resume` refuses inputs rebuilt in place; `train(resume_from_checkpoint=)`
    trained on, on other targets. Same record (checkpoint.json `inputs`), same check."""
    import shutil

    from mlsm.errors import UserError
    from mlsm.teacher.dictionary import Dictionary, load_dictionary, save_dictionary

    dictionary = Path(shutil.copy(dictionary_path, tmp_path / "d.safetensors"))
    shutil.copy(dictionary_path.with_suffix(".json"), tmp_path / "d.json")
    cfg = _cfg(store_dir, tmp_path / "unused", OBJECTIVES["mlsm"](dictionary, teacher_dir))
    trainer, _ = _trainer(cfg, tmp_path / "hf", steps=2, save_strategy="steps", save_steps=1)
    trainer.train()
    old = load_dictionary(dictionary)
    save_dictionary(Dictionary(old.atoms.flip(1).contiguous(), old.meta), dictionary)  # re-learned
    again, _ = _trainer(cfg, tmp_path / "again", steps=2)
    with pytest.raises(UserError, match=r"objective\.dictionary: .*rebuilt in place"):
        again.train(resume_from_checkpoint=str(tmp_path / "hf" / "checkpoint-1"))
