"""Readouts: the unigram control, tests across phenomena, linear probes, PPPL, `mlsm readout`."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import wilcoxon

from mlsm.data.corpus import TokenStore
from mlsm.evaluate.zeroshot.blimp import evaluate_blimp, phenomenon_tests
from mlsm.evaluate.zeroshot.unigram import UnigramControl, pair_credit
from tests.helpers import make_text

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_unigram_scores_are_the_add_one_count_formula(store_dir) -> None:
    """Sentence score = sum over its tokens of log (c(w) + 1) / (N + V), counted directly."""
    store = TokenStore.open(store_dir)
    tok = store.load_tokenizer()
    counts = Counter(int(t) for t in np.asarray(store.tokens))
    n, v = sum(counts.values()), len(tok)
    control = UnigramControl.from_store(store_dir)
    texts = ["the cat sat on the mat", "a dog", ""]
    for text, score in zip(texts, control.score(texts), strict=True):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        expected = sum(math.log((counts.get(i, 0) + 1) / (n + v)) for i in ids)
        assert score == pytest.approx(expected, rel=1e-9, abs=1e-9)
    assert control.n_tokens == n


def test_pair_credit_counts_a_tie_half() -> None:
    assert [pair_credit(2.0, 1.0), pair_credit(1.0, 1.0), pair_credit(0.0, 1.0)] == [1, 0.5, 0]


def _write_pairs(folder: Path, pairs: dict[str, list[tuple[str, str]]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for uid, rows in pairs.items():
        (folder / f"{uid}.jsonl").write_text("".join(
            json.dumps({"sentence_good": g, "sentence_bad": b, "UID": uid, "field": "syntax",
                        "pairID": str(i)}) + "\n" for i, (g, b) in enumerate(rows)))
    return folder


def test_blimp_control_scores_the_same_pairs_and_ties_word_order(store_dir, tmp_path) -> None:
    """The control's per-phenomenon accuracy is the one its scores give pair by pair; on
    word-order pairs (same tokens) it ties every pair, hence exactly 50 %. A masked LM that
    predicts the unigram at every position scores by PLL exactly what the control scores."""
    control = UnigramControl.from_store(store_dir)
    logits = torch.from_numpy(control.log_probs).float()  # (V,)

    class UnigramScorer:
        def logits_at(self, input_ids, attention_mask, select):
            return logits.expand(int(select.sum()), -1)  # (N, V)

    words = " ".join(make_text(3, seed=5)).split()[:60]
    # long sentences reversed / rotated: a float sum in token order differs in the last bits
    order = [("the cat sat", "sat the cat"), ("a b c d", "d c b a")] + [
        (" ".join(words[i:i + 30]), " ".join(words[i:i + 30][::-1])) for i in range(0, 30, 3)]
    pairs = {"order": order,
             "lexical": [("the cat", "the zyzzyva"), ("the zyzzyva", "the cat"), ("a", "b")]}
    folder = _write_pairs(tmp_path / "pairs", pairs)
    r = evaluate_blimp(UnigramScorer(), control.tokenizer, folder, control=control)
    assert r["phenomena"]["order"]["control_accuracy"] == 0.5
    for uid, rows in pairs.items():
        g = control.score([p[0] for p in rows])
        b = control.score([p[1] for p in rows])
        expected = np.mean([pair_credit(x, y) for x, y in zip(g, b, strict=True)])
        assert r["phenomena"][uid]["control_accuracy"] == pytest.approx(expected)
    assert r["control"]["overall"] == pytest.approx(np.mean(
        [r["phenomena"][u]["control_accuracy"] for u in pairs]))
    assert r["tests"]["n_paired"] == 2
    assert {u: p["accuracy"] for u, p in r["phenomena"].items()} == {
        u: p["control_accuracy"] for u, p in r["phenomena"].items()}
    assert r["tests"]["p_vs_control"] == 1.0


def test_phenomenon_tests_are_scipys_wilcoxon_by_phenomenon() -> None:
    rng = np.random.default_rng(0)
    model = {f"p{i}": float(rng.uniform(0.4, 0.8)) for i in range(20)}
    control = {f"p{i}": float(rng.uniform(0.4, 0.7)) for i in range(20)}
    t = phenomenon_tests(model, control)
    x = np.array([model[k] for k in sorted(model)])
    y = np.array([control[k] for k in sorted(model)])
    assert t["p_vs_control"] == pytest.approx(wilcoxon(x - y).pvalue)
    assert t["p_above_control"] == pytest.approx(wilcoxon(x - y, alternative="greater").pvalue)
    assert t["p_vs_chance"] == pytest.approx(wilcoxon(x - 0.5).pvalue)
    assert t["p_above_chance"] == pytest.approx(wilcoxon(x - 0.5, alternative="greater").pvalue)
    assert t["wins_vs_control"] == int(np.sum(x > y))
    assert t["r_vs_control"] == pytest.approx(np.corrcoef(x, y)[0, 1])
    assert t["above_chance"] == int(np.sum(x > 0.5)) and t["n_phenomena"] == 20


def _tiny_encoder(tok, seed: int = 0):
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    return BertModel(BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2,
                                num_attention_heads=2, intermediate_size=64)).eval()


def test_encode_is_the_unbatched_mean_over_kept_tokens(store_dir) -> None:
    """Sorting, packing and padding do not change a sentence's features."""
    from mlsm.evaluate.zeroshot.linear_probes import encode

    tok = TokenStore.open(store_dir).load_tokenizer()
    model = _tiny_encoder(tok)
    texts = ["a", "the cat sat on the mat today", "dogs bark", "the cat sat on the mat today"]
    got = encode(model, tok, texts, token_budget=20)  # several passes of mixed lengths
    for text, row in zip(texts, got, strict=True):
        ids = torch.tensor([tok(text)["input_ids"]])
        with torch.no_grad():
            want = model(input_ids=ids).last_hidden_state[0].mean(0)  # (d,)
        assert row == pytest.approx(want.numpy(), abs=1e-5)


def _glue(folder: Path) -> Path:
    """A tiny SST-2 (label 1 iff the sentence has 'cat') and STS-B (score = shared words)."""
    rng = np.random.default_rng(0)
    words = ["the", "a", "dog", "sat", "ran", "mat", "big", "small", "red", "old"]

    def sentence(cat: bool) -> str:
        w = list(rng.choice(words, 5))
        if cat:
            w[int(rng.integers(5))] = "cat"
        return " ".join(w)

    for split, n in (("train", 200), ("dev", 60)):
        labels = [int(i % 3 == 0) for i in range(n)]  # majority label 0
        (folder / "SST-2").mkdir(parents=True, exist_ok=True)
        (folder / "SST-2" / f"{split}.tsv").write_text("sentence\tlabel\n" + "".join(
            f"{sentence(bool(y))}\t{y}\n" for y in labels))
        rows = []
        for i in range(n):
            a, b = sentence(False).split(), sentence(False).split()
            k = i % 5
            b[:k] = a[:k]
            rows.append(f"{i}\tg\tf\ty\t{i}\ts\ts\t{' '.join(a)}\t{' '.join(b)}\t{k:.1f}\n")
        (folder / "STS-B").mkdir(parents=True, exist_ok=True)
        (folder / "STS-B" / f"{split}.tsv").write_text(
            "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2"
            "\tscore\n" + "".join(rows))
    return folder


def test_linear_probes_learn_beat_their_control_and_repeat_exactly(store_dir, tmp_path) -> None:
    from mlsm.evaluate.finetune.tasks import load_task
    from mlsm.evaluate.zeroshot.linear_probes import available_tasks, probe_task

    glue = _glue(tmp_path / "glue")
    assert available_tasks(glue, ["sst2", "stsb", "cola"]) == ["sst2", "stsb"]
    tok = TokenStore.open(store_dir).load_tokenizer()
    model = _tiny_encoder(tok)
    sst = probe_task(model, tok, "sst2", glue)
    dev = [e.label for e in load_task("sst2", "dev", glue)]
    assert sst[0]["control"] == pytest.approx(dev.count(0) / len(dev))  # majority label 0
    assert sst[0]["value"] > sst[0]["control"] + 0.2
    assert sst[0]["n_train"] == 200 and sst[0]["n"] == 60
    sts = {r["metric"]: r for r in probe_task(model, tok, "stsb", glue)}
    assert sts["pearson"]["value"] > 0.3 and sts["pearson"]["control"] == 0.0
    again = probe_task(model, tok, "sst2", glue)
    assert [r["value"] for r in again] == [r["value"] for r in sst]  # no seed, same rows
    capped = probe_task(model, tok, "sst2", glue, max_train=50)
    assert capped[0]["n_train"] == 50


def test_pppl_is_each_token_masked_in_turn(teacher_dir) -> None:
    """PPPL against a brute-force loop (one full forward per masked token) on the same tokens;
    the unigram's perplexity is exp of its mean negative log-probability on them."""
    from transformers import AutoModelForMaskedLM

    from mlsm.evaluate.zeroshot.heldout import heldout_source, pppl
    from mlsm.evaluate.zeroshot.unigram import UnigramControl

    model = AutoModelForMaskedLM.from_pretrained(teacher_dir).eval()
    source, steps, train = heldout_source(teacher_dir, 1, 2)
    control = UnigramControl.from_store(train.path)
    unigram = torch.from_numpy(control.log_probs).float()
    got = pppl(model, source, steps, 2, unigram, source.mask_id,
               copies_per_pass=7)
    b = source.micro_batches(steps[0], 2, 2, 0, 1)[0]
    logp, uni = [], []
    for r in range(b.input_ids.shape[0]):
        for c in range(b.input_ids.shape[1]):
            if b.special_mask[r, c] or not b.attention_mask[r, c]:
                continue
            ids = b.input_ids[r:r + 1].clone()
            ids[0, c] = source.mask_id
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=b.attention_mask[r:r + 1]).logits
            logp.append(torch.log_softmax(logits[0, c], -1)[b.input_ids[r, c]].item())
            uni.append(control.log_probs[int(b.input_ids[r, c])])
    assert got["n"] == len(logp) > 0
    assert got["pppl"] == pytest.approx(math.exp(-np.mean(logp)), rel=1e-4)
    assert got["unigram_ppl"] == pytest.approx(math.exp(-np.mean(uni)), rel=1e-4)


def test_mlsm_readout_verb_writes_every_kind(teacher_dir, store_dir, tmp_path) -> None:
    from mlsm.cli import main

    glue = _glue(tmp_path / "data" / "glue")
    _write_pairs(tmp_path / "data" / "blimp", {"order": [("the cat sat", "sat the cat")],
                                              "other": [("the dog", "the zyzzyva")]})
    out = tmp_path / "out"
    assert main(["readout", str(teacher_dir), "--data", str(glue.parent), "--out", str(out),
                 "--tasks", "sst2", "--masked-batches", "2", "--name", "tiny"]) == 0
    rows = [json.loads(x) for x in (out / "readouts.jsonl").read_text().splitlines()]
    assert {r["kind"] for r in rows} == {"probe", "pairs", "masked"}
    assert all(r["model"] == "tiny" and r["step"] == 30 for r in rows)
    assert all(r["train_flops"] and r["train_flops"] > 0 for r in rows)
    pairs = [r for r in rows if r["kind"] == "pairs" and "phenomenon" not in r]
    assert len(pairs) == 1 and pairs[0]["n"] == 2 and "p_vs_control" in pairs[0]
    by_phen = {r["phenomenon"]: r for r in rows if "phenomenon" in r}
    assert by_phen["order"]["control"] == 0.5
    masked = {r["metric"]: r for r in rows if r["kind"] == "masked"}
    assert set(masked) == {"loss", "top1", "pppl"}
    assert masked["loss"]["n"] > 0 and masked["loss"]["control"] > 0
    assert (out / "readouts_steps.png").is_file() and (out / "readouts_flops.png").is_file()


def test_mlsm_blimp_scores_the_unigram_control_of_the_tokens_the_run_consumed(
        teacher_dir, store_dir, tmp_path) -> None:
    from mlsm.cli import main

    pairs = _write_pairs(tmp_path / "pairs", {"order": [("the cat sat", "sat the cat")],
                                              "other": [("the dog", "the zyzzyva")]})
    assert main(["blimp", str(teacher_dir), "--data", str(pairs), "--out",
                 str(tmp_path / "auto")]) == 0
    result = json.loads((tmp_path / "auto" / "blimp.json").read_text())
    # by default the tokens the run consumed: its steps x batch sequences of its own store
    cfg = json.loads((teacher_dir / "checkpoint.json").read_text())["config"]["train"]
    assert result["control"]["source"].startswith(
        f"{cfg['steps'] * cfg['batch_size']:,} pre-training sequences of {store_dir} ")
    assert result["phenomena"]["order"]["control_accuracy"] == 0.5
    assert "unigram control" in (tmp_path / "auto" / "blimp.md").read_text()
    assert main(["blimp", str(teacher_dir), "--data", str(pairs), "--unigram", "none",
                 "--out", str(tmp_path / "none")]) == 0
    result = json.loads((tmp_path / "none" / "blimp.json").read_text())
    assert "control" not in result and "p_vs_control" not in result["tests"]


def test_a_missing_glue_folder_is_one_line(teacher_dir, tmp_path) -> None:
    from mlsm.errors import UserError
    from mlsm.evaluate.readouts import ReadoutSpec, readout

    with pytest.raises(UserError, match="GLUE folder .* not found"):
        readout(teacher_dir, ReadoutSpec(kinds=["probe"], glue=str(tmp_path / "nope")))
