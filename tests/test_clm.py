"""CLM, CLM->MLM and continued pre-training: causal mask, targets, phase switch, resume, recipes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModel, AutoModelForMaskedLM

from mlsm.cli import main
from mlsm.config import DataConfig, ModelConfig
from mlsm.data.batches import BatchSource
from mlsm.data.corpus import TokenStore
from mlsm.errors import UserError
from mlsm.models.backbone import Student, build_student
from mlsm.models.heads import check_scored_by_pll
from mlsm.objectives import OBJECTIVES, Context, build_objective, forward_step
from mlsm.objectives.clm import causal_encode, next_token_targets
from mlsm.run_config import load_config
from mlsm.train.loop import pretrain

from .helpers import TINY_MODEL, check_resume, overfit_losses, read_metrics, tiny_overrides

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "tiny"


def _setup(store_dir: Path, arch: str = "bert", spec: dict | None = None, total: int = 6):
    store = TokenStore.open(store_dir)
    tok = store.load_tokenizer()
    student = build_student(ModelConfig(arch=arch, overrides=dict(TINY_MODEL)), tok, 32, seed=0)
    obj = build_objective(spec or {"name": "clm"},
                          Context(tok, torch.device("cpu"), total, str(store_dir), 32))
    obj.attach(student)
    source = BatchSource(store, DataConfig(store=str(store_dir), max_len=32), tok)
    return student.eval(), obj, source


@pytest.mark.parametrize("arch", ["bert", "roberta", "modernbert"])
def test_causal_mask_blocks_the_future(arch: str, store_dir: Path) -> None:
    student, _, source = _setup(store_dir, arch)
    batch = source.batch(np.arange(4), 0)
    j = 20
    changed = batch.input_ids.clone()
    changed[:, j:] = (changed[:, j:] + 7) % 150 + 5  # every token from j on differs
    with torch.no_grad():
        a = causal_encode(student, batch.input_ids, batch.attention_mask)  # (B, T, d)
        b = causal_encode(student, changed, batch.attention_mask)
        bidi_a = student.encode(batch.input_ids, batch.attention_mask)
        bidi_b = student.encode(changed, batch.attention_mask)
    torch.testing.assert_close(a[:, :j], b[:, :j], rtol=0, atol=1e-5)
    assert (a[:, j:] - b[:, j:]).abs().max() > 1e-3
    # without the mask the past does change
    assert (bidi_a[:, :j] - bidi_b[:, :j]).abs().max() > 1e-3
    # the config stays a bidirectional encoder
    assert not getattr(student.config, "is_decoder", False)


def test_clm_targets_are_real_successors_and_loss_falls(store_dir: Path) -> None:
    student, obj, source = _setup(store_dir)
    batch = source.batch(np.arange(4), 0)
    where = next_token_targets(batch)
    assert not where[:, -1].any() and where[:, 0].all()  # [CLS] predicts x1; nothing after the end
    # each target's successor is a real non-special token, and every such token is a target
    assert torch.equal(where[:, :-1], ~batch.special_mask[:, 1:])
    out = forward_step(student, obj, batch)
    assert int(out.n_targets) == int((~batch.special_mask).sum())
    losses = overfit_losses({"name": "clm"}, store_dir, steps=12)
    assert losses[-1] < 0.9 * losses[0]


def test_unsupported_arch_is_a_one_line_error(store_dir: Path) -> None:
    with pytest.raises(UserError, match="causal attention is not supported"):
        _setup(store_dir, "deberta-v2")


def test_attention_is_causal_exactly_before_the_switch(store_dir: Path) -> None:
    student, obj, source = _setup(store_dir, spec={"name": "clm_then_mlm", "clm_fraction": 0.5},
                                  total=6)
    seen: list[int] = []
    hook = student.backbone.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["attention_mask"].dim()), with_kwargs=True)
    metrics = []
    for step in range(6):
        metrics.append(set(forward_step(student, obj, source.batch(np.arange(2), step)).metrics))
    hook.remove()
    assert seen == [4, 4, 4, 2, 2, 2]  # 4-D causal mask at steps 0-2, the plain padding mask after
    assert all("clm_loss" in m for m in metrics[:3]) and all("mlm_loss" in m for m in metrics[3:])
    with pytest.raises(UserError, match="clm_fraction"):
        _setup(store_dir, spec={"name": "clm_then_mlm", "clm_fraction": 1.5})


def test_clm_then_mlm_run_switches_resumes_exactly_and_exports(store_dir: Path,
                                                               tmp_path: Path) -> None:
    extra = {"objective.name": "clm_then_mlm", "objective.clm_fraction": 0.5,
             "optim.schedule": "wsd"}
    full = pretrain(load_config(None, tiny_overrides(store_dir, tmp_path / "full", **extra)))
    m = read_metrics(full)
    assert ([("clm_loss" in r, "mlm_loss" in r) for r in m]
            == [(True, False)] * 3 + [(False, True)] * 3)
    # resume from step 2 (CLM) across the switch at step 3: a real resume, bit-identical
    check_resume(store_dir, tmp_path / "resume", at=2, **extra)
    # the exported folder is a plain bidirectional encoder (+ the MLM head trained after the switch)
    folder = full / "checkpoints" / "step-0000006"
    assert not AutoModel.from_pretrained(folder).config.is_decoder
    AutoModelForMaskedLM.from_pretrained(folder)
    # PLL: a checkpoint that has trained no MLM step yet is CLM's and is refused in one line, as
    # is its export; from the first MLM step on it is scored like MLM
    ckpts = {int(f.name.split("-")[1]): f for f in (full / "checkpoints").glob("step-*")}
    assert min(ckpts) <= 3 < max(ckpts), sorted(ckpts)
    for step, folder in sorted(ckpts.items()):
        assert main(["export", str(folder), "--out", str(tmp_path / f"export-{step}")]) == 0
        for scored in (folder, tmp_path / f"export-{step}"):
            if step <= 3:
                with pytest.raises(UserError, match=r"CLM phase, the first 3 steps.*mlsm finetune"):
                    check_scored_by_pll(scored)
            else:
                check_scored_by_pll(scored)
    # same data seed -> the same batches as an MLM run
    mlm = pretrain(load_config(None, tiny_overrides(store_dir, tmp_path / "mlm")))
    assert [r["batch_digest"] for r in m] == [r["batch_digest"] for r in read_metrics(mlm)]


def test_continued_pretraining_starts_from_the_checkpoint(store_dir: Path, teacher_dir: Path,
                                                          tmp_path: Path) -> None:
    def run(out: str, **extra: object) -> tuple[Path, object]:
        overrides = tiny_overrides(store_dir, tmp_path / out, **{
            "model.init_from": str(teacher_dir), "train.readiness": "[1.0]", **extra})
        cfg = load_config(CONFIGS / "continue_mlm.yaml", overrides)
        return pretrain(cfg), cfg

    start = load_file(teacher_dir / "model.safetensors")
    # with a zero learning rate the step-1 weights are the loaded ones, bit for bit: every tensor
    # of the checkpoint was loaded (nothing re-initialised)
    frozen, _ = run("frozen", **{"train.steps": 1, "optim.lr": 0.0})
    same = load_file(frozen / "checkpoints" / "step-0000001" / "model.safetensors")
    assert same.keys() == start.keys() and all(torch.equal(start[k], same[k]) for k in start)
    trained, cfg = run("cont", **{"train.steps": 4})
    end = load_file(trained / "checkpoints" / "step-0000004" / "model.safetensors")
    assert any(not torch.equal(start[k], end[k]) for k in start)  # and it trains
    # the first logged loss is the loaded model's loss on step 0's batch (up to dropout draws),
    # far below a fresh model's ln |V| ≈ 5.3
    store = TokenStore.open(store_dir)
    tok = store.load_tokenizer()
    student = Student(AutoModelForMaskedLM.from_pretrained(teacher_dir)).eval()
    obj = build_objective({"name": "mlm"}, Context(tok, torch.device("cpu"), 4))
    obj.attach(student)
    batch = BatchSource(store, cfg.data, tok).batch(np.arange(cfg.train.batch_size), 0)
    with torch.no_grad():
        out = forward_step(student, obj, batch)
    first = read_metrics(trained)[0]["loss"]
    assert first == pytest.approx((out.loss_sum / out.n_targets).item(), abs=0.05) and first < 4.8


@pytest.mark.parametrize("name", ["clm_then_mlm", "mae_lm", "mae_mlsm", "continue_mlm"])
def test_recipes_load_and_validate(name: str) -> None:
    cfg = load_config(CONFIGS / f"{name}.yaml")
    cls = OBJECTIVES[cfg.objective.name]
    assert isinstance(cfg.objective, cls.Config)
    assert cfg.train.steps > 0 and cfg.data.max_len <= 128
    if name == "clm_then_mlm":
        assert cfg.optim.schedule == "wsd"


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_clm_loss_equals_prefix_by_prefix_next_token_loss(impl: str, store_dir: Path) -> None:
    # independent reference: feed each prefix x_0..x_t alone (no mask needed: there is no future)
    # through the plain HF masked-LM and score its last position against x_{t+1}
    student, obj, source = _setup(store_dir)
    student.hf.set_attn_implementation(impl)
    assert student.config._attn_implementation == impl
    batch = source.batch(np.arange(2), 0)
    ids, special = batch.input_ids, batch.special_mask
    total, count, ref_logits = torch.zeros(()), 0, []
    with torch.no_grad():
        out = forward_step(student, obj, batch)
        where = next_token_targets(batch)
        mine = student.vocab_logits(
            causal_encode(student, ids, batch.attention_mask)[where])  # (N, V)
        for b in range(len(ids)):
            for t in range(ids.shape[1] - 1):
                if special[b, t + 1] or not batch.attention_mask[b, t + 1]:
                    continue
                prefix = ids[b : b + 1, : t + 1]
                logits = student.hf(input_ids=prefix,
                                    attention_mask=torch.ones_like(prefix)).logits[0, -1]
                ref_logits.append(logits)
                total += torch.nn.functional.cross_entropy(logits[None], ids[b, t + 1][None],
                                                           reduction="sum")
                count += 1
    assert int(out.n_targets) == count > 0
    # the attention really is causal (a leak of the future is small at init: compare logits tightly)
    torch.testing.assert_close(mine, torch.stack(ref_logits), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.loss_sum, total, rtol=1e-5, atol=1e-4)
