"""The linear probe: trains only the probe, loss falls, and PLL works through it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from mlsm.config import load_config
from mlsm.evaluate.pll import score_pll
from mlsm.evaluate.probe import ProbeScorer, load_scorer, run_probe
from mlsm.train.loop import pretrain

from .conftest import tiny_overrides


def _mlsm_run(store_dir: Path, teacher_dir: Path, dictionary_path: Path, out: Path) -> Path:
    cfg = load_config(None, tiny_overrides(store_dir, out, **{
        "objective.name": "mlsm", "objective.dictionary": str(dictionary_path),
        "objective.teacher": str(teacher_dir), "train.steps": 20, "train.readiness": "[1.0]"}))
    return pretrain(cfg) / "checkpoints" / "step-0000020"


def test_probe_trains_only_the_probe_and_scores(store_dir, teacher_dir, dictionary_path, tmp_path) -> None:
    mlsm_ckpt = _mlsm_run(store_dir, teacher_dir, dictionary_path, tmp_path / "mlsm")
    run = run_probe(mlsm_ckpt, steps=40, out=str(tmp_path / "probe"), overrides=["optim.lr=0.1", "optim.warmup=0", "train.log_every=1"])
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    first, last = sum(m["loss"] for m in metrics[:5]) / 5, sum(m["loss"] for m in metrics[-5:]) / 5
    assert last < 0.9 * first  # an untrained probe stays at ln |V|
    folder = run / "checkpoints" / "step-0000040"
    # the backbone and the latent head are exactly those of the MLSM checkpoint
    a, b = load_file(mlsm_ckpt / "model.safetensors"), load_file(folder / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    ha, hb = load_file(mlsm_ckpt / "heads.safetensors"), load_file(folder / "heads.safetensors")
    assert all(torch.equal(ha[k], hb[k]) for k in ha) and any(k.startswith("probe.") for k in hb)
    # readiness checkpoints: 10/25/50/100 % of the 40 probe steps
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-0000004", "step-0000010", "step-0000020", "step-0000040"]
    scorer, tok = load_scorer(folder)
    assert isinstance(scorer, ProbeScorer)
    scores = score_pll(scorer, tok, ["the cat sees a dog.", "dog a sees cat the the."])
    assert len(scores) == 2 and all(s < 0 for s in scores)


def test_mtl_checkpoint_is_scored_through_its_vocab_head(store_dir, teacher_dir, dictionary_path, tmp_path) -> None:
    """Berend (2023) Fig. 6 "MLSM+MLM": an MTL model has a trained vocabulary head, so `mlsm blimp`
    scores it like an MLM model (no probe); a pure MLSM checkpoint still asks for its probe."""
    from transformers import AutoModelForMaskedLM

    from mlsm.errors import UserError

    cfg = load_config(None, tiny_overrides(store_dir, tmp_path / "mtl", **{
        "objective.name": "mtl", "objective.dictionary": str(dictionary_path),
        "objective.teacher": str(teacher_dir), "train.steps": 2, "train.readiness": "[1.0]"}))
    folder = pretrain(cfg) / "checkpoints" / "step-0000002"
    assert (folder / "heads.json").is_file() and "latent" in json.loads((folder / "heads.json").read_text())
    scorer, tok = load_scorer(folder)
    sentences = ["the cat sees a dog.", "dog a sees cat the the."]
    reference = AutoModelForMaskedLM.from_pretrained(folder).eval()  # its exported vocabulary head
    got, want = score_pll(scorer, tok, sentences), score_pll(reference, tok, sentences)
    assert got == want and all(s < 0 for s in got)
    mlsm_ckpt = _mlsm_run(store_dir, teacher_dir, dictionary_path, tmp_path / "mlsm")
    try:
        load_scorer(mlsm_ckpt)
    except UserError as err:
        assert "train its probe first" in str(err)
    else:
        raise AssertionError("an MLSM checkpoint without a probe must be refused")
