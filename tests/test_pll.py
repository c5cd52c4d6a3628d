"""PLL scoring: parity with a brute-force loop (one full HF forward per masked copy)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import (
    AlbertConfig,
    AlbertForMaskedLM,
    DistilBertConfig,
    DistilBertForMaskedLM,
    RobertaConfig,
    RobertaForMaskedLM,
)

from mlsm.errors import UserError
from mlsm.evaluate.zeroshot.pll import MaskedScorer, TokenScores, as_scorer, score_pll

from .helpers import (
    SENTENCES,
    VOCAB,
    PositionalScorer,
    brute_force_pll,
    tiny_bert,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread_per_module")



@pytest.fixture(scope="module")
def bert():
    return tiny_bert()


@pytest.fixture(scope="module")
def reference(bert, tok):
    return {
        v: [sum(brute_force_pll(bert, tok, s, v)) for s in SENTENCES]
        for v in ("original", "within_word_l2r")
    }


@pytest.mark.parametrize("variant", ["original", "within_word_l2r"])
@pytest.mark.parametrize("budget,max_rows", [(8192, 512), (1, 512), (37, 3), (100, 512)])
def test_pll_equals_brute_force(bert, tok, reference, variant, budget, max_rows):
    got = score_pll(bert, tok, SENTENCES, variant=variant, token_budget=budget, max_rows=max_rows)
    want = reference[variant]
    assert len(got) == len(SENTENCES)
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, abs=1e-4)


def test_variants_differ_only_on_multi_piece_words(bert, tok):
    single = ["the cat is over the dog"]  # every word one piece: both variants mask the same
    multi = ["unbelievable"]
    a = score_pll(bert, tok, single + multi, variant="original")
    b = score_pll(bert, tok, single + multi, variant="within_word_l2r")
    assert a[0] == pytest.approx(b[0], abs=1e-6)
    assert abs(a[1] - b[1]) > 1e-6


def test_per_token_scores(bert, tok):
    rows = score_pll(bert, tok, SENTENCES[:3], variant="within_word_l2r", per_token=True)
    totals = score_pll(bert, tok, SENTENCES[:3], variant="within_word_l2r")
    for row, total, sentence in zip(rows, totals, SENTENCES[:3], strict=True):
        assert isinstance(row, TokenScores)
        assert row.sentence == sentence
        assert row.total == pytest.approx(total, abs=1e-9)
        assert row.tokens == tok.tokenize(sentence)  # special tokens are not scored
        ref = brute_force_pll(bert, tok, sentence, "within_word_l2r")
        assert row.log_probs == pytest.approx(ref, abs=1e-4)
        assert all(lp <= 0 for lp in row.log_probs)


def _other_families(vocab_size: int, pad_id: int):
    torch.manual_seed(1)
    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    roberta = RobertaForMaskedLM(
        RobertaConfig(vocab_size=vocab_size, max_position_embeddings=80, pad_token_id=pad_id,
                      **small)
    )
    distil = DistilBertForMaskedLM(
        DistilBertConfig(vocab_size=vocab_size, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                         max_position_embeddings=64, pad_token_id=pad_id)
    )
    # ALBERT has no sparse head in mlsm.models.heads: exercises the full-logits fallback.
    albert = AlbertForMaskedLM(
        AlbertConfig(vocab_size=vocab_size, embedding_size=16, max_position_embeddings=64,
                     pad_token_id=pad_id, **small)
    )
    return {"roberta": roberta, "distilbert": distil, "albert": albert}


@pytest.mark.parametrize("family", ["roberta", "distilbert", "albert"])
def test_other_hf_families(tok, family):
    model = _other_families(len(VOCAB), tok.pad_token_id)[family].eval()
    got = score_pll(model, tok, SENTENCES[:5], token_budget=40)
    want = [sum(brute_force_pll(model, tok, s, "original")) for s in SENTENCES[:5]]
    assert got == pytest.approx(want, abs=1e-4)


def test_protocol_scorer_closed_form(tok):
    scorer = PositionalScorer(len(VOCAB))
    assert isinstance(scorer, MaskedScorer) and as_scorer(scorer) is scorer
    got = score_pll(scorer, tok, SENTENCES, token_budget=30)
    logp = torch.log_softmax(scorer.table.double(), -1)
    for sentence, g in zip(SENTENCES, got, strict=True):
        ids = tok(sentence)["input_ids"]
        want = sum(logp[t, ids[t]].item() for t in range(1, len(ids) - 1))
        assert g == pytest.approx(want, abs=1e-5)


def test_protocol_scorer_sees_the_right_masks(tok):
    scorer = PositionalScorer(len(VOCAB))
    sentence = "unbelievable cats"  # un ##believ ##able cat ##s
    score_pll(scorer, tok, [sentence], variant="within_word_l2r")
    (input_ids, select), = scorer.seen
    mask = input_ids == tok.mask_token_id  # (n, T)
    targets = select.nonzero()[:, 1].tolist()
    assert targets == [1, 2, 3, 4, 5]
    # row for "un" hides the whole word; "##believ" hides itself and "##able"; "cat" hides "cat ##s"
    expected = [[1, 2, 3], [2, 3], [3], [4, 5], [5]]
    assert [row.nonzero().flatten().tolist() for row in mask] == expected


def test_long_input_is_split_and_bounded(bert, tok):
    long = " ".join(["the quick brown fox jumped over the lazy dog."] * 5)  # ~55 tokens
    scorer = as_scorer(bert)
    shapes = []

    class Spy:
        def logits_at(self, input_ids, attention_mask, select):
            shapes.append(tuple(input_ids.shape))
            return scorer.logits_at(input_ids, attention_mask, select)

    got = score_pll(Spy(), tok, [long], token_budget=200)
    assert all(b * t <= 200 for b, t in shapes) and len(shapes) > 1
    assert got[0] == pytest.approx(score_pll(bert, tok, [long])[0], abs=1e-4)


def test_duplicates_and_order(bert, tok):
    got = score_pll(bert, tok, SENTENCES)
    assert got[1] == got[-1]
    rev = score_pll(bert, tok, SENTENCES[::-1])
    assert rev[::-1] == pytest.approx(got, abs=1e-5)
    assert all(math.isfinite(x) and x < 0 for x in got)


def test_training_flag_restored(tok):
    model = tiny_bert().train()
    score_pll(model, tok, ["the cat"])
    assert model.training


def test_bad_input(bert, tok):
    with pytest.raises(UserError, match="variant"):
        score_pll(bert, tok, ["the cat"], variant="l2r")  # type: ignore[arg-type]
    with pytest.raises(UserError, match="logits_at"):
        score_pll(object(), tok, ["the cat"])
    with pytest.raises(UserError, match="split"):
        score_pll(bert, tok, [" ".join(["cat"] * 100)])
    with pytest.raises(UserError, match="sentence 1 is a int, not text"):
        score_pll(bert, tok, ["the cat", 7])  # type: ignore[list-item]
    with pytest.raises(UserError, match="sentence 0 has 7 characters, more than the limit of 6"):
        score_pll(bert, tok, ["the cat"], max_chars=6)
    assert len(score_pll(bert, tok, "the cat", max_chars=7)) == 1  # one str is one sentence


def test_load_masked_lm(bert, tok, tmp_path):
    from mlsm.evaluate.zeroshot.pll import load_masked_lm

    bert.save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    model, tokenizer = load_masked_lm(str(tmp_path / "ckpt"))
    assert not model.training
    assert score_pll(model, tokenizer, SENTENCES[:2]) == pytest.approx(
        score_pll(bert, tok, SENTENCES[:2]), abs=1e-5)
    with pytest.raises(UserError, match="missing does not exist"):
        load_masked_lm(str(tmp_path / "missing"))
