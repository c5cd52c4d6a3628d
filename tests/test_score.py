"""`mlsm score`: PLL per sentence and PPPL, checked against a brute-force loop (one full HF forward
per masked copy, the explicit mask pattern) and against the closed form of a context-free
scorer."""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import tracemalloc
from pathlib import Path

import pytest
import torch

from mlsm.errors import UserError
from mlsm.evaluate.zeroshot.pll import score_pll, score_token_ids
from mlsm.evaluate.zeroshot.score import (
    RESULT_METRIC,
    pppl,
    read_sentences,
    score_corpus,
    summary_path,
)
from tests.helpers import SENTENCES, PositionalScorer, brute_force_pll, tiny_bert

pytestmark = pytest.mark.usefixtures("one_torch_thread_per_module")


@pytest.fixture(scope="module")
def bert():
    return tiny_bert()


@pytest.fixture(scope="module")
def folder(bert, tok, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ckpt")
    bert.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def brute_force_ids(model, tokenizer, ids: list[int]) -> list[float]:
    """Reference for a store chunk: [CLS] ids [SEP], one full forward per masked position."""
    full = [tokenizer.cls_token_id, *ids, tokenizer.sep_token_id]
    out = []
    for t in range(1, len(full) - 1):
        copy = list(full)
        copy[t] = tokenizer.mask_token_id
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([copy])).logits[0, t]
        out.append(torch.log_softmax(logits.double(), -1)[full[t]].item())
    return out


UNIQUE = list(dict.fromkeys(SENTENCES))


@pytest.mark.parametrize("variant", ["original", "within_word_l2r"])
def test_token_ids_equal_brute_force(bert, tok, variant):
    enc = [tok(s, add_special_tokens=False) for s in UNIQUE]
    words = [e.word_ids() for e in enc] if variant == "within_word_l2r" else None
    got = score_token_ids(bert, tok, [e["input_ids"] for e in enc], words=words, variant=variant,
                          token_budget=37, max_rows=5)
    for sentence, terms in zip(UNIQUE, got, strict=True):
        assert terms.tolist() == pytest.approx(brute_force_pll(bert, tok, sentence, variant),
                                               abs=1e-4)


def test_corpus_pll_and_pppl_equal_brute_force(bert, tok, tmp_path):
    text = tmp_path / "s.txt"
    text.write_text("\n".join(UNIQUE[:5]) + "\n\n   \n")  # blank lines are skipped
    result = score_corpus(bert, tok, text, variant="within_word_l2r")
    refs = [brute_force_pll(bert, tok, s, "within_word_l2r") for s in UNIQUE[:5]]
    assert [r["text"] for r in result.rows] == UNIQUE[:5]
    assert [r["line"] for r in result.rows] == [1, 2, 3, 4, 5]
    assert [r["pll"] for r in result.rows] == pytest.approx([sum(r) for r in refs], abs=1e-4)
    assert [r["n_tokens"] for r in result.rows] == [len(tok.tokenize(s)) for s in UNIQUE[:5]]
    want = math.exp(-sum(map(sum, refs)) / sum(map(len, refs)))  # Salazar et al. 2020, §2.3
    assert result.summary["pppl"] == pytest.approx(want, rel=1e-5)
    assert result.summary["neg_log_pppl"] == pytest.approx(-math.log(want), rel=1e-5)
    assert pppl([], []) != pppl([], [])  # NaN without tokens


def test_l2r_equals_original_on_single_piece_words(bert, tok, tmp_path):
    text = tmp_path / "single.txt"
    text.write_text("the cat is over the dog\nshe was a lazy fox .\n")
    a = score_corpus(bert, tok, text, variant="original")
    b = score_corpus(bert, tok, text, variant="within_word_l2r")
    assert [r["pll"] for r in a.rows] == pytest.approx([r["pll"] for r in b.rows], abs=1e-6)
    multi = tmp_path / "multi.txt"
    multi.write_text("unbelievable\n")
    a, b = (score_corpus(bert, tok, multi, variant=v) for v in ("original", "within_word_l2r"))
    assert abs(a.rows[0]["pll"] - b.rows[0]["pll"]) > 1e-6


def test_jsonl_gz_and_limit(bert, tok, tmp_path):
    path = tmp_path / "s.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for s in UNIQUE:
            f.write(json.dumps({"sentence": s, "id": 1}) + "\n")
    result = score_corpus(bert, tok, path, text_field="sentence", limit=3)
    assert [r["pll"] for r in result.rows] == pytest.approx(score_pll(bert, tok, UNIQUE[:3]),
                                                           abs=1e-5)
    with pytest.raises(UserError, match="no text field 'text'"):
        score_corpus(bert, tok, path)


def test_long_sentence_cut_at_a_word_boundary(bert, tok, tmp_path):
    text = tmp_path / "long.txt"
    text.write_text("unbelievable cats run\n")  # un ##believ ##able cat ##s run
    result = score_corpus(bert, tok, text, max_tokens=4)  # the cut would split "cats"
    row = result.rows[0]
    assert row["truncated"] and row["n_tokens"] == 3 and result.summary["n_truncated"] == 1
    assert row["pll"] == pytest.approx(sum(brute_force_pll(bert, tok, "unbelievable",
                                                           "original")), abs=1e-4)
    with pytest.raises(UserError, match="more than the model takes"):
        score_corpus(bert, tok, text, max_tokens=10_000)


def test_a_100_mb_line_is_cut_in_bounded_memory(tmp_path):
    path = tmp_path / "huge.txt"
    with open(path, "w") as f:
        f.write("the cat\n")
        f.write("dog " * (25 << 20))  # 100 MiB, one line
        f.write("\nthe end\n")
    tracemalloc.start()
    rows = list(read_sentences(path, max_chars=4096))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert [(n, cut) for n, _, cut in rows] == [(1, False), (2, True), (3, False)]
    assert len(rows[1][1]) <= 4096 and rows[1][1].split() == ["dog"] * (len(rows[1][1]) // 4 + 1)
    assert peak < 16 << 20  # the 100 MiB line was never held


def test_any_masked_scorer_closed_form(tok, tmp_path):
    scorer = PositionalScorer(len(tok))
    text = tmp_path / "s.txt"
    text.write_text("\n".join(UNIQUE) + "\n")
    result = score_corpus(scorer, tok, text, token_budget=30)
    logp = torch.log_softmax(scorer.table.double(), -1)
    for row, sentence in zip(result.rows, UNIQUE, strict=True):
        ids = tok(sentence)["input_ids"]
        assert row["pll"] == pytest.approx(
            sum(logp[t, ids[t]].item() for t in range(1, len(ids) - 1)), abs=1e-5)


def test_token_store_chunks_equal_brute_force(bert, tok, folder, tmp_path):
    from mlsm.data.corpus import TokenStore, prepare_corpus

    src = tmp_path / "corpus.txt"
    src.write_text("\n\n".join(UNIQUE[:4]) + "\n")
    store = prepare_corpus([str(src)], str(folder), tmp_path / "store", num_proc=1)
    result = score_corpus(bert, tok, tmp_path / "store", max_tokens=6)
    opened = TokenStore.open(store.path)
    chunks = [(d, s, opened.document(d)[s:s + 6].tolist()) for d in range(opened.n_docs)
              for s in range(0, len(opened.document(d)), 6)]
    assert [(r["doc"], r["start"]) for r in result.rows] == [(d, s) for d, s, _ in chunks]
    for row, (_, _, ids) in zip(result.rows, chunks, strict=True):
        assert row["pll"] == pytest.approx(sum(brute_force_ids(bert, tok, ids)), abs=1e-4)
        assert row["n_tokens"] == len(ids)
    assert score_corpus(bert, tok, tmp_path / "store", max_tokens=6, limit=2).rows == \
        result.rows[:2]
    with pytest.raises(UserError, match="word boundaries"):
        score_corpus(bert, tok, tmp_path / "store", variant="within_word_l2r")


def test_cli_writes_scores_summary_and_a_results_row(folder, tmp_path, capsys):
    from mlsm.artifacts.results_file import read_results
    from mlsm.cli import main
    from mlsm.evaluate.compare.stats import compare_runs

    text = tmp_path / "s.txt"
    text.write_text("\n".join(UNIQUE[:3]) + "\n")
    out, results = tmp_path / "o" / "scores.jsonl", tmp_path / "results.jsonl"
    for name in ("a", "b"):
        assert main(["score", str(folder), str(text), "--out", str(out), "--results",
                     str(results), "--name", name, "--variant", "within_word_l2r"]) == 0
    assert "PPPL" in capsys.readouterr().out
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    summary = json.loads(summary_path(out).read_text())
    assert summary_path(out).name == "scores.summary.json" and len(rows) == 3
    assert summary["pppl"] == pytest.approx(
        math.exp(-sum(r["pll"] for r in rows) / sum(r["n_tokens"] for r in rows)))
    (row_a, row_b) = read_results(results)
    task = "pppl:s.txt@" + hashlib.sha256(text.read_bytes()).hexdigest()[:12]
    assert (row_a["task"], row_a["metric"]) == (task, RESULT_METRIC)
    assert row_a["value"] == pytest.approx(-math.log(summary["pppl"]))
    cmp = compare_runs(results)
    assert cmp.columns == [(task, RESULT_METRIC)] and cmp.n_pairs[0, 1] == 1
    # another file of the same name is another task: its PPPL is never paired with s.txt's
    other = tmp_path / "elsewhere" / "s.txt"
    other.parent.mkdir()
    other.write_text("\n".join(UNIQUE[3:6]) + "\n")
    assert main(["score", str(folder), str(other), "--out", str(tmp_path / "o2.jsonl"),
                 "--results", str(results), "--name", "c", "--variant", "within_word_l2r"]) == 0
    cmp = compare_runs(results)
    assert len(cmp.columns) == 2 and cmp.n_pairs[0, 2] == cmp.n_pairs[1, 2] == 0
    assert main(["score", str(folder), str(tmp_path / "missing.txt"), "--out",
                 str(tmp_path / "x.jsonl")]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["score", str(folder), str(text), "--out", str(text)]) == 2  # never the input
    assert text.read_text().count("\n") == 3
