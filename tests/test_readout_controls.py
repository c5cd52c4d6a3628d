"""Readout controls: a fresh vocabulary head fitted, by the plateau probe's recipe, on a frozen
checkpoint of any objective (an MLM one here): untied d -> |V|, and d -> k -> |V| of MLSM's rank."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModel

from mlsm.evaluate.probe.probe import ProbeScorer, load_scorer, run_probe
from mlsm.evaluate.probe.probe_fit import _FactoredCandidate, train_probe_to_plateau
from mlsm.evaluate.zeroshot.heldout import heldout_masked_tokens
from mlsm.objectives.probe import probe_input

FIT = {"max_steps": 60, "eval_every": 20, "select_steps": 20, "heldout_batches": 2,
       "batch_size": 8}


@pytest.fixture
def mlm_ckpt(teacher_dir: Path) -> Path:
    """A 30-step MLM checkpoint: the session's teacher (conftest.py), read-only."""
    return teacher_dir


def test_vocab_control_is_a_fresh_untied_head_read_from_the_hidden_state(
        mlm_ckpt: Path, tmp_path: Path) -> None:
    before = load_file(str(mlm_ckpt / "model.safetensors"))
    info = train_probe_to_plateau(mlm_ckpt, tmp_path / "vocab", head="vocab", **FIT)
    assert info["head"] == "vocab" and info["input"] == "logits"
    assert set(info["candidates"]) == {"logits"}  # one head: it reads the states as they are
    probe = Path(info["checkpoint"])
    heads = json.loads((probe / "heads.json").read_text())
    d = AutoModel.from_pretrained(mlm_ckpt).config.hidden_size
    assert heads["probe"]["features"] == "hidden" and heads["probe"]["in"] == d
    assert "latent" not in heads
    # the MLM checkpoint itself is untouched, and the head is not its tied one
    after = load_file(str(mlm_ckpt / "model.safetensors"))
    assert all(torch.equal(before[k], after[k]) for k in before)
    w = load_file(str(probe / "heads.safetensors"))
    tied = next(v for k, v in before.items() if k.endswith("word_embeddings.weight"))
    assert w["probe.weight"].shape == tied.shape and not torch.allclose(w["probe.weight"], tied)
    # the scorer is exactly probe(h) on the frozen encoder's last hidden state
    scorer, _ = load_scorer(probe)
    ids = torch.tensor([[2, 5, 7, 9, 3]])
    mask = torch.ones_like(ids)
    sel = torch.tensor([[False, True, False, True, False]])
    h = AutoModel.from_pretrained(mlm_ckpt)(input_ids=ids, attention_mask=mask).last_hidden_state
    with torch.no_grad():
        by_hand = h[sel] @ w["probe.weight"].T + w["probe.bias"]
        assert torch.allclose(scorer.logits_at(ids, mask, sel), by_hand, atol=1e-5)
    # fresh: the fit started at the unigram distribution of the same held-out targets (a head
    # initialised from the MLM's would start at the MLM's loss); the exported head scores what
    # the fit measured
    held = heldout_masked_tokens(scorer, mlm_ckpt, 2, 8)
    assert info["unigram_loss"] == pytest.approx(held["unigram_loss"], rel=1e-5)
    assert info["heldout_loss"] == pytest.approx(held["loss"], rel=1e-4)


def test_factored_control_has_mlsm_readout_shape_and_rank(
        mlm_ckpt: Path, tmp_path: Path) -> None:
    info = train_probe_to_plateau(mlm_ckpt, tmp_path / "factored", head="factored", rank=48,
                                  inputs=["logprobs", "probs"], **FIT)
    assert info["head"] == "factored" and info["width"] == 48
    assert set(info["candidates"]) == {"logprobs", "probs"}
    probe = Path(info["checkpoint"])
    heads = json.loads((probe / "heads.json").read_text())
    assert heads["latent"]["class"] == "LatentHead" and heads["latent"]["k"] == 48
    assert heads["probe"]["in"] == 48 and "features" not in heads["probe"]
    scorer, _ = load_scorer(probe)
    assert isinstance(scorer, ProbeScorer) and scorer.input == info["input"]
    # the folded standardisation and batch norm give back the held-out loss that was measured
    held = heldout_masked_tokens(scorer, mlm_ckpt, 2, 8)
    assert info["heldout_loss"] == pytest.approx(held["loss"], rel=1e-4)
    assert info["unigram_loss"] == pytest.approx(held["unigram_loss"], rel=1e-5)
    # 4 x d when no rank is given and the checkpoint has no latent head
    d = AutoModel.from_pretrained(mlm_ckpt).config.hidden_size
    small = {**FIT, "max_steps": 2, "select_steps": 1, "eval_every": 1}
    info = train_probe_to_plateau(mlm_ckpt, tmp_path / "k4d", head="factored", inputs=["logits"],
                                  **small)
    assert info["width"] == 4 * d


def test_factored_candidate_learns_a_map_a_rank_d_head_cannot() -> None:
    """Words determined by which of k > d directions a state points to: the factored head (rank k
    through its softmax) fits it, and its exported form gives the trained logits."""
    from mlsm.models.heads import LatentHead

    gen = torch.Generator().manual_seed(0)
    d, k, vocab = 4, 24, 24
    dirs = F.normalize(torch.randn(k, d, generator=gen), dim=-1)  # (k, d)

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        word = torch.randint(0, k, (n,), generator=gen)
        return 3 * dirs[word] + 0.05 * torch.randn(n, d, generator=gen), word

    unigram = torch.full((vocab,), -torch.log(torch.tensor(float(vocab))))
    torch.manual_seed(0)
    cand = _FactoredCandidate("probs", torch.nn.Linear(k, vocab), unigram, 0.2, batch(256)[0],
                              LatentHead(d, k))
    held = [batch(512)]
    for _ in range(600):
        cand.step(*batch(128))
    loss, top1 = cand.evaluate(held)
    assert top1 > 0.9
    pre, lin = LatentHead(d, k), torch.nn.Linear(k, vocab)
    ex = cand.exported()
    pre.load_state_dict(ex["latent"])
    lin.load_state_dict(ex["probe"])
    z = held[0][0]
    with torch.no_grad():
        assert torch.allclose(lin(probe_input(pre(z), "probs")), cand.logits(z), atol=1e-3)


def test_mlsm_probe_puts_a_control_beside_the_latent_probe(mlm_ckpt: Path,
                                                           tmp_path: Path) -> None:
    """`mlsm probe RUN --head vocab` writes <run>/probe-step-N-vocab; the control of an MLM run
    is scored through it when named, while the run itself keeps its own head."""
    run = Path(shutil.copytree(mlm_ckpt.parent.parent, tmp_path / "run"))  # written into
    mlm_ckpt = run / "checkpoints" / mlm_ckpt.name
    out = run_probe(mlm_ckpt, head="vocab", max_steps=20, eval_every=10, select_steps=10,
                    heldout_batches=2, batch_size=8)
    assert out.name.endswith("-vocab") and out.parent == mlm_ckpt.parent.parent
    info = json.loads((out / "probe.json").read_text())
    assert isinstance(load_scorer(info["checkpoint"])[0], ProbeScorer)
    assert not isinstance(load_scorer(mlm_ckpt)[0], ProbeScorer)  # the MLM's own head


def test_a_study_fits_the_controls_on_every_arm_and_reads_them_as_rows(
        corpus_dir: Path, tokenizer_dir: Path, teacher_dir: Path, tmp_path: Path) -> None:
    """probe.controls: each arm (MLM and MLSM) gets both controls at the BLiMP readiness point;
    the BLiMP stage scores the held-out masked tokens through each; the hypotheses read them as
    rows of task heldout:HEAD, which equal a fresh scoring through the saved control."""
    from mlsm.study.hypotheses import study_rows
    from mlsm.study.runner import run_study
    from mlsm.study.spec import load_study

    from .test_study import _raw, _tiny_tasks, _write

    _, blimp = _tiny_tasks(tmp_path)
    out = tmp_path / "study"
    raw = _raw(corpus_dir, tokenizer_dir, teacher_dir, out, readiness=[1.0],
               blimp={"data": [str(blimp)], "readiness": [1.0]},
               probe={"max_steps": 20, "eval_every": 10, "select_steps": 10, "heldout_batches": 1,
                      "batch_size": 8, "min_delta": 1e-4, "rank": 48,
                      "controls": ["vocab", "factored"]})
    run_study(load_study(_write(tmp_path, raw)), stages=["store", "dictionary", "pretrain",
                                                         "probe", "blimp"], log=lambda s: None)
    rows = {(r["model"], r["task"], r["metric"]): r for r in study_rows(out)
            if r.get("kind") == "masked"}
    for arm in ("mlm", "mlsm"):
        for head in ("vocab", "factored"):
            info = json.loads((out / "runs" / arm / f"probe-100-{head}" / "probe.json")
                              .read_text())
            assert info["head"] == head and info["width"] == (48 if head == "factored" else 32)
            scorer, _ = load_scorer(info["checkpoint"])
            ckpt = out / "runs" / arm / "checkpoints" / "step-0000008"
            held = heldout_masked_tokens(scorer, ckpt, 1, 8)
            for metric, control in (("loss", "unigram_loss"), ("top1", "unigram_top1")):
                row = rows[(f"{arm}@100%", f"heldout:{head}", metric)]
                assert row["value"] == pytest.approx(held[metric], rel=1e-6)
                assert row["control"] == pytest.approx(held[control], rel=1e-6)
        assert (f"{arm}@100%", "heldout", "top1") in rows  # its own head / probe, as before
