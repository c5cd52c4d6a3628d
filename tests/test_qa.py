"""Extractive QA (SQuAD v1.1 / v2.0): official metrics, windows and labels, n-best decoding,
the by-article protocol split, bad input, and `finetune` end to end on synthetic articles."""

from __future__ import annotations

import gzip
import itertools
import json
import random
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

from mlsm.artifacts.results_file import read_results
from mlsm.errors import UserError
from mlsm.evaluate.compare.stats import compare_runs
from mlsm.evaluate.finetune import qa
from mlsm.evaluate.finetune.finetune import finetune
from mlsm.evaluate.finetune.qa_data import (
    QAExample,
    from_hf_row,
    in_eval_part,
    read_squad_json,
    split_by_article,
)
from mlsm.evaluate.finetune.qa_metrics import (
    best_threshold,
    exact_match,
    normalize_answer,
    squad_v1_metrics,
    squad_v2_metrics,
    token_f1,
)
from mlsm.evaluate.finetune.task_cell import predict
from mlsm.evaluate.finetune.tasks import get_task, load_task

SHARED_SQUAD = Path(__file__).resolve().parents[2] / "shared/data/squad_v1.1/dev-v1.1.json.gz"
WORDS = ["river", "stone", "castle", "green", "music", "winter", "garden", "silver", "paper",
         "forest", "window", "orange", "bridge", "cloud", "summer", "engine"]
NAMES = ["anna", "boris", "clara", "dmitri", "elena", "felix", "greta", "hugo"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ----------------------------------------------------------------------------- metrics


def test_normalisation_and_scores_known_by_construction() -> None:
    assert normalize_answer("The  Cat,  sat!") == "cat sat"
    assert normalize_answer("an Apple; a pear") == "apple pear"
    assert normalize_answer("theatre anthem") == "theatre anthem"  # articles as whole words only
    assert exact_match("the Eiffel Tower.", "Eiffel tower") == 1.0
    assert exact_match("Eiffel", "Eiffel Tower") == 0.0
    assert token_f1("red big dog", "the big dog") == pytest.approx(0.8)  # P 2/3, R 1
    assert token_f1("cat", "dog") == 0.0
    assert token_f1("", "") == 0.0 and token_f1("", "", empty_agrees=True) == 1.0
    assert token_f1("a", "dog", empty_agrees=True) == 0.0  # "a" normalises to nothing
    golds = {"q1": ["Paris", "the city of Paris"], "q2": ["1912"], "q3": ["blue whale"]}
    got = squad_v1_metrics({"q1": "city of Paris!", "q2": "in 1913"}, golds)  # q3 unanswered
    assert got["em"] == pytest.approx(1 / 3)
    assert got["f1"] == pytest.approx((1.0 + 0.0 + 0.0) / 3)


def test_v1_metric_matches_torchmetrics_squad_on_random_cases() -> None:
    tm = pytest.importorskip("torchmetrics.functional.text")
    rng = random.Random(0)
    vocab = ["a", "an", "the", "cat", "Cat", "dog", "dog,", "red", "(big)", "sat", "mat."]
    preds, target = [], []

    def phrase(k: int) -> str:  # at least one word that survives normalisation (see below)
        return " ".join([*rng.choices(vocab, k=k), rng.choice(vocab[3:])])

    for i in range(300):
        golds = [phrase(rng.randint(0, 3)) for _ in range(rng.randint(1, 3))]
        pred = phrase(rng.randint(0, 4))
        preds.append({"prediction_text": pred, "id": str(i)})
        target.append({"answers": {"answer_start": [0] * len(golds), "text": golds}, "id": str(i)})
    ref = tm.squad(preds, target)
    ours = squad_v1_metrics({p["id"]: p["prediction_text"] for p in preds},
                            {t["id"]: t["answers"]["text"] for t in target})
    assert 0 < ours["em"] < ours["f1"] < 1
    assert ours["em"] * 100 == pytest.approx(float(ref["exact_match"]), abs=1e-4)
    assert ours["f1"] * 100 == pytest.approx(float(ref["f1"]), abs=1e-4)
    # torchmetrics scores two answers that normalise to nothing F1 = 1 (SQuAD 2.0's rule); the
    # official v1.1 script, and we, score 0
    one = [{"prediction_text": "the", "id": "x"}]
    gold = [{"answers": {"answer_start": [0], "text": ["a"]}, "id": "x"}]
    assert float(tm.squad(one, gold)["f1"]) == 100.0
    assert squad_v1_metrics({"x": "the"}, {"x": ["a"]})["f1"] == 0.0


def test_v2_has_ans_no_ans_and_threshold_by_construction() -> None:
    golds = {"a1": ["Paris"], "a2": ["blue whale"], "n1": [], "n2": []}
    spans = {"a1": "Paris", "a2": "grey whale", "n1": "Rome", "n2": "Oslo"}
    na = {"a1": -2.0, "a2": 1.0, "n1": 3.0, "n2": -1.0}
    m, th = squad_v2_metrics(spans, na, golds, threshold=0.0)
    # threshold 0: a2 and n1 turn into "no answer"; a1 right, a2 wrong (0), n1 right, n2 wrong
    assert m["em"] == pytest.approx(2 / 4) and m["f1"] == pytest.approx(2 / 4)
    assert m["has_ans_em"] == pytest.approx(1 / 2) and m["has_ans_f1"] == pytest.approx(1 / 2)
    assert m["no_ans_f1"] == pytest.approx(1 / 2)
    # sweep in na order a1 (-2), n2 (-1), a2 (1), n1 (3) from 2 (all "no answer"): EM totals
    # 3, 2, 2, 1 -> best 3/4 at -2.0; F1 totals 3, 2, 2.5 (a2's F1 is 0.5), 1.5 -> 3/4 at -2.0
    assert m["best_em"] == pytest.approx(3 / 4) and th["best_em"] == -2.0
    assert m["best_f1"] == pytest.approx(3 / 4) and th["best_f1"] == -2.0
    m2, _ = squad_v2_metrics(spans, {k: -5.0 for k in na}, golds)  # nothing thresholded
    assert m2["no_ans_f1"] == 0.0 and m2["has_ans_f1"] == pytest.approx((1 + 0.5) / 2)


def test_best_threshold_equals_a_brute_force_sweep() -> None:
    rng = random.Random(1)
    for _ in range(50):
        n = rng.randint(1, 12)
        has = {str(i): rng.random() < 0.6 for i in range(n)}
        spans = {q: rng.choice(["", "x"]) for q in has}
        raw = {q: (rng.choice([0.0, 0.5, 1.0]) if has[q] else float(spans[q] == ""))
               for q in has}
        na = {q: rng.gauss(0, 1) for q in has}
        best, thresh = best_threshold(spans, raw, na, has)

        def total(t: float, has=has, na=na, raw=raw, n=n) -> float:
            return sum(float(not has[q]) if na[q] > t else raw[q] for q in has) / n

        baseline = total(-np.inf)  # every question "no answer"
        assert best == pytest.approx(max(total(t) for t in [-np.inf, *na.values()]))
        if best > baseline:  # else the official script reports threshold 0.0
            assert total(thresh) == pytest.approx(best)


# ----------------------------------------------------------------------------- data


def _article(rng: random.Random, title: str, n_par: int = 2, impossible: bool = False,
             facts: int = 4) -> dict:
    """Paragraphs "<name> likes the <word> ..." with questions whose answers are known."""
    paragraphs = []
    for p in range(n_par):
        pairs = list(zip(rng.sample(NAMES, facts), rng.sample(WORDS, facts), strict=True))
        filler = " ".join(rng.choices(WORDS, k=rng.randint(8, 30)))
        context = filler + " . " + " . ".join(f"{n} likes the {w}" for n, w in pairs) + " ."
        qas = []
        for j, (name, word) in enumerate(pairs):
            start = context.index(f"{name} likes the {word}") + len(f"{name} likes the ")
            qas.append({"id": f"{title}-{p}-{j}", "question": f"what does {name} like ?",
                        "answers": [{"text": word, "answer_start": start}]})
        if impossible:
            absent = next(n for n in NAMES if n not in context)
            qas.append({"id": f"{title}-{p}-x", "question": f"what does {absent} like ?",
                        "answers": [], "is_impossible": True})
        paragraphs.append({"context": context, "qas": qas})
    return {"title": title, "paragraphs": paragraphs}


def _squad_folder(root: Path, name: str, n_articles: int, impossible: bool = False,
                  seed: int = 0, files: tuple[str, ...] = ("dev-v1.1.json",),
                  facts: int = 4) -> Path:
    rng = random.Random(seed)
    folder = root / name
    folder.mkdir(parents=True)
    for f in files:
        data = {"version": "x", "data": [_article(rng, f"Article_{f[:3]}_{i}", 3, impossible,
                                                  facts)
                                         for i in range(n_articles)]}
        (folder / f).write_text(json.dumps(data, indent=1), encoding="utf-8")
    return folder


def test_json_and_hf_rows_agree(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    folder = _squad_folder(tmp_path, "squad_v2", 3, impossible=True, files=("dev-v2.0.json",))
    examples = read_squad_json(folder / "dev-v2.0.json")
    assert any(not ex.answers for ex in examples) and any(ex.answers for ex in examples)
    rows = {"id": [], "title": [], "context": [], "question": [], "answers": []}
    for ex in examples:  # the HF squad_v2 schema
        for key, value in (("id", ex.qid), ("title", ex.title), ("context", ex.context),
                           ("question", ex.question)):
            rows[key].append(value)
        rows["answers"].append({"text": [t for t, _ in ex.answers],
                                "answer_start": [s for _, s in ex.answers]})
    ds = datasets.Dataset.from_dict(rows)
    assert [from_hf_row(r) for r in ds] == examples


def test_split_by_article_is_disjoint_stable_and_local(tmp_path: Path) -> None:
    folder = _squad_folder(tmp_path, "squad_v1.1", 40)
    examples = read_squad_json(folder / "dev-v1.1.json")
    train, dev = split_by_article(examples, "train"), split_by_article(examples, "dev")
    assert {e.title for e in train}.isdisjoint({e.title for e in dev})
    assert len(train) + len(dev) == len(examples) and dev and train
    # an article's side depends on its own title alone: dropping other articles moves nothing
    half = [e for e in examples if e.title < "Article_dev_2"]
    assert {e.qid for e in split_by_article(half, "dev")} <= {e.qid for e in dev}
    # the task reader: no training file -> the split, with the same parts
    assert load_task("squad", "dev", tmp_path) == dev
    assert load_task("squad", "train", tmp_path) == train


@pytest.mark.skipif(not SHARED_SQUAD.is_file(), reason="shared SQuAD dev file absent")
def test_protocol_split_of_the_shared_dev_set() -> None:
    examples = read_squad_json(SHARED_SQUAD)
    assert len(examples) == 10570
    dev = split_by_article(examples, "dev")
    train = split_by_article(examples, "train")
    titles = {e.title for e in dev}
    assert (len(train), len(dev), len(titles)) == (9007, 1563, 8)  # docs/finetune.md
    assert titles.isdisjoint({e.title for e in train})
    assert all(in_eval_part(t) for t in titles)


def test_bad_offsets_and_shapes_are_one_line(tmp_path: Path) -> None:
    folder = _squad_folder(tmp_path, "squad_v1.1", 2)
    path = folder / "dev-v1.1.json"
    data = json.loads(path.read_text())
    qa0 = data["data"][1]["paragraphs"][0]["qas"][2]
    qa0["answers"][0]["answer_start"] += 3
    path.write_text(json.dumps(data, indent=1))
    line = 1 + path.read_text().split(json.dumps(qa0["id"]))[0].count("\n")
    with pytest.raises(UserError, match=rf"dev-v1.1.json:{line}: question {qa0['id']}: "
                                        r".*fix answer_start"):
        read_squad_json(path)
    path.write_text(json.dumps({"data": [{"title": "t", "paragraphs": [{"context": 3}]}]}))
    with pytest.raises(UserError, match=r"context is int, not str; expected the official SQuAD"):
        read_squad_json(path)
    gz = tmp_path / "x.json.gz"
    gz.write_bytes(gzip.compress(b'{"data": ['))
    with pytest.raises(UserError, match=r"x.json.gz:1 is not JSON"):
        read_squad_json(gz)
    v2 = _squad_folder(tmp_path / "v2", "squad_v1.1", 2, impossible=True)
    with pytest.raises(UserError, match="use task squad_v2"):
        load_task("squad", "dev", v2.parent)
    # the file itself as --data-dir: one line naming the folder to pass instead
    with pytest.raises(UserError, match=rf"is a file; pass the folder that holds it "
                                        rf"\(--data-dir {re.escape(str(folder))}\)"):
        load_task("squad", "dev", path)


# ----------------------------------------------------------------------------- windows, decode


def _tokenizer(folder: Path) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    text = " ".join(WORDS + NAMES + ["likes", "the", "what", "does", "like", "?", "."])
    tok.train_from_iterator([text] * 5, trainers.WordPieceTrainer(
        vocab_size=150, special_tokens=specials,
        initial_alphabet=list("abcdefghijklmnopqrstuvwxyz")))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    fast.save_pretrained(folder)
    return fast


def _bert(folder: Path, seed: int = 0) -> Path:
    tok = _tokenizer(folder)
    torch.manual_seed(seed)
    BertModel(BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=2, intermediate_size=64,
                         max_position_embeddings=64)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _bert(tmp_path_factory.mktemp("qa") / "bert")


def test_windows_cover_the_context_and_labels_recover_the_answer(tiny: Path) -> None:
    tok = PreTrainedTokenizerFast.from_pretrained(tiny)
    rng = random.Random(3)
    examples = read_squad_json_from(_article(rng, "T", 6, impossible=True))
    feats = qa.encode_windows(tok, examples, max_len=32)
    stride = qa.stride_for(32)
    for k, ex in enumerate(examples):
        wins = [f for f in feats if f["example"] == k]
        assert len(wins) > 1  # the contexts are longer than one window
        covered = set()
        for a, b in itertools.pairwise(wins):  # consecutive windows share `stride` tokens
            sa = [tuple(o) for o in a["offsets"] if o[0] >= 0]
            sb = [tuple(o) for o in b["offsets"] if o[0] >= 0]
            assert sa[-stride:] == sb[:stride]
        for f in wins:
            assert len(f["inputs"]["input_ids"]) <= 32
            covered |= {tuple(o) for o in f["offsets"] if o[0] >= 0}
            s, e = f["label"]
            if (s, e) != (0, 0):
                assert f["offsets"][s][0] >= 0 and f["offsets"][e][0] >= 0
                assert ex.context[f["offsets"][s][0]:f["offsets"][e][1]] == ex.answers[0][0]
        every = tok(ex.context, add_special_tokens=False, return_offsets_mapping=True)
        assert covered == {tuple(o) for o in every["offset_mapping"]}
        labelled = [f for f in wins if f["label"] != (0, 0)]
        assert bool(labelled) == bool(ex.answers)


def read_squad_json_from(article: dict) -> list[QAExample]:
    return [QAExample(q["id"], article["title"], q["question"], p["context"],
                      tuple((a["text"], a["answer_start"]) for a in q["answers"]))
            for p in article["paragraphs"] for q in p["qas"]]


def test_window_spans_equal_a_brute_force_search() -> None:
    gen = torch.Generator().manual_seed(0)
    start, end = torch.randn(3, 12, generator=gen), torch.randn(3, 12, generator=gen)
    context = torch.zeros(3, 12, dtype=torch.bool)
    context[:, 4:11] = True
    settings = qa.QASettings(n_best=5, max_answer_tokens=3)
    scores, flat = qa.window_spans(start, end, context, settings)
    for b in range(3):
        brute = sorted(((float(start[b, s] + end[b, e]), s * 12 + e)
                        for s in range(4, 11) for e in range(s, min(s + 3, 11))), reverse=True)
        assert [i for _, i in brute[:5]] == flat[b].tolist()
        assert np.allclose([v for v, _ in brute[:5]], scores[b].numpy())


def test_decode_best_over_windows_and_null_answer() -> None:
    context = "alpha beta gamma delta"
    w1 = (np.array([2.0, 1.0]), np.array([[0, 5], [6, 10]]), 0.5)  # "alpha" 2.0, "beta" 1.0
    w2 = (np.array([3.0, -np.inf]), np.array([[11, 16], [0, 0]]), 4.0)  # "gamma" 3.0
    out = qa.decode([w1, w2], context, unanswerable=True)
    assert (out["text"], out["span"], out["na_score"]) == ("gamma", "gamma", 0.5 - 3.0)
    assert [t for _, t in out["n_best"]] == ["gamma", "alpha", "beta"]
    lone = [(np.array([1.0]), np.array([[0, 5]]), 2.5)]  # null 2.5 beats the only span (1.0)
    v2 = qa.decode(lone, context, unanswerable=True)
    assert v2["text"] == "" and v2["span"] == "alpha" and v2["na_score"] == 1.5
    v1 = qa.decode(lone, context, unanswerable=False)  # SQuAD 1.1: the best span regardless
    assert v1["text"] == "alpha" and v1["na_score"] == 1.5


class _IdsAsHidden(torch.nn.Module):
    """A stand-in backbone: the token ids themselves as a (B, T, 1) hidden state."""

    def forward(self, input_ids: torch.Tensor, **_: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(last_hidden_state=input_ids[..., None].float())


class _ClsWins(torch.nn.Module):
    """Start and end logits (B, T, 2): 10 at [CLS] (position 0), 3 on token `word`, 0 elsewhere,
    so the null score (20) beats the best span (`word` alone, 6)."""

    def __init__(self, word: int) -> None:
        super().__init__()
        self.word = word

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None
                ) -> torch.Tensor:
        out = torch.zeros(*hidden.shape[:2], 2)
        out[hidden[..., 0] == self.word] = 3.0
        out[:, 0] = 10.0
        return out


def test_squad_v1_answers_the_best_span_when_cls_scores_higher(tiny: Path) -> None:
    """SQuAD 1.1 has no unanswerable question: its answer is the best non-null span even when
    [CLS] scores higher; SQuAD 2.0 answers "" there (null 20 - span 6 > threshold 0)."""
    tok = PreTrainedTokenizerFast.from_pretrained(tiny)
    assert tok.tokenize("castle") == ["castle"]
    ex = QAExample("q", "T", "what does anna like ?", "anna likes the castle .",
                   (("castle", 15),))
    feats = qa.encode_windows(tok, [ex], max_len=32)
    model, head, cpu = _IdsAsHidden(), _ClsWins(tok.convert_tokens_to_ids("castle")), \
        torch.device("cpu")
    (v1,) = predict(model, head, tok, get_task("squad"), feats, [ex], cpu)
    assert (v1["text"], v1["span"]) == ("castle", "castle")
    assert qa.score_v1([v1], [ex]) == {"em": 1.0, "f1": 1.0}
    (v2,) = predict(model, head, tok, get_task("squad_v2"), feats, [ex], cpu)
    assert (v2["text"], v2["span"], v2["na_score"]) == ("", "castle", 20.0 - 6.0)


# ----------------------------------------------------------------------------- end to end


def test_finetune_learns_squad_and_resumes(tiny: Path, tmp_path: Path) -> None:
    # one fact per paragraph: the answer is the word after "likes the", learnable in seconds
    _squad_folder(tmp_path / "data", "squad_v1.1", 60, seed=1, facts=1)
    out = tmp_path / "results.jsonl"
    args = {"seeds": (0,), "lrs": (3e-3,), "epochs": 10, "batch_size": 16, "max_len": 48,
            "data_dir": tmp_path / "data", "results": out, "device": "cpu"}
    finetune([str(tiny)], ["squad"], **args)
    rows = {r["metric"]: r for r in read_results(out)}
    assert set(rows) == {"em", "f1"}
    assert rows["f1"]["value"] > 0.8  # far above an untrained head (chance is ~1/30 spans)
    assert rows["em"]["n_train"] == len(load_task("squad", "train", tmp_path / "data"))
    before = out.read_bytes()
    finetune([str(tiny)], ["squad"], **args)
    assert out.read_bytes() == before  # the finished cell is recognised and skipped


def test_squad_v2_rows_thresholds_and_compare(tiny: Path, tmp_path: Path) -> None:
    _squad_folder(tmp_path / "data", "squad_v2", 3, impossible=True, seed=2,
                  files=("train-v2.0.json", "dev-v2.0.json"))
    out = tmp_path / "results.jsonl"
    finetune([f"a={tiny}", f"b={tiny}"], ["squad_v2"], seeds=(0,), epochs=1, batch_size=16,
             max_len=48, data_dir=tmp_path / "data", results=out, device="cpu")
    rows = read_results(out)
    v2 = {r["metric"]: r for r in rows if r["model"] == "a"}
    assert set(v2) == {"em", "f1", "has_ans_em", "has_ans_f1", "no_ans_f1", "best_em", "best_f1"}
    assert "threshold" in v2["best_f1"] and v2["best_f1"]["value"] >= v2["f1"]["value"] - 1e-9
    assert v2["em"]["n_eval"] == len(load_task("squad_v2", "dev", tmp_path / "data"))
    cmp = compare_runs(out)  # the same folder under two names: identical scores, all ties
    assert cmp.n_pairs[0, 1] == 7 and cmp.wins.sum() == 0


def test_bad_file_keeps_results_intact(tiny: Path, tmp_path: Path) -> None:
    folder = _squad_folder(tmp_path / "data", "squad_v1.1", 6)
    path = folder / "dev-v1.1.json"
    path.write_text(path.read_text().replace('"answer_start": ', '"answer_start": 1', 1))
    out = tmp_path / "results.jsonl"
    out.write_text('{"model": "m", "value": 0.5, "task": "cola", "metric": "mcc", "seed": 0, '
                   '"lr": 2e-05, "epochs": 3, "batch_size": 32, "max_len": 128, "n_train": 9}\n')
    before = out.read_bytes()
    with pytest.raises(UserError, match=r"dev-v1.1.json:\d+: question .* fix answer_start"):
        finetune([str(tiny)], ["squad"], seeds=(0,), data_dir=tmp_path / "data", results=out,
                 device="cpu")
    assert out.read_bytes() == before


@pytest.mark.slow
@pytest.mark.skipif(not SHARED_SQUAD.is_file(), reason="shared SQuAD dev file absent")
def test_short_finetune_on_the_shared_squad_file(tmp_path: Path) -> None:
    from mlsm.teacher.teacher import default_teacher_path

    tok = PreTrainedTokenizerFast.from_pretrained(default_teacher_path())
    tok.save_pretrained(tmp_path / "m")
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1,
                         num_attention_heads=2, intermediate_size=64,
                         max_position_embeddings=128)).save_pretrained(tmp_path / "m")
    out = tmp_path / "r.jsonl"
    finetune([str(tmp_path / "m")], ["squad"], seeds=(0,), epochs=1, batch_size=32, max_len=128,
             max_train_examples=64, data_dir=SHARED_SQUAD.parents[1], results=out, device="cpu")
    rows = {r["metric"]: r for r in read_results(out)}
    assert set(rows) == {"em", "f1"} and rows["f1"]["n_eval"] == 1563
    assert rows["f1"]["n_train"] == 64
    assert 0 <= rows["em"]["value"] <= rows["f1"]["value"] <= 1


def test_a_squad_file_beyond_the_json_bound_is_refused_from_its_size(tmp_path: Path,
                                                                      monkeypatch) -> None:
    """A SQuAD file over MAX_JSON_FILE_BYTES is refused from its size, before it is opened
    (sparse here: no disk is used); the check built a gigabyte in memory to refuse it before."""
    from mlsm.errors import UserError
    from mlsm.evaluate.finetune import qa_data
    from mlsm.limits import MAX_JSON_FILE_BYTES

    big = tmp_path / "dev-v1.1.json"
    with open(big, "wb") as fh:
        fh.truncate(MAX_JSON_FILE_BYTES + 1)

    def never(*args, **kwargs):
        raise AssertionError("the file was opened")

    monkeypatch.setattr(qa_data, "open", never, raising=False)
    with pytest.raises(UserError, match="larger than"):
        qa_data.read_squad_json(big)
