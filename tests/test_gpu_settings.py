"""GPU settings tested on this CPU: bf16 autocast and torch.compile agree with fp32/eager within
stated tolerances and resume exactly; the teacher runs in the run's precision while the codes
are solved in fp32; fp16 gets a loss scaler (CUDA) or is refused (CPU); fused AdamW on CUDA and
CPU."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mlsm.artifacts.rundir import RunDir
from mlsm.errors import UserError
from mlsm.run_config import load_config
from mlsm.train import device as dev
from mlsm.train import loop
from mlsm.train.loop import pretrain

from .helpers import TINY_MODEL, check_resume, tiny_overrides

# bf16 keeps 8 significant bits (relative step 2^-8 = 0.4 %): over a few steps the loss of a
# bf16-autocast run stays within 2 % of the fp32 run's (measured: < 0.5 % on the fixture store).
BF16_REL = 0.02
# inductor fuses and reorders float32 arithmetic: losses agree to float32 rounding, amplified by
# a few AdamW steps (measured: < 1e-5 relative).
COMPILE_REL = 1e-4
COMPILED_ATOL = 1e-6  # weights of two compiled runs of the same steps (measured: 7e-9)


def _losses(run: Path) -> list[float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows]


def _run(store: Path, out: Path, **extra: object) -> Path:
    return pretrain(load_config(None, tiny_overrides(store, out, **extra)))


def test_bf16_agrees_with_fp32_over_several_steps(store_dir: Path, tmp_path: Path) -> None:
    fp32 = _losses(_run(store_dir, tmp_path / "fp32", **{"train.precision": "fp32"}))
    bf16 = _losses(_run(store_dir, tmp_path / "bf16", **{"train.precision": "bf16"}))
    assert len(fp32) == len(bf16) == 6
    assert bf16 != fp32  # autocast did run in bf16
    for precision in ("fp32", "bf16"):  # run.json says what each run trained in
        assert RunDir(tmp_path / precision).segment_values("precision") == [precision]
    for a, b in zip(fp32, bf16, strict=True):
        assert abs(a - b) <= BF16_REL * abs(a), (fp32, bf16)


def test_bf16_resume_is_exact(store_dir: Path, tmp_path: Path) -> None:
    check_resume(store_dir, tmp_path, at=3, **{"train.precision": "bf16"})


def test_auto_precision_is_resolved_and_recorded(store_dir: Path, tmp_path: Path) -> None:
    """`train.precision=auto` on a CPU trains in fp32: the run records the resolved precision
    (not "auto") and the device in run.json, for a study report to compare."""
    run = _run(store_dir, tmp_path / "auto", **{"train.precision": "auto", "train.steps": 2})
    marker = RunDir(run)
    assert marker.segment_values("precision") == ["fp32"]
    assert marker.segment_values("device") == ["cpu"]


def test_fp16_is_refused_on_cpu_and_scaled_on_cuda(store_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="fp16 needs CUDA"):
        _run(store_dir, tmp_path / "fp16", **{"train.precision": "fp16"})
    assert dev.needs_loss_scaling("fp16", torch.device("cuda"))
    assert not dev.needs_loss_scaling("bf16", torch.device("cuda"))
    assert not dev.needs_loss_scaling("fp32", torch.device("cuda"))


def test_loss_scaling_is_undone_before_gradients_are_averaged(store_dir: Path, tmp_path: Path,
                                                              monkeypatch) -> None:
    """The loop's fp16 path (scale, backward, unscale, average, clip, step) with a CPU scaler at
    scale 2^10 in fp32: the same grad norms and weights as the run without a scaler."""
    plain = _run(store_dir, tmp_path / "plain", **{"optim.clip": 0.0})
    monkeypatch.setattr(dev, "grad_scaler", lambda precision, device: torch.amp.GradScaler(
        "cpu", init_scale=2.0**10))
    scaled = _run(store_dir, tmp_path / "scaled", **{"optim.clip": 0.0})
    norms = [[json.loads(x)["grad_norm"] for x in (r / "metrics.jsonl").read_text().splitlines()]
             for r in (plain, scaled)]
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)
    a = load_file(plain / "checkpoints/step-0000006/model.safetensors")
    b = load_file(scaled / "checkpoints/step-0000006/model.safetensors")
    assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a)
    # the loss scale is part of the training state (an fp16 run resumes with the scale it had)
    state = torch.load(scaled / "checkpoints/step-0000006/training_state.pt", weights_only=False)
    assert state["scaler"]["scale"] == 2.0**10


def test_fused_adamw_on_cuda_and_cpu(store_dir: Path, tmp_path: Path) -> None:
    cfg = load_config(None, tiny_overrides(store_dir, tmp_path / "x"))
    module = torch.nn.Linear(4, 4)
    for device in ("cuda", "cpu"):
        assert loop._optimizer(module, cfg, torch.device(device)).defaults["fused"] is True
    assert not loop._optimizer(module, cfg, torch.device("meta")).defaults.get("fused")
    # and it is what the CPU steps with: the fused op runs, the per-tensor loop does not
    module.weight.grad = torch.ones_like(module.weight)
    opt = loop._optimizer(module, cfg, torch.device("cpu"))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
    assert any(e.name == "aten::_fused_adamw_" for e in prof.events())


def test_batches_reach_cuda_from_pinned_memory(store_dir: Path) -> None:
    import numpy as np

    from mlsm.config import DataConfig
    from mlsm.data.batches import BatchSource
    from mlsm.data.corpus import TokenStore

    st = TokenStore.open(store_dir)
    tok = st.load_tokenizer()
    batch = BatchSource(st, DataConfig(store=str(store_dir), max_len=32), tok).batch(
        np.arange(4), 0)
    assert dev.to_device(batch, torch.device("cpu")).input_ids is batch.input_ids  # CPU: as is
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the pinned path is only checked on a GPU")
    moved = dev.to_device(batch, torch.device("cuda"))
    assert moved.input_ids.is_cuda and torch.equal(moved.input_ids.cpu(), batch.input_ids)


def test_mlsm_teacher_runs_in_bf16_and_codes_are_solved_in_fp32(
        store_dir: Path, teacher_dir: Path, dictionary_path: Path, tmp_path: Path,
        monkeypatch) -> None:
    import mlsm.objectives.mlsm as mlsm_objective
    from mlsm.teacher.teacher import Teacher

    seen: dict[str, list] = {"teacher": [], "solver": []}
    forward, encode = Teacher.hidden_states, mlsm_objective.sparse_encode

    def teacher_states(self, *args, **kw):
        seen["teacher"].append(torch.is_autocast_enabled("cpu"))
        return forward(self, *args, **kw)

    def solver(x, atoms, *args, **kw):
        seen["solver"].append((x.dtype, atoms.dtype, torch.is_autocast_enabled("cpu")))
        return encode(x, atoms, *args, **kw)

    monkeypatch.setattr(Teacher, "hidden_states", teacher_states)
    monkeypatch.setattr(mlsm_objective, "sparse_encode", solver)
    _run(store_dir, tmp_path / "run", **{
        "objective.name": "mlsm", "objective.dictionary": str(dictionary_path),
        "objective.teacher": str(teacher_dir), "train.steps": 2, "train.precision": "bf16"})
    assert seen["teacher"] == [True, True]  # the teacher's forward ran under bf16 autocast
    # fp32 inputs, and no autocast inside the solver (its own matmuls stay fp32)
    assert seen["solver"] == [(torch.float32, torch.float32, False)] * 2


@pytest.mark.slow  # inductor compiles for ~2 minutes on 2 busy cores with a cold cache
def test_compiled_student_agrees_with_eager_and_resumes(store_dir: Path, tmp_path: Path) -> None:
    """3 steps compiled vs eager (losses within COMPILE_REL); a compiled run resumed from its
    step-2 checkpoint ends where the uninterrupted compiled run ends; checkpoints keep the eager
    keys. Compiled CPU runs are not bitwise reproducible (inductor's parallel reductions differ
    in the last bit: 7e-9 between two identical runs), so "the same" is within COMPILED_ATOL."""
    # no dropout: inductor draws its dropout masks from another random stream than eager
    plain = {**TINY_MODEL, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    steps = {"train.steps": 3, "train.save_every": 1, "train.keep_last": 3,
             "model.overrides": "{" + ", ".join(f"{k}: {v}" for k, v in plain.items()) + "}"}
    eager = _run(store_dir, tmp_path / "eager", **steps)
    t0 = time.perf_counter()
    full = _run(store_dir, tmp_path / "full", **steps, **{"train.compile": "true"})
    print(f"compiled run: {time.perf_counter() - t0:.0f} s")
    part = tmp_path / "part"
    shutil.copytree(full, part)
    shutil.rmtree(part / "checkpoints/step-0000003")
    pretrain(load_config(None, tiny_overrides(store_dir, part, **steps,
                                              **{"train.compile": "true"})),
             resume=str(part / "checkpoints/step-0000002"))
    a, b, c = _losses(eager), _losses(full), _losses(part)
    assert all(abs(x - y) <= COMPILE_REL * abs(x) for x, y in zip(a, b, strict=True)), (a, b)
    assert b == pytest.approx(c, rel=1e-6) and len(c) == 3, (b, c)
    weights = [load_file(r / "checkpoints/step-0000003/model.safetensors")
               for r in (eager, full, part)]
    assert set(weights[0]) == set(weights[1])  # compiled checkpoints keep the eager keys
    assert all(torch.allclose(weights[1][k], weights[2][k], rtol=0, atol=COMPILED_ATOL)
               for k in weights[1])
    # the resumed run started from the checkpoint: its step-2 weights were not trained again
    assert all(torch.equal(x, y) for x, y in zip(
        load_file(full / "checkpoints/step-0000002/model.safetensors").values(),
        load_file(part / "checkpoints/step-0000002/model.safetensors").values(), strict=True))


def test_compile_wraps_the_student_in_place() -> None:
    from transformers import BertConfig, BertForMaskedLM

    from mlsm.models.backbone import Student

    hf = BertForMaskedLM(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                    num_attention_heads=2, intermediate_size=32))
    module = torch.nn.Module()
    module.student = Student(hf)
    before = set(module.state_dict())
    dev.compile_student(module)
    assert module.student._compiled_call_impl is not None
    assert set(module.state_dict()) == before
