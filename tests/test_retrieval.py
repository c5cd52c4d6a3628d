"""Dense retrieval: IR metrics wiring, InfoNCE, mean pooling, exact search, the corpus cache,
BEIR loading (local and in the HF layout), bad BEIR folders, and tiny end-to-end grids."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, BertConfig, BertModel

from mlsm.artifacts.results_file import read_results
from mlsm.errors import UserError
from mlsm.evaluate.compare.stats import compare_runs
from mlsm.evaluate.finetune import retrieval
from mlsm.evaluate.finetune.beir import BeirSplit, load_beir_hf, read_beir
from mlsm.evaluate.finetune.finetune import finetune
from mlsm.evaluate.finetune.retrieval import (
    encode,
    encode_corpus,
    info_nce,
    ir_metrics,
    mean_pool,
    search,
)
from mlsm.evaluate.finetune.retrieval_cell import pick_positives, training_queries
from mlsm.evaluate.finetune.tasks import get_task, task_folder
from tests.helpers import SHARED, WORDS

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ----------------------------------------------------------------------------- metrics by hand


def _ranked(*docs: str) -> dict[str, float]:
    """A run row: the documents in rank order, scores strictly decreasing."""
    return {d: float(len(docs) - i) for i, d in enumerate(docs)}


def test_ir_metrics_match_the_definitions() -> None:
    """nDCG@10 (graded gains, log2(rank+1) discount), Recall@100, MRR@10 on rankings built so
    each cut-off, grade and id matters; the expected values are computed here from the
    definitions."""
    junk = [f"j{i}" for i in range(120)]
    qrels = {"q1": {"a": 2, "b": 1, "c": 0},  # c is judged non-relevant
             "q2": {"d": 1},
             "q3": {"e": 1, "f": 1},
             "q4": {"g": 1}}  # never retrieved
    run = {"q1": _ranked("x", "b", "a", "c"),
           "q2": _ranked(*junk[:10], "d"),  # first relevant at rank 11
           "q3": _ranked("e", *junk[:99], "f")}  # f at rank 101
    log2 = math.log2
    ndcg = [(1 / log2(3) + 2 / log2(4)) / (2 + 1 / log2(3)),
            0.0,
            1 / (1 + 1 / log2(3)),
            0.0]
    recall = [1.0, 1.0, 0.5, 0.0]
    mrr = [1 / 2, 0.0, 1.0, 0.0]  # rank 11 is beyond MRR@10
    got = ir_metrics(qrels, run)
    assert got["ndcg@10"] == pytest.approx(sum(ndcg) / 4, abs=1e-4)
    assert got["recall@100"] == pytest.approx(sum(recall) / 4, abs=1e-4)
    assert got["mrr@10"] == pytest.approx(sum(mrr) / 4, abs=1e-4)


# ----------------------------------------------------------------------------- loss and pooling


def test_info_nce_equals_the_formula_with_shared_positives_masked() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(5, 8, generator=gen), dim=-1)
    d = torch.nn.functional.normalize(torch.randn(5, 8, generator=gen), dim=-1)
    tau = 0.07
    keys = ["a", "b", "a", "c", "d"]  # queries 0 and 2 share their positive document
    d[2] = d[0]

    def direct(mask: bool) -> float:
        total = 0.0
        for i in range(5):
            terms = [math.exp(float(q[i] @ d[j]) / tau) for j in range(5)
                     if j == i or not (mask and keys[j] == keys[i])]
            total += -math.log(math.exp(float(q[i] @ d[i]) / tau) / sum(terms))
        return total / 5

    assert float(info_nce(q, d, tau)) == pytest.approx(direct(False), rel=1e-5)
    assert float(info_nce(q, d, tau, keys)) == pytest.approx(direct(True), rel=1e-5)
    assert direct(True) != pytest.approx(direct(False), rel=1e-3)  # the mask matters here


def test_mean_pool_averages_only_unmasked_tokens() -> None:
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 6, 4, generator=gen)
    lengths = [6, 2, 4]
    mask = torch.tensor([[1] * n + [0] * (6 - n) for n in lengths])
    pooled = mean_pool(hidden, mask)
    for b, n in enumerate(lengths):
        torch.testing.assert_close(pooled[b], hidden[b, :n].mean(0))


# ----------------------------------------------------------------------------- tiny models


def _model(tokenizer_dir: Path, out: Path, seed: int = 0, positions: int = 64) -> Path:
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(seed)
    BertModel(BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=2, intermediate_size=64,
                         max_position_embeddings=positions)).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tiny(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _model(tokenizer_dir, tmp_path_factory.mktemp("bert") / "m")


def _load(path: Path) -> tuple[BertModel, object]:
    return BertModel.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def test_encode_sorted_batches_equal_one_by_one(tiny: Path) -> None:
    """Length-sorted, padded batches give each text the embedding it has alone (no padding),
    returned in input order."""
    model, tok = _load(tiny)
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 20))) for _ in range(9)]
    batched = encode(model, tok, texts, 32, torch.device("cpu"), batch_size=4)
    alone = torch.cat([encode(model, tok, [t], 32, torch.device("cpu")) for t in texts])
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(batched.norm(dim=1), torch.ones(9))


def test_a_training_step_lowers_the_loss(tiny: Path) -> None:
    model, tok = _load(tiny)
    model.train()
    torch.manual_seed(0)
    qs = tok(["cat dog", "red tree", "book letter", "river city"], padding=True,
             return_tensors="pt")
    ds = tok(["the cat sees a dog", "a red tree", "old book and letter", "river near city"],
             padding=True, return_tensors="pt")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.eval()  # no dropout: the two losses differ by the step only

    def loss() -> torch.Tensor:
        return info_nce(retrieval.embed(model, dict(qs)), retrieval.embed(model, dict(ds)))

    before = loss()
    before.backward()
    opt.step()
    with torch.no_grad():
        assert float(loss()) < float(before)


def test_search_equals_a_full_sort_across_chunks() -> None:
    gen = torch.Generator().manual_seed(2)
    q, d = torch.randn(7, 5, generator=gen), torch.randn(50, 5, generator=gen)
    scores, idx = search(q, d, k=12, query_chunk=3, doc_chunk=8)
    full = q @ d.T
    ref_s, ref_i = full.sort(dim=1, descending=True)
    torch.testing.assert_close(scores, ref_s[:, :12])
    assert torch.equal(idx, ref_i[:, :12])
    assert search(q, d[:4], k=12)[1].shape == (7, 4)  # fewer documents than k


def test_identical_ids_are_not_retrieved() -> None:
    """BEIR's ignore_identical_ids (ArguAna, Quora hold their queries in the corpus)."""
    scores, idx = torch.tensor([[0.9, 0.8, 0.7]]), torch.tensor([[1, 0, 2]])
    assert retrieval.to_run(["b"], ["a", "b", "c"], scores, idx) == \
        {"b": {"a": pytest.approx(0.8), "c": pytest.approx(0.7)}}


def _split(n_docs: int = 6) -> BeirSplit:
    rng = random.Random(3)
    ids = [f"d{i}" for i in range(n_docs)]
    texts = [" ".join(rng.choice(WORDS) for _ in range(8)) for _ in ids]
    return BeirSplit(ids, texts, {"q": "cat"}, {"q": {"d0": 1}}, "mem")


def test_corpus_cache_is_read_only_for_the_same_fingerprint(tiny: Path, tmp_path: Path,
                                                            monkeypatch) -> None:
    model, tok = _load(tiny)
    cpu, split = torch.device("cpu"), _split()
    first = encode_corpus(model, tok, split, 32, cpu, tmp_path)
    (cache,) = tmp_path.glob("*.safetensors")
    calls = []
    real = retrieval.encode
    monkeypatch.setattr(retrieval, "encode", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.testing.assert_close(encode_corpus(model, tok, split, 32, cpu, tmp_path), first)
    assert calls == []  # read back, not encoded
    encode_corpus(model, tok, split, 16, cpu, tmp_path)  # another max_len: another key
    assert calls == [1]
    with torch.no_grad():
        model.encoder.layer[0].output.dense.bias[3] += 1.0  # other weights: another key
    changed = encode_corpus(model, tok, split, 32, cpu, tmp_path)
    assert calls == [1, 1] and not torch.allclose(changed, first)
    # a file under the right name but with another fingerprint inside is not trusted
    key = cache.stem
    other = next(p for p in tmp_path.glob("*.safetensors") if p != cache)
    cache.write_bytes(other.read_bytes())
    with torch.no_grad():
        model.encoder.layer[0].output.dense.bias[3] -= 1.0
    assert retrieval.fingerprint(model, tok, split.doc_texts, split.doc_ids, 32) == key
    torch.testing.assert_close(encode_corpus(model, tok, split, 32, cpu, tmp_path), first)
    assert len(calls) == 3


# ----------------------------------------------------------------------------- BEIR folders


def _write(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\r\n" for line in lines), encoding="utf-8")


def _beir(root: Path, name: str = "toy", n_docs: int = 24, seed: int = 0) -> Path:
    """A BEIR folder whose query i names 3 words of document i (documents 0..15 train, 16..23
    test); queries 0 and 1 each have a second positive."""
    rng = random.Random(seed)
    folder = root / name
    docs = [rng.sample(WORDS, 7) for _ in range(n_docs)]
    _write(folder / "corpus.jsonl", [json.dumps({"_id": f"d{i}", "title": w[0],
                                                 "text": " ".join(w[1:])})
                                     for i, w in enumerate(docs)])
    _write(folder / "queries.jsonl", [json.dumps({"_id": f"q{i}", "text": " ".join(w[1:4])})
                                      for i, w in enumerate(docs)])
    head = "query-id\tcorpus-id\tscore"
    train = [f"q{i}\td{i}\t1" for i in range(16)] + ["q0\td5\t1", "q1\td7\t2"]
    _write(folder / "qrels" / "train.tsv", [head, *train])
    _write(folder / "qrels" / "test.tsv", [head, *[f"q{i}\td{i}\t1" for i in range(16, n_docs)]])
    return folder


def test_read_beir_resolves_ids_and_keeps_grades(tmp_path: Path) -> None:
    folder = _beir(tmp_path)
    train = read_beir(folder, "train")
    assert len(train.doc_ids) == 24 and len(train.queries) == 16
    assert train.qrels["q1"] == {"d1": 1, "d7": 2}
    queries = training_queries(train)
    assert [p for p, _ in queries[0].positives] == ["d0", "d5"]
    # the positive of a two-positive query depends on the seed, and only on it
    picks = {tuple(pick_positives(queries, s, "beir:toy"))[:2] for s in range(8)}
    assert len(picks) > 1
    assert pick_positives(queries, 3, "beir:toy") == pick_positives(queries, 3, "beir:toy")
    # qrels without a header: the first line is data, even when its query id reads "query..."
    (folder / "queries.jsonl").write_text('{"_id": "query1", "text": "cat"}\n')
    _write(folder / "qrels" / "test.tsv", ["query1\td3\t1"])
    assert read_beir(folder, "test").qrels == {"query1": {"d3": 1}}


@pytest.mark.parametrize("damage, expected", [
    (lambda f: _write(f / "qrels" / "test.tsv", ["query-id\tcorpus-id\tscore", "q16\td16\t1",
                                                 "q17\tnope\t1"]),
     r"qrels/test.tsv:3: corpus-id 'nope' is not in corpus.jsonl; fix the id"),
    (lambda f: _write(f / "qrels" / "test.tsv", ["query-id\tcorpus-id\tscore", "qx\td16\t1"]),
     r"qrels/test.tsv:2: query-id 'qx' is not in queries.jsonl; fix the id"),
    (lambda f: _write(f / "corpus.jsonl", []), r"corpus.jsonl: no documents \(the file is empty\)"),
    (lambda f: (f / "qrels" / "test.tsv").unlink(), r"qrels: no test.tsv \(splits here: train\)"),
    (lambda f: _write(f / "queries.jsonl", ['{"_id": "q1", "text": "a"}', "{oops"]),
     r"queries.jsonl:2 is not JSON"),
    (lambda f: _write(f / "qrels" / "test.tsv", ["query-id\tcorpus-id\tscore", "q16 d16 1"]),
     r"qrels/test.tsv:2: expected 3 tab-separated columns"),
    (lambda f: _write(f / "qrels" / "test.tsv", ["query-id\tcorpus-id\tscore", "q16\td16\tinf"]),
     r"qrels/test.tsv:2: expected 3 tab-separated columns"),
])
def test_bad_beir_folder_is_one_line_naming_file_and_line(tmp_path: Path, damage,
                                                          expected: str) -> None:
    folder = _beir(tmp_path)
    damage(folder)
    with pytest.raises(UserError, match=expected) as err:
        read_beir(folder, "test")
    assert "\n" not in str(err.value)


def test_missing_train_split_names_the_zeroshot_fix_and_keeps_results(tiny: Path,
                                                                       tmp_path: Path) -> None:
    folder = _beir(tmp_path / "data")
    (folder / "qrels" / "train.tsv").unlink()
    results = tmp_path / "results.jsonl"
    results.write_text('{"model": "m", "value": 0.5, "task": "cola", "metric": "mcc", '
                       '"seed": 0, "lr": 2e-05, "epochs": 3, "batch_size": 32, "max_len": 128, '
                       '"n_train": 10}\n')
    before = results.read_bytes()
    with pytest.raises(UserError, match=r"no train.tsv .* _zeroshot"):
        finetune([str(tiny)], ["beir:toy"], seeds=(0,), data_dir=folder.parent,
                 results=results)
    assert results.read_bytes() == before  # nothing written is lost
    rows = finetune([str(tiny)], ["beir:toy_zeroshot"], seeds=(0,), data_dir=folder.parent,
                    results=results, max_len=32)
    assert len(read_results(rows)) == 1 + 3


def test_hf_layout_loads_the_same_split(tmp_path: Path) -> None:
    """A dataset in the Hub's BEIR layout (mteb/<name>: configs corpus, queries and default, the
    qrels as JSON lines) read through `datasets` equals the same data read as a BEIR folder."""
    folder = _beir(tmp_path, "hfcopy")
    for split in ("train", "test"):
        lines = (folder / "qrels" / f"{split}.tsv").read_text().splitlines()[1:]
        _write(folder / "hf" / f"{split}.jsonl",
               [json.dumps(dict(zip(("query-id", "corpus-id", "score"),
                                    (*line.split("\t")[:2], int(line.split("\t")[2])),
                                    strict=True))) for line in lines])
    (folder / "README.md").write_text(
        "---\nconfigs:\n- config_name: corpus\n  data_files:\n  - split: corpus\n"
        "    path: corpus.jsonl\n- config_name: queries\n  data_files:\n  - split: queries\n"
        "    path: queries.jsonl\n- config_name: default\n  data_files:\n  - split: train\n"
        "    path: hf/train.jsonl\n  - split: test\n    path: hf/test.jsonl\n---\n")
    local, hub = read_beir(folder, "train"), load_beir_hf("hfcopy", "train", [str(folder)])
    assert (hub.doc_ids, hub.doc_texts, hub.queries, hub.qrels) == \
        (local.doc_ids, local.doc_texts, local.queries, local.qrels)


# ----------------------------------------------------------------------------- the grid


def test_finetune_grid_writes_rows_compare_reads(tiny: Path, tokenizer_dir: Path,
                                                 tmp_path: Path) -> None:
    _beir(tmp_path / "data")
    other = _model(tokenizer_dir, tmp_path / "other", seed=1)
    results = tmp_path / "out" / "results.jsonl"
    kw = dict(seeds=(0, 1), lrs=(1e-3,), epochs=2, batch_size=4, max_len=32,
              data_dir=tmp_path / "data",
              results=results)
    finetune([f"a={tiny}", f"b={other}"], ["beir:toy", "beir:toy_zeroshot"], **kw)
    rows = read_results(results)
    assert {r["metric"] for r in rows} == {"ndcg@10", "recall@100", "mrr@10"}
    tuned = [r for r in rows if r["task"] == "beir:toy"]
    zero = [r for r in rows if r["task"] == "beir:toy_zeroshot"]
    assert len(tuned) == len(zero) == 2 * 2 * 3
    assert {r["n_train"] for r in tuned} == {16} and {r["n_train"] for r in zero} == {0}
    assert {r["n_eval"] for r in rows} == {8} and {r["n_docs"] for r in rows} == {24}
    assert {r["temperature"] for r in tuned} == {0.05}
    assert all(0 <= r["value"] <= 1 for r in rows)
    # zero-shot: one value per model whatever the seed; fine-tuning changes it
    for m in ("a", "b"):
        z = {r["value"] for r in zero if r["model"] == m and r["metric"] == "ndcg@10"}
        t = {r["value"] for r in tuned if r["model"] == m and r["metric"] == "ndcg@10"}
        assert len(z) == 1 and z != t
    assert len(list((tmp_path / "out" / "retrieval_cache").glob("*.safetensors"))) == 2
    cmp = compare_runs(results)
    assert ("beir:toy", "ndcg@10") in cmp.columns and cmp.n_pairs[0, 1] == 2 * 2 * 3
    finetune([f"a={tiny}", f"b={other}"], ["beir:toy", "beir:toy_zeroshot"], **kw)
    assert len(read_results(results)) == len(rows)  # resumed: nothing redone
    with pytest.raises(UserError, match="temperature 0.05, this grid uses 0.1"):
        finetune([f"a={tiny}"], ["beir:toy"], temperature=0.1, **kw)


def test_retrieval_length_defaults_to_the_models_own(tokenizer_dir: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    """No --max-len: a retrieval cell cuts queries and documents at the model's own length
    (sentence_bert_config.json's max_seq_length, else its positions), says so on stderr and
    records it in the row; the other kinds keep 128; an explicit length wins."""
    from tests.test_finetune import _keyword_sst2

    _beir(tmp_path / "data")
    _keyword_sst2(tmp_path / "data", n_train=8, n_dev=4)
    st = _model(tokenizer_dir, tmp_path / "st", positions=128)
    (st / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 64, "do_lower_case": False}))
    plain = _model(tokenizer_dir, tmp_path / "plain", positions=96)
    kw = dict(seeds=(0,), data_dir=tmp_path / "data", device="cpu", epochs=1, batch_size=8)
    results = tmp_path / "r.jsonl"
    finetune([f"st={st}", f"plain={plain}"], ["beir:toy_zeroshot", "beir:toy", "sst2"],
             results=results, **kw)
    assert {(r["model"], r["task"], r["max_len"]) for r in read_results(results)} == {
        ("st", "beir:toy_zeroshot", 64), ("st", "beir:toy", 64), ("st", "sst2", 128),
        ("plain", "beir:toy_zeroshot", 96), ("plain", "beir:toy", 96), ("plain", "sst2", 128)}
    err = capsys.readouterr().err
    assert "max_len 64 (sentence_bert_config.json max_seq_length)" in err
    assert "max_len 96 (config.json max_position_embeddings)" in err
    before = results.read_bytes()
    finetune([f"st={st}", f"plain={plain}"], ["beir:toy_zeroshot", "beir:toy", "sst2"],
             results=results, **kw)
    assert results.read_bytes() == before  # resumed: the resolved length is the cell's
    explicit = tmp_path / "e.jsonl"
    finetune([f"st={st}"], ["beir:toy_zeroshot"], max_len=32, results=explicit, **kw)
    assert {r["max_len"] for r in read_results(explicit)} == {32}


def test_the_models_length_falls_back_from_positions_to_128(tmp_path: Path) -> None:
    from mlsm.evaluate.finetune.cell import cell_max_len

    def folder(name: str, config: dict, st: object = None) -> str:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        if st is not None:
            (tmp_path / name / "sentence_bert_config.json").write_text(json.dumps(st))
        return str(tmp_path / name)

    long = folder("long", {"model_type": "bert", "max_position_embeddings": 8192})
    roberta = folder("roberta", {"model_type": "roberta", "max_position_embeddings": 514,
                                 "pad_token_id": 1})
    relative = folder("deberta", {"model_type": "deberta-v2", "max_position_embeddings": 512,
                                  "position_biased_input": False})
    assert cell_max_len(0, "retrieval", long) == (512, "config.json max_position_embeddings "
                                                       "up to 512")
    assert cell_max_len(0, "retrieval", roberta)[0] == 512  # 514 less the pad offset
    assert cell_max_len(0, "retrieval", relative)[0] == 128  # no absolute positions
    assert cell_max_len(0, "cls", long)[0] == 128 and cell_max_len(40, "retrieval", long)[0] == 40
    bad = folder("bad", {"max_position_embeddings": 512}, {"max_seq_length": "256"})
    with pytest.raises(UserError, match=r"sentence_bert_config.json: max_seq_length is '256', "
                                        r"not a length .* pass --max-len N"):
        cell_max_len(0, "retrieval", bad)


def test_data_dir_may_hold_the_task_folder_one_level_down(tmp_path: Path) -> None:
    """--data-dir ../shared/data finds glue/CoLA and scifact/ in one grid."""
    folder = _beir(tmp_path / "beir")
    (tmp_path / "glue" / "CoLA").mkdir(parents=True)
    assert task_folder(get_task("beir:toy"), tmp_path) == folder
    assert task_folder(get_task("cola"), tmp_path) == tmp_path / "glue" / "CoLA"
    with pytest.raises(UserError, match="no folder scifact"):
        task_folder(get_task("scifact"), tmp_path)


def test_task_names() -> None:
    assert get_task("scifact").kind == "retrieval" and get_task("scifact").train_split
    assert not get_task("SciFact_zeroshot").train_split
    spec = get_task("beir:NFCorpus_zeroshot")
    assert spec.name == "beir:NFCorpus_zeroshot" and spec.folders == ("NFCorpus", "nfcorpus")
    assert get_task("beir:mteb/nfcorpus").hf == (("mteb/nfcorpus", None),)
    with pytest.raises(UserError, match="beir:NAME"):
        get_task("scifactt")


# ----------------------------------------------------------------------------- shared SciFact


@pytest.mark.slow
def test_shared_scifact_zero_shot_with_minilm() -> None:
    """The real SciFact test split and the packaged all-MiniLM-L6-v2 (a mean-pooling sentence
    encoder): 20 test queries against their judged documents plus 120 others. A wiring error
    (ids, pooling, the metric) drops nDCG@10 to chance level (about 0.03 here; measured 0.94)."""
    folder = SHARED / "scifact"
    if not (folder / "corpus.jsonl.gz").is_file():
        pytest.skip("shared SciFact not present")
    from mlsm.teacher.teacher import default_teacher_path

    try:
        path = default_teacher_path()
    except Exception as exc:  # the packaged teacher is absent
        pytest.skip(f"packaged MiniLM absent ({exc})")
    test = read_beir(folder, "test")
    assert (len(test.doc_ids), len(test.queries)) == (5183, 300)
    assert sum(len(j) for j in test.qrels.values()) == 339
    qids = list(test.qrels)[:20]
    judged = {d for q in qids for d in test.qrels[q]}
    keep = [i for i, d in enumerate(test.doc_ids) if d in judged or i % 43 == 0]
    split = BeirSplit([test.doc_ids[i] for i in keep], [test.doc_texts[i] for i in keep],
                      {q: test.queries[q] for q in qids}, {q: test.qrels[q] for q in qids},
                      str(folder))
    model, tok = BertModel.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    scores = retrieval.evaluate_split(model, tok, split, 96, torch.device("cpu"))
    assert scores["ndcg@10"] > 0.7 and scores["recall@100"] > 0.9
