"""What mlsm needs to know about an objective is declared on its class (`uses_teacher`,
`predicts_latent`, `latent_head`, `scored_by_pll` / `pll_refusal_at`, `flops_row`), checked here
against what each objective does when it is built on a tiny model, and no module keeps its own
list of objective names."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from mlsm.config import DataConfig, ModelConfig
from mlsm.data.batches import BatchSource
from mlsm.data.corpus import TokenStore
from mlsm.errors import UserError
from mlsm.models.backbone import build_student
from mlsm.models.heads import LatentHead
from mlsm.objectives import INTERNAL, OBJECTIVES, Context, Objective, build_objective
from mlsm.objectives.base import forward_step
from mlsm.run_config import load_config

from .helpers import TINY_MODEL, tiny_overrides

SRC = Path(__file__).resolve().parents[1] / "src" / "mlsm"
REGISTERED = {**OBJECTIVES, **INTERNAL}
TEACHERLESS = {"mlm", "clm", "clm_then_mlm", "mae_lm"}  # build from their name alone


def _literal_name_lists(path: Path) -> list[tuple[int, list[str]]]:
    """(line, names) of every tuple/list/set literal or dict's keys naming >= 2 registered
    objectives. A dict whose values are all dict literals is configuration (e.g. study arms named
    after their objective), not a list of objectives."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            items = node.elts
        elif isinstance(node, ast.Dict) and not all(isinstance(v, ast.Dict) for v in node.values):
            items = [k for k in node.keys if k is not None]
        else:
            continue
        names = [i.value for i in items if isinstance(i, ast.Constant) and i.value in REGISTERED]
        if len(names) >= 2:
            found.append((node.lineno, names))
    return found


def test_no_module_keeps_a_list_of_objective_names() -> None:
    registry = SRC / "objectives" / "__init__.py"
    found = {str(p.relative_to(SRC)): hits for p in sorted(SRC.rglob("*.py"))
             if p != registry and (hits := _literal_name_lists(p))}
    assert found == {}, "declare it on the objective classes (objectives/base.py) instead"
    assert len(_literal_name_lists(registry)) == 2  # the check sees the registry's own dicts


def _spec(name: str, teacher: str, dictionary: Path, folder: Path) -> dict:
    if name in TEACHERLESS:
        return {"name": name}
    if name == "kd":
        return {"name": name, "teacher": teacher}
    if name == "probe":
        return {"name": name, "checkpoint": str(_latent_checkpoint(folder))}
    if "dictionary" not in {f.name for f in dataclasses.fields(REGISTERED[name].Config)}:
        return {"name": name, "teacher": teacher, "layer": 1}  # a dense teacher target
    return {"name": name, "teacher": teacher, "dictionary": str(dictionary)}


def _latent_k(spec: dict) -> int:
    """The k of the latent head an objective of `spec` trains: the dictionary's 64 atoms, or the
    tiny teacher's hidden size when its target is the teacher's state itself (a teacher layer and
    no dictionary)."""
    dense = "layer" in spec and "dictionary" not in spec
    return TINY_MODEL["hidden_size"] if dense else 64


def _latent_checkpoint(folder: Path) -> Path:
    """The heads of an MLSM checkpoint (all a probe reads of it), written as mlsm writes them."""
    folder.mkdir(parents=True, exist_ok=True)
    head = LatentHead(TINY_MODEL["hidden_size"], 64)
    save_file({f"latent.{k}": v for k, v in head.state_dict().items()},
              folder / "heads.safetensors")
    entry = {"class": "LatentHead", "d": TINY_MODEL["hidden_size"], "k": 64}
    (folder / "heads.json").write_text(json.dumps({"latent": entry}))
    return folder


def _context(store_dir: Path) -> Context:
    tok = TokenStore.open(store_dir).load_tokenizer()
    return Context(tok, torch.device("cpu"), 10, str(store_dir), 32)


def _built(spec: dict, store_dir: Path) -> Objective:
    ctx = _context(store_dir)
    obj = build_objective(spec, ctx)
    obj.attach(build_student(ModelConfig(overrides=dict(TINY_MODEL)), ctx.tokenizer, 32, 0))
    return obj


@pytest.mark.parametrize("name", sorted(REGISTERED))
def test_declarations_match_what_the_objective_does(
    name: str, store_dir: Path, teacher_dir: Path, dictionary_path: Path, tmp_path: Path
) -> None:
    cls = REGISTERED[name]
    spec = _spec(name, str(teacher_dir), dictionary_path, tmp_path / "mlsm-ckpt")
    # uses_teacher: the objective has a teacher option (export reads it) and really loads it
    options = {f.name for f in dataclasses.fields(cls.Config)}
    assert cls.uses_teacher == ("teacher" in options), name
    if cls.uses_teacher:
        missing = str(tmp_path / "no-such-teacher")
        with pytest.raises(UserError, match="no-such-teacher"):
            build_objective({**spec, "teacher": missing}, _context(store_dir))
    # predicts_latent: a head it trains outputs the k latent properties (dictionary or teacher)
    obj = _built(spec, store_dir)
    trained = {n for n, h in obj.exported_heads().items()
               if any(p.requires_grad for p in h.parameters())}
    latent = [n for n in trained if obj.head_meta().get(n, {}).get("k") == _latent_k(spec)]
    assert cls.predicts_latent == bool(latent), (name, obj.head_meta())
    # latent_head: the head the probe reads (by this name) is one that predicts them
    assert not cls.predicts_latent or cls.latent_head in latent, (name, cls.latent_head, latent)
    # flops_row: a row of `mlsm flops`'s table for this run, or none
    from mlsm.train.flops import flops_for_run
    from mlsm.train.throughput import flops_row_of

    overrides = {"objective.name": name} if name in TEACHERLESS else {
        f"objective.{k}": v for k, v in spec.items() if k != "checkpoint"}
    cfg = load_config(None, tiny_overrides(store_dir, tmp_path / "r", **overrides))
    rows = flops_for_run(cfg, teacher=str(teacher_dir), k=64)
    row = flops_row_of(rows, name)
    assert (row is None) == (cls.flops_row is None), name
    assert row is None or row.total > 0



def _heads_fed_by_heads(name: str, spec: dict, store_dir: Path) -> list[str]:
    """The exported heads that, in one training step, read an input computed by another trained
    head of the objective (a decoder between the encoder and the head), found through autograd:
    the input's gradient reaches that other head's parameters."""
    ctx = _context(store_dir)
    student = build_student(ModelConfig(overrides=dict(TINY_MODEL)), ctx.tokenizer, 32, 0)
    obj = build_objective(spec, ctx)
    obj.attach(student)
    heads = obj.exported_heads()
    seen: list[tuple[str, torch.Tensor]] = []
    for head, module in heads.items():
        module.register_forward_pre_hook(
            lambda m, args, kw, n=head: seen.extend(
                (n, x) for x in [*args, *kw.values()]
                if isinstance(x, torch.Tensor) and x.requires_grad), with_kwargs=True)
    batch = BatchSource(TokenStore.open(store_dir), DataConfig(store=str(store_dir), max_len=32),
                        ctx.tokenizer).batch(np.arange(4), 0)
    forward_step(student, obj, batch)
    fed = []
    for head, x in seen:
        others = [p for n, m in heads.items() if n != head for p in m.parameters()
                  if p.requires_grad]
        grads = torch.autograd.grad(x.float().sum(), others, retain_graph=True,
                                    allow_unused=True) if others else []
        if any(g is not None for g in grads):
            fed.append(head)
    return sorted(set(fed))


def _encoder_sees_later_tokens(spec: dict, store_dir: Path, steps: list[int]) -> list[bool]:
    """Per optimizer step (0-based): whether, in the objective's training forward at that step,
    the encoder state at position 0 depends on the input at later positions (autograd through the
    objective's own student inputs, e.g. CLM's causal mask). The student is made trainable for
    the check, so frozen-student objectives (the probe) are measured too."""
    ctx = _context(store_dir)
    student = build_student(ModelConfig(overrides=dict(TINY_MODEL)), ctx.tokenizer, 32, 0)
    obj = build_objective(spec, ctx)
    obj.attach(student)
    student.requires_grad_(True)
    source = BatchSource(TokenStore.open(store_dir), DataConfig(store=str(store_dir), max_len=32),
                         ctx.tokenizer)
    grabbed: list[torch.Tensor] = []
    hook = student.backbone.get_input_embeddings().register_forward_hook(
        lambda m, args, out: grabbed.append(out))
    sees = []
    for step in steps:
        batch = source.batch(np.arange(4), step)
        with torch.no_grad():
            targets = obj.targets(batch)
        hidden = student(**obj.student_inputs(student, batch, targets))  # (B, T', d)
        # a random read-out: a plain sum of a LayerNorm-ed state is ~constant, its gradient ~0
        readout = torch.randn(hidden.shape[-1], generator=torch.Generator().manual_seed(step))
        (grad,) = torch.autograd.grad((hidden[:, 0] @ readout).sum(), grabbed[-1])  # (B, T, d)
        sees.append(bool(grad[:, 1:].abs().amax() > 0))  # a causal mask gives exact zeros
    hook.remove()
    return sees


@pytest.mark.parametrize("name", sorted(REGISTERED))
def test_pll_refusal_iff_a_head_reads_a_decoder_or_the_encoder_trains_causally(
    name: str, store_dir: Path, teacher_dir: Path, dictionary_path: Path, tmp_path: Path
) -> None:
    """scored_by_pll / pll_refusal_at: PLL masks token t and reads the encoder's state at t, with
    the whole sentence visible, through the trained heads. A checkpoint cannot be scored that way
    when a word/latent head reads another trained head's output (MAE's decoder, Meng et al.
    2024), or when the steps that wrote it trained the encoder under a causal mask (CLM, and
    CLM -> MLM before its switch): the declaration for the checkpoint written after each step
    must say so, and the class-level flag is the answer for the final checkpoint."""
    spec = _spec(name, str(teacher_dir), dictionary_path, tmp_path / "mlsm-ckpt")
    fed = _heads_fed_by_heads(name, spec, store_dir)
    total = _context(store_dir).total_steps
    steps = list(range(total))
    sees = _encoder_sees_later_tokens(spec, store_dir, steps)
    cls = REGISTERED[name]
    for step, bidirectional in zip(steps, sees, strict=True):
        # the checkpoint written by `step` is what its latest step trained (CLM -> MLM: scored
        # from its first MLM step on)
        refused = cls.pll_refusal_at(spec, step + 1, total)
        assert bool(refused) == (bool(fed) or not bidirectional), (name, step, fed, sees)
        assert not refused or len(refused) > 20, refused  # a reason, not a flag
    assert cls.scored_by_pll == (cls.pll_refusal_at(spec, total, total) is None), name


def test_every_objective_row_of_the_flops_table_is_declared_by_one_objective(
    store_dir: Path, teacher_dir: Path, dictionary_path: Path, tmp_path: Path
) -> None:
    from mlsm.train.flops import flops_for_run

    overrides = {"objective.name": "mlsm", "objective.teacher": str(teacher_dir),
                 "objective.dictionary": str(dictionary_path)}
    cfg = load_config(None, tiny_overrides(store_dir, tmp_path / "r", **overrides))
    labels = [r.objective.split(" (")[0] for r in flops_for_run(cfg, k=64)]
    labels = [label if label != "MLSM" else "MLSM (naive)" for label in labels]
    # MLSM_L is `mlsm` with its teacher layer at the top (no early exit): a setting of `mlsm`
    declared = sorted(c.flops_row for c in REGISTERED.values() if c.flops_row)
    assert sorted(set(labels) - {"MLSM_L"}) == declared
