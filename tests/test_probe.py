"""The linear probe: trains only the probe, loss falls, and PLL works through it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from mlsm.config import DataConfig, ModelConfig
from mlsm.data.batches import BatchSource
from mlsm.data.corpus import TokenStore
from mlsm.evaluate.probe.probe import ProbeScorer, load_scorer, run_probe
from mlsm.evaluate.zeroshot.pll import score_pll
from mlsm.models.backbone import build_student
from mlsm.objectives import Context, TrainModule
from mlsm.objectives.probe import Probe, ProbeConfig
from mlsm.run_config import load_config
from mlsm.train.loop import pretrain

from .helpers import TINY_MODEL, tiny_overrides


def test_probe_trains_only_the_probe_and_scores(store_dir, mlsm_ckpt, tmp_path) -> None:
    run = run_probe(mlsm_ckpt, steps=40, out=str(tmp_path / "probe"),
                    overrides=["optim.lr=0.1", "optim.warmup=0", "train.log_every=1"])
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
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step-0000004", "step-0000010", "step-0000020", "step-0000040"]
    scorer, tok = load_scorer(folder)
    assert isinstance(scorer, ProbeScorer)
    sentences = ["the cat sees a dog.", "dog a sees cat the the."]
    scores = score_pll(scorer, tok, sentences)
    assert len(scores) == 2 and all(s < 0 for s in scores)
    # the scorer computes what the probe was trained on: student + latent head + probe
    student = _student_with_probe(folder, store_dir)
    source = BatchSource(TokenStore.open(store_dir), DataConfig(store=str(store_dir), max_len=32),
                         tok)
    batch = source.batch(np.arange(8), 0)
    with torch.no_grad():
        mine = scorer.logits_at(batch.corrupted_ids, batch.attention_mask, batch.selected)
        ref = _probe_logits(student, batch.corrupted_ids, batch.attention_mask, batch.selected)
    torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-5)
    # and PLL through the probe equals a brute-force loop: one masked copy per token
    for sentence, score in zip(sentences, scores, strict=True):
        ids = tok(sentence)["input_ids"]
        brute = 0.0
        for t in range(1, len(ids) - 1):
            copy = torch.tensor([ids])
            copy[0, t] = tok.mask_token_id
            where = torch.zeros_like(copy, dtype=torch.bool)
            where[0, t] = True
            with torch.no_grad():
                logits = _probe_logits(student, copy, torch.ones_like(copy), where)[0]
            brute += torch.log_softmax(logits.double(), -1)[ids[t]].item()
        assert score == pytest.approx(brute, abs=1e-4)


def _student_with_probe(folder: Path, store_dir: Path):
    """The training-time computation: a Student from the folder, the Probe objective's heads."""
    store = TokenStore.open(store_dir)
    tok = store.load_tokenizer()
    student = build_student(ModelConfig(init_from=str(folder)), tok, 32, 0)
    probe = Probe(ProbeConfig(checkpoint=str(folder)), Context(tok, torch.device("cpu"), 1))
    probe.attach(student)
    state = load_file(folder / "heads.safetensors")
    probe.heads["probe"].load_state_dict({k.removeprefix("probe."): v for k, v in state.items()
                                          if k.startswith("probe.")})
    return TrainModule(student, probe).eval()


def _probe_logits(module, ids: torch.Tensor, mask: torch.Tensor,
                  where: torch.Tensor) -> torch.Tensor:
    heads = module.objective.heads
    hidden = module.student.encode(ids, mask)[where]  # (N, d)
    return heads["probe"](torch.softmax(heads["latent"](hidden), -1))  # (N, V)


def test_mtl_checkpoint_is_scored_through_its_vocab_head(store_dir, teacher_dir, dictionary_path,
                                                         mlsm_ckpt, tmp_path) -> None:
    """The Hitchhikers' Guide's Fig. 6 "MLSM+MLM": an MTL model has a trained vocabulary head, so
    `mlsm blimp` scores it like an MLM model (no probe); a pure MLSM checkpoint still asks for its
    probe."""
    from transformers import AutoModelForMaskedLM

    from mlsm.errors import UserError

    cfg = load_config(None, tiny_overrides(store_dir, tmp_path / "mtl", **{
        "objective.name": "mtl", "objective.dictionary": str(dictionary_path),
        "objective.teacher": str(teacher_dir), "train.steps": 2, "train.readiness": "[1.0]"}))
    folder = pretrain(cfg) / "checkpoints" / "step-0000002"
    assert ((folder / "heads.json").is_file()
            and "latent" in json.loads((folder / "heads.json").read_text()))
    scorer, tok = load_scorer(folder)
    sentences = ["the cat sees a dog.", "dog a sees cat the the."]
    reference = AutoModelForMaskedLM.from_pretrained(folder).eval()  # its exported vocabulary head
    got, want = score_pll(scorer, tok, sentences), score_pll(reference, tok, sentences)
    assert got == want and all(s < 0 for s in got)
    try:
        load_scorer(mlsm_ckpt)
    except UserError as err:
        assert "train its probe first" in str(err)
    else:
        raise AssertionError("an MLSM checkpoint without a probe must be refused")


@pytest.mark.parametrize("objective", ["mlsm", "mlsm_naive"])
def test_every_latent_objective_is_probed_and_scored_on_blimp(
    objective: str, store_dir: Path, teacher_dir: Path, dictionary_path: Path, tmp_path: Path
) -> None:
    """`mlsm probe RUN` then `mlsm blimp RUN` (through the probe) on a tiny run of each objective
    that predicts a latent distribution, the naive recipe's d -> |V| + k head included: the probe
    reads the head its objective declares (`latent_head`), and for the naive head exactly its last
    k outputs, the latent logits it was trained on; `mlsm export` ships that probe."""
    from mlsm.cli import main
    from mlsm.models.heads import LatentHead

    run = tmp_path / "run"
    cfg = load_config(None, tiny_overrides(store_dir, run, **{
        "objective.name": objective, "objective.dictionary": str(dictionary_path),
        "objective.teacher": str(teacher_dir), "train.steps": 3, "train.readiness": "[1.0]"}))
    folder = pretrain(cfg) / "checkpoints" / "step-0000003"
    assert main(["probe", str(run), "--max-steps", "6"]) == 0
    data = tmp_path / "blimp"
    data.mkdir()
    rows = [{"sentence_good": g, "sentence_bad": b, "UID": "order", "pairID": str(i),
             "field": "syntax", "linguistics_term": "order"}
            for i, (g, b) in enumerate([("the cat sees a dog.", "cat the sees dog a."),
                                        ("a big dog runs.", "dog big a runs.")])]
    (data / "order.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["blimp", str(run), "--data", str(data), "--out", str(tmp_path / "b")]) == 0
    result = json.loads(next((tmp_path / "b").glob("*.json")).read_text())
    assert result["n_pairs"] == 2 and 0 <= result["overall"] <= 1
    # what the scorer's latent head computes is the trained objective's latent logits
    scorer, _ = load_scorer(run)
    assert isinstance(scorer, ProbeScorer)
    heads = {k: v.double() for k, v in load_file(folder / "heads.safetensors").items()}
    h = torch.randn(5, TINY_MODEL["hidden_size"], dtype=torch.float64)
    if objective == "mlsm":
        ref = LatentHead(TINY_MODEL["hidden_size"], 64).double()
        ref.load_state_dict({k.removeprefix("latent."): v for k, v in heads.items()})
        want = ref(h)
    else:  # the last k = 64 of the |V| + k outputs, as MLSMNaive.loss takes them
        want = (h @ heads["naive.weight"].T + heads["naive.bias"])[:, -64:]
    got = scorer.latent.double()(h)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    # `mlsm export` finds the probe of either kind and ships it; the export scores the same way
    assert main(["export", str(run), "--out", str(tmp_path / "e")]) == 0
    assert {"latent", "probe"} <= json.loads((tmp_path / "e" / "heads.json").read_text()).keys()
    exported, _ = load_scorer(tmp_path / "e")
    torch.testing.assert_close(exported.latent.double()(h), want, rtol=0, atol=1e-12)
    assert 'read_latent_head("LOCAL_FOLDER")' in (tmp_path / "e" / "README.md").read_text()


def test_paper_probe_recipe_is_10000_steps_with_readiness_checkpoints(
        mlsm_ckpt, tmp_path, monkeypatch) -> None:
    """`mlsm probe --recipe paper`: the Hitchhikers' Guide's probe, a fixed 10,000 steps through
    the training loop with readiness checkpoints (the plateau probe stays the default)."""
    import mlsm.evaluate.probe.probe as probe_module
    import mlsm.evaluate.probe.probe_fit as fit_module
    from mlsm.evaluate.probe.probe_fit_config import PAPER_PROBE_STEPS

    seen: dict = {}
    monkeypatch.setattr(probe_module, "pretrain_run",
                        lambda cfg, resume=None: (seen.update(cfg=cfg), None))
    monkeypatch.setattr(fit_module, "train_probe_to_plateau",
                        lambda *a, **kw: seen.update(plateau=kw))
    from mlsm.cli import main

    main(["probe", str(mlsm_ckpt), "--recipe", "paper", "--out", str(tmp_path / "p")])
    assert PAPER_PROBE_STEPS == 10_000 and seen["cfg"].train.steps == 10_000
    assert seen["cfg"].train.readiness == [0.1, 0.25, 0.5, 1.0]
    assert "plateau" not in seen
    run_probe(mlsm_ckpt, out=str(tmp_path / "q"))  # the default: ours, to a plateau
    assert seen["plateau"]["max_steps"] == 2000
