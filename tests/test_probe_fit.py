"""The probe trained to a held-out plateau: starts at the unigram, beats it, exports exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mlsm.evaluate.probe.probe import load_scorer
from mlsm.evaluate.probe.probe_fit import train_probe_to_plateau
from mlsm.evaluate.zeroshot.heldout import heldout_steps
from mlsm.objectives.probe import probe_input

from .helpers import last_checkpoint


def test_probe_beats_the_unigram_and_stops_at_a_plateau(mlsm_ckpt: Path, tmp_path: Path) -> None:
    info = train_probe_to_plateau(
        mlsm_ckpt,
        tmp_path / "probe",
        max_steps=300,
        eval_every=10,
        select_steps=20,
        patience=2,
        heldout_batches=2,
        batch_size=8,
    )
    # the fixture corpus is random words: little beyond the unigram is learnable, but the probe
    # starts exactly at it and keeps its best weights, so it never ends above it
    assert info["heldout_loss"] <= info["unigram_loss"]
    # early stopping keeps the best weights: the reported loss is the lowest of its curve
    curve = [p["heldout_loss"] for p in info["candidates"][info["input"]]["curve"]]
    assert info["heldout_loss"] == pytest.approx(min([info["unigram_loss"], *curve]), rel=1e-6)
    assert info["steps"] < 300  # the plateau ended it, not max_steps
    assert set(info["candidates"]) == {"probs", "logprobs", "logits"}
    saved = json.loads((tmp_path / "probe" / "probe.json").read_text())
    assert saved["input"] == info["input"] and Path(saved["checkpoint"]).is_dir()


def test_exported_probe_scores_what_was_measured(
    mlsm_ckpt: Path, tmp_path: Path, store_dir: Path
) -> None:
    """The folded (un-standardised) probe in the checkpoint gives the held-out loss the fit
    reported."""
    from mlsm.data.batches import BatchSource
    from mlsm.data.corpus import TokenStore

    info = train_probe_to_plateau(
        mlsm_ckpt,
        tmp_path / "probe",
        inputs=("logprobs",),
        max_steps=60,
        eval_every=20,
        heldout_batches=2,
        batch_size=8,
    )
    scorer, _ = load_scorer(info["checkpoint"])
    assert scorer.input == "logprobs"
    cfg = json.loads((mlsm_ckpt / "checkpoint.json").read_text())["config"]
    store = TokenStore.open(store_dir)
    tok = store.load_tokenizer()
    from mlsm.run_config import config_from_dict

    source = BatchSource(store, config_from_dict(cfg).data, tok)
    loss, n = 0.0, 0
    for step in heldout_steps(mlsm_ckpt, 8, 2):
        b = source.micro_batches(step, 8, 8, 0, 1)[0]
        with torch.no_grad():
            logits = scorer.logits_at(b.corrupted_ids, b.attention_mask, b.selected)
        y = b.input_ids[b.selected]
        loss += F.cross_entropy(logits, y, reduction="sum").item()
        n += y.numel()
    assert loss / n == pytest.approx(info["heldout_loss"], rel=1e-4)


@pytest.mark.parametrize("kind", ["probs", "logprobs", "logits"])
def test_probe_fits_a_learnable_map_from_every_input(kind: str) -> None:
    """When the latent distribution determines the word, the probe must find it from any input kind
    (the untrained-probe bug: probabilities in [0, 1] moved the logits by lr per step at most)."""
    from mlsm.evaluate.probe.probe_fit import _Candidate

    gen = torch.Generator().manual_seed(0)
    k, vocab = 32, 50
    word_of_atom = torch.randint(0, vocab, (k,), generator=gen)

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        atom = torch.randint(0, k, (n,), generator=gen)
        z = torch.randn(n, k, generator=gen) + 4 * F.one_hot(atom, k)  # (n, k): one dominant atom
        return z, word_of_atom[atom]

    unigram = torch.log(torch.bincount(word_of_atom, minlength=vocab).float() + 1e-3)
    unigram = unigram - torch.logsumexp(unigram, 0)
    cand = _Candidate(kind, torch.nn.Linear(k, vocab), unigram, 0.2, batch(256)[0])
    held = [batch(512)]
    start = cand.evaluate(held)[0]
    for _ in range(300):
        cand.step(*batch(128))
    loss, top1 = cand.evaluate(held)
    assert loss < 0.3 * start and top1 > 0.8
    # the exported (raw-input) probe gives the same logits as the standardised one
    lin = torch.nn.Linear(k, vocab)
    lin.load_state_dict(cand.exported()["probe"])
    z = held[0][0]
    assert torch.allclose(lin(probe_input(z, kind)), cand.logits(z), atol=1e-3)


def test_heldout_steps_start_after_the_last_pretraining_sample(mlsm_ckpt: Path) -> None:
    seen = 30 * 8  # the fixture run: 30 steps x 8 sequences
    for batch in (3, 8, 16):
        first = heldout_steps(mlsm_ckpt, batch, 2)[0]
        assert first * batch >= seen and (first - 1) * batch < seen


def test_probe_inputs() -> None:
    z = torch.randn(3, 5)
    assert torch.allclose(probe_input(z, "probs").sum(-1), torch.ones(3))
    assert torch.allclose(probe_input(z, "logprobs").exp(), probe_input(z, "probs"))
    assert torch.equal(probe_input(z, "logits"), z)


def test_blimp_refuses_a_probe_no_better_than_unigram(tmp_path: Path) -> None:
    from mlsm.study.runner import Study
    from mlsm.study.spec import study_from_dict
    from mlsm.study.stages import _blimp

    spec = study_from_dict({"out": str(tmp_path), "arms": {"m": {"objective": {"name": "mlsm"}}},
                            "blimp": {"data": [str(tmp_path)]}, "base": {"train": {"steps": 4}}})
    study = Study(spec, log=lambda s: None)
    probe = study.probe_dir("m", 1.0)
    probe.mkdir(parents=True)
    (probe / "probe.json").write_text(
        json.dumps(
            {
                "better_than_unigram": False,
                "heldout_loss": 10.3,
                "unigram_loss": 10.2,
                "checkpoint": str(tmp_path),
            }
        )
    )
    from mlsm.errors import UserError

    with pytest.raises(UserError, match="no better than the unigram"):
        _blimp(study, "m", 1.0)


def test_a_run_is_scored_through_its_plateau_probe(mlsm_run: Path, tmp_path: Path) -> None:
    """`mlsm probe RUN` then `mlsm blimp RUN`: load_scorer finds the plateau probe's checkpoint."""
    import shutil

    from mlsm.evaluate.probe.probe import ProbeScorer, run_probe

    run = Path(shutil.copytree(mlsm_run, tmp_path / "run"))  # the probe is written into it
    out = run_probe(last_checkpoint(run))  # default: to a plateau, into <run>/probe-step-N
    assert out.parent == run
    info = json.loads((out / "probe.json").read_text())
    scorer, _ = load_scorer(run)
    assert isinstance(scorer, ProbeScorer) and scorer.input == info["input"]


def test_probe_hint_names_the_run_blimp_scores_it_through(mlsm_ckpt: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    """`mlsm probe RUN`'s closing hint names RUN as the user typed it (as the README does), not the
    probe's deep checkpoint folder, and that model argument reaches the probe just trained."""
    import shlex
    import shutil

    from mlsm.cli import main
    from mlsm.evaluate.probe.probe import ProbeScorer

    run = Path(shutil.copytree(mlsm_ckpt.parent.parent, tmp_path / "runs" / "mine"))
    assert main(["probe", str(run), "--max-steps", "4"]) == 0
    hint = capsys.readouterr().out.strip().rpartition("score with `")[2].rstrip("`")
    argv = shlex.split(hint)
    assert argv[:3] == ["mlsm", "blimp", str(run)] and argv[3:] == ["--out", "runs/blimp-mine"]
    scorer, _ = load_scorer(argv[2])
    probe = json.loads((run / "probe-step-0000030" / "probe.json").read_text())["checkpoint"]
    assert isinstance(scorer, ProbeScorer)
    assert torch.equal(scorer.probe.weight, load_scorer(probe)[0].probe.weight)


def test_a_probe_that_gets_worse_keeps_its_best_weights(mlsm_ckpt: Path, tmp_path: Path) -> None:
    """A far too large lr makes the held-out loss rise after the start: early stopping must hand
    back the best weights seen (here the unigram start), not the last ones."""
    info = train_probe_to_plateau(mlsm_ckpt, tmp_path / "probe", inputs=("logits",), lr=500.0,
                                  max_steps=40, eval_every=10, patience=10, heldout_batches=2,
                                  batch_size=8)
    curve = [p["heldout_loss"] for p in info["candidates"]["logits"]["curve"]]
    assert max(curve) > info["unigram_loss"]  # the fit did get worse
    assert info["heldout_loss"] == pytest.approx(min([info["unigram_loss"], *curve]), rel=1e-6)


def test_probe_fit_equals_a_plain_adam_reference(mlsm_ckpt: Path, store_dir: Path,
                                                 tmp_path: Path) -> None:
    """The fit (features of the frozen student computed once per batch, fused Adam, the best
    weights' held-out scores kept from when they were measured) follows the trajectory of a plain
    re-implementation: features recomputed from the saved encoder + latent head, torch's default
    Adam, the same standardisation, start and batches; same held-out curve, same saved probe."""
    import numpy as np
    from transformers import AutoModel

    from mlsm.data.batches import BatchSource
    from mlsm.data.corpus import TokenStore
    from mlsm.models.heads import read_latent_head
    from mlsm.run_config import config_from_dict

    lr, G, every = 0.2, 8, 4
    info = train_probe_to_plateau(mlsm_ckpt, tmp_path / "probe", inputs=("probs",), lr=lr,
                                  max_steps=3 * every, eval_every=every, patience=100,
                                  min_delta=0.0, heldout_batches=2, batch_size=G)
    encoder, (latent, _) = AutoModel.from_pretrained(mlsm_ckpt).eval(), read_latent_head(mlsm_ckpt)
    cfg = config_from_dict(json.loads((mlsm_ckpt / "checkpoint.json").read_text())["config"])
    store = TokenStore.open(store_dir)
    source = BatchSource(store, cfg.data, store.load_tokenizer())

    def feats(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        b = source.micro_batches(step, G, G, 0, 1)[0]
        with torch.no_grad():
            h = encoder(input_ids=b.corrupted_ids, attention_mask=b.attention_mask)
            z = latent(h.last_hidden_state[b.selected])
        return torch.softmax(z.float(), -1), b.input_ids[b.selected]

    tok = store.load_tokenizer()
    vocab = len(tok)
    counts = np.ones(vocab)  # add-one, over the tokens of every batch the run trained on
    for step in range(cfg.train.steps):
        ids = source.micro_batches(step, cfg.train.batch_size, cfg.train.batch_size)[0].input_ids
        counts += np.bincount(ids.numpy().ravel(), minlength=vocab)[:vocab]
    counts[[tok.cls_token_id, tok.sep_token_id]] = 1.0
    x0 = feats(0)[0]
    mu, sigma = x0.mean(0), x0.std(0).clamp(min=1e-6)
    ref = torch.nn.Linear(x0.shape[1], vocab)
    with torch.no_grad():
        ref.weight.zero_()
        ref.bias.copy_(torch.from_numpy(np.log(counts / counts.sum())).float())
    scale = float(((x0 - mu) / sigma).abs().sum(-1).mean())
    opt = torch.optim.Adam(ref.parameters(), lr=lr / max(scale, 1.0))
    held = [feats(s) for s in heldout_steps(mlsm_ckpt, G, 2)]

    def exported() -> tuple[torch.Tensor, torch.Tensor]:  # the raw-input form the fit saves
        w = ref.weight.detach() / sigma
        return w.clone(), ref.bias.detach() - w @ mu

    def held_loss(w: torch.Tensor, b: torch.Tensor) -> float:
        with torch.no_grad():
            total = sum(F.cross_entropy(x @ w.T + b, y, reduction="sum") for x, y in held)
        return float(total) / sum(len(y) for _, y in held)

    states, curve = {0: exported()}, []
    for step in range(1, 3 * every + 1):
        x, y = feats(step - 1)
        F.cross_entropy(ref((x - mu) / sigma), y).backward()
        opt.step()
        opt.zero_grad()
        if step % every == 0:
            states[step] = exported()
            curve.append(held_loss(*states[step]))
    fit = [p["heldout_loss"] for p in info["candidates"]["probs"]["curve"]]
    assert fit == pytest.approx(curve, rel=1e-4)
    got, _ = load_scorer(info["checkpoint"])  # the best weights, saved
    w, b = states[info["steps"]]
    assert torch.allclose(got.probe.weight, w, rtol=1e-3, atol=1e-5)
    assert torch.allclose(got.probe.bias, b, rtol=1e-3, atol=1e-4)
    assert held_loss(w, b) == pytest.approx(info["heldout_loss"], rel=1e-4)


def test_a_probe_trained_again_is_the_one_its_run_resolves_to(mlsm_ckpt: Path,
                                                            tmp_path: Path) -> None:
    """A second plateau fit into the same probe run, whose best is an earlier step than the first
    fit's, is what `load_scorer(RUN)` scores through: the first fit's later step-N is not left
    behind as the probe run's "final" checkpoint (it was, once, by test order alone)."""
    import shutil

    from mlsm.artifacts.checkpoint import list_checkpoints
    from mlsm.evaluate.probe.probe import run_probe

    run = Path(shutil.copytree(mlsm_ckpt.parent.parent, tmp_path / "run"))
    out = run_probe(run, max_steps=60, eval_every=10, select_steps=20, patience=100, min_delta=0.0,
                    heldout_batches=2, batch_size=8)
    first = json.loads((out / "probe.json").read_text())
    assert first["steps"] > 0
    # a far too large lr only gets worse than the unigram start: the second fit's best is step 0
    again = run_probe(run, inputs=["logits"], lr=500.0, max_steps=20, eval_every=10,
                      heldout_batches=2, batch_size=8)
    record = json.loads((again / "probe.json").read_text())
    assert again == out and record["steps"] == 0
    assert [f for _, f in list_checkpoints(out)] == [Path(record["checkpoint"])]
    scorer, _ = load_scorer(run)
    assert torch.equal(scorer.probe.weight, load_scorer(record["checkpoint"])[0].probe.weight)


def test_a_probe_loop_stopped_by_a_signal_exits_with_its_status(mlsm_ckpt: Path,
                                                                tmp_path: Path) -> None:
    """`mlsm probe --steps N` trains through the pre-training loop; SIGTERM ends it after a
    checkpoint, and the command exits 143 as `mlsm pretrain` does (it exited 0, as if the probe
    were finished, and a `set -e` script went on to score an unfinished probe)."""
    import os
    import shutil
    import signal
    import subprocess
    import sys
    import time

    run = Path(shutil.copytree(mlsm_ckpt.parent.parent, tmp_path / "run"))
    out = tmp_path / "probe"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "mlsm", "probe", str(run), "--steps", "2000",
                             "--out", str(out), "train.log_every=1", "train.threads=1"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics, start = out / "metrics.jsonl", time.time()
    while not (metrics.is_file() and metrics.read_text().strip()) and proc.poll() is None \
            and time.time() - start < 120:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    text, _ = proc.communicate(timeout=300)
    assert proc.returncode == 143, text
    assert "stopped by signal SIGTERM" in text and "Traceback" not in text


def test_a_fit_killed_before_pruning_still_resolves_to_its_record(mlsm_ckpt: Path, tmp_path: Path,
                                                                  monkeypatch) -> None:
    """The window between a refit's probe.json and the pruning of the earlier fit's checkpoints
    (a kill there): the probe run, named without a suffix, resolves to the checkpoint its record
    names, not to the earlier fit's later step-N, for `load_scorer` and every reader of a run."""
    import shutil

    import mlsm.evaluate.probe.probe_fit as fit
    from mlsm.artifacts.checkpoint import list_checkpoints, resolve_checkpoint
    from mlsm.evaluate.probe.probe import run_probe

    run = Path(shutil.copytree(mlsm_ckpt.parent.parent, tmp_path / "run"))
    out = run_probe(run, max_steps=60, eval_every=10, select_steps=20, patience=100, min_delta=0.0,
                    heldout_batches=2, batch_size=8)
    monkeypatch.setattr(fit, "_drop_other_checkpoints", lambda out, saved: None)  # the kill
    run_probe(run, inputs=["logits"], lr=500.0, max_steps=20, eval_every=10, heldout_batches=2,
              batch_size=8)
    record = json.loads((out / "probe.json").read_text())
    assert len(list_checkpoints(out)) > 1  # the earlier fit's later checkpoint is still there
    assert resolve_checkpoint(out) == Path(record["checkpoint"])
    scorer, _ = load_scorer(run)
    assert torch.equal(scorer.probe.weight, load_scorer(record["checkpoint"])[0].probe.weight)
