"""Fine-tuning: identical heads and data order across backbones, word alignment, tiny
end-to-end runs."""

from __future__ import annotations

import json
import random
from pathlib import Path

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
from transformers import (
    BertConfig,
    BertModel,
    DistilBertConfig,
    DistilBertModel,
    PreTrainedTokenizerFast,
)

from mlsm.artifacts.results_file import read_results
from mlsm.errors import UserError
from mlsm.evaluate.compare.stats import compare_runs
from mlsm.evaluate.finetune.finetune import finetune, resolve_model, training_order
from mlsm.evaluate.finetune.task_cell import build_head, encode, load_tokenizer, predict
from mlsm.evaluate.finetune.tasks import CONLL_TAGS, Example, get_task, load_task

POS = ["great", "wonderful", "superb", "lovely"]
NEG = ["awful", "terrible", "boring", "dreadful"]
FILLER = [
    "the", "movie", "was", "a", "film", "with", "actors", "and", "plot", "it", "had", "some",
    "scenes",
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _tokenizer(folder: Path) -> PreTrainedTokenizerFast:
    """A WordPiece tokenizer trained on the fixture words only, so unseen words split into
    pieces."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    alphabet = list("abcdefghijklmnopqrstuvwxyz")
    text = " ".join(FILLER + POS + NEG + ["peter", "eu", "german", "rejects", "call"])
    tok.train_from_iterator(
        [text] * 5,
        trainers.WordPieceTrainer(
            vocab_size=120, special_tokens=specials, initial_alphabet=alphabet
        ),
    )
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    fast.save_pretrained(folder)
    return fast


def _bert(folder: Path, seed: int = 0, meta: dict | None = None) -> Path:
    tok = _tokenizer(folder)
    torch.manual_seed(seed)
    cfg = BertConfig(
        vocab_size=len(tok),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    BertModel(cfg).save_pretrained(folder)
    if meta is not None:
        (folder / "checkpoint.json").write_text(json.dumps(meta), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tiny")
    return _bert(
        root / "bert", meta={"step": 100, "readiness": 0.5, "objective": "mlm", "run": "r1"}
    )


def _keyword_sst2(root: Path, n_train: int = 240, n_dev: int = 80) -> Path:
    """SST-2-format folder whose label is decided by one keyword (positive or negative word)."""
    rng = random.Random(0)
    folder = root / "SST-2"
    folder.mkdir(parents=True)
    for split, n in (("train", n_train), ("dev", n_dev)):
        lines = ["sentence\tlabel"]
        for _ in range(n):
            label = rng.randint(0, 1)
            words = rng.sample(FILLER, 6)
            words.insert(rng.randrange(7), rng.choice(POS if label else NEG))
            lines.append(f"{' '.join(words)} \t{label}")
        (folder / f"{split}.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


def test_head_init_identical_across_backbones() -> None:
    spec = get_task("sst2")
    torch.manual_seed(1)
    bert = BertModel(
        BertConfig(
            vocab_size=50,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
        )
    )
    head_a = build_head(spec, bert.config.hidden_size, seed=3)
    torch.manual_seed(2)
    distil = DistilBertModel(
        DistilBertConfig(vocab_size=70, dim=32, n_layers=1, n_heads=2, hidden_dim=48)
    )
    torch.randn(1000)  # global RNG state must not matter
    head_b = build_head(spec, distil.config.hidden_size, seed=3)
    sa, sb = head_a.state_dict(), head_b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(
        sa["out.weight"], build_head(spec, 32, seed=4).state_dict()["out.weight"]
    )
    other_task = build_head(get_task("cola"), 32, seed=3).state_dict()["out.weight"]
    assert not torch.equal(sa["out.weight"], other_task)
    assert abs(float(sa["dense.weight"].std()) - 0.02) < 0.003
    ner = build_head(get_task("conll2003"), 32, seed=3)
    assert ner.dense is None and ner.out.weight.shape == (len(CONLL_TAGS), 32)


def test_training_order_depends_on_seed_and_task_only() -> None:
    a = training_order(50, seed=0, task="sst2", epochs=3)
    torch.manual_seed(123)
    assert training_order(50, seed=0, task="sst2", epochs=3) == a
    assert sorted(a[0]) == list(range(50)) and a[0] != a[1]
    assert training_order(50, seed=1, task="sst2", epochs=3) != a


def test_resolve_model_reads_checkpoint_json(tiny: Path, tmp_path: Path) -> None:
    ref = resolve_model(tiny)
    assert (ref.name, ref.step, ref.readiness, ref.objective, ref.run) == (
        "r1@step-100", 100, 0.5, "mlm", "r1",
    )
    assert resolve_model(f"mine={tiny}").name == "mine"
    with pytest.raises(UserError, match="config.json"):
        resolve_model(tmp_path)


def test_token_alignment_and_truncation(tiny: Path) -> None:
    spec = get_task("conll2003")
    tok = load_tokenizer(str(tiny), spec)
    words = ["Peter", "Blackburn", "rejects", "Zyxwv", "call", "EU"]
    ex = Example(words, None, [1, 2, 0, 7, 0, 3])
    (feat,) = encode(tok, spec, [ex], max_len=64)
    word_ids = tok(words, is_split_into_words=True).word_ids()
    assert len(word_ids) > len(words) + 2  # some words really split into several pieces
    for pos, (lab, w) in enumerate(zip(feat["label"], word_ids, strict=True)):
        first = w is not None and (pos == 0 or word_ids[pos - 1] != w)
        assert lab == (ex.label[w] if first else -100)
    assert feat["words"] == list(range(len(words)))
    # Truncated to 5 positions: the words that fell off are predicted "O" and still scored.
    backbone = BertModel.from_pretrained(tiny)
    head = build_head(spec, 32, seed=0)
    (short,) = encode(tok, spec, [ex], max_len=5)
    (pred,) = predict(backbone, head, tok, spec, [short], [ex], torch.device("cpu"))
    assert len(pred) == len(words) and set(pred[len(short["words"]):]) == {"O"}


def test_finetune_beats_chance_pairs_and_resumes(tiny: Path, tmp_path: Path) -> None:
    data = _keyword_sst2(tmp_path / "data")
    results = tmp_path / "results.jsonl"
    kwargs = {"seeds": (0,), "lrs": (2e-3,), "epochs": 4, "batch_size": 8, "data_dir": data,
              "results": results, "device": "cpu"}
    finetune([f"a={tiny}", f"b={tiny}"], ["sst2"], **kwargs)
    rows = read_results(results)
    assert [(r["model"], r["metric"], r["seed"], r["n_train"], r["n_eval"]) for r in rows] == [
        ("a", "acc", 0, 240, 80), ("b", "acc", 0, 240, 80)]
    assert rows[0]["value"] > 0.8  # chance is ~0.5; the keyword decides the label
    assert rows[0]["value"] == rows[1]["value"]  # same backbone + seed -> the very same run
    assert (rows[0]["step"], rows[0]["readiness"], rows[0]["run"]) == (100, 0.5, "r1")
    before = results.read_bytes()
    finetune([f"a={tiny}"], ["sst2"], **kwargs)  # finished cell: skipped
    assert results.read_bytes() == before
    cmp = compare_runs(results)
    assert cmp.pvalues[0, 1] == 1.0 and cmp.wins[0, 1] == 0 and cmp.n_pairs[0, 1] == 1


def _small_fixtures(root: Path) -> Path:
    stsb = root / "STS-B"
    stsb.mkdir(parents=True)
    head = "\t".join(["index", "genre", "filename", "year", "old_index", "source1", "source2",
                      "sentence1", "sentence2", "score"])
    rows = [
        f"{i}\tg\tf\ty\t{i}\tn\tn\tthe movie was great\tthe film was {w}\t{s}"
        for i, (w, s) in enumerate(
            [("great", "5.0"), ("awful", "0.5"), ("lovely", "4.2"), ("boring", "1.0")] * 3
        )
    ]
    for split in ("train", "dev"):
        (stsb / f"{split}.tsv").write_text("\n".join([head, *rows]) + "\n", encoding="utf-8")
    conll = root / "conll2003"
    conll.mkdir()
    text = (
        "-DOCSTART- -X- -X- O\n\nEU NNP B-NP B-ORG\nrejects VBZ B-VP O\nGerman JJ B-NP B-MISC\n\n"
        "Peter NNP B-NP B-PER\nBlackburn NNP I-NP I-PER\n\n"
    )
    for split in ("train", "valid"):
        (conll / f"{split}.txt").write_text(text * 3, encoding="utf-8")
    mnli = root / "MNLI"
    mnli.mkdir()
    pairs = [
        ("the film was great", "it was great", "entailment"),
        ("the plot was boring", "it was lovely", "contradiction"),
        ("the actors had scenes", "the movie was long", "neutral"),
    ]
    for name, n in (("train", 3), ("dev_matched", 2), ("dev_mismatched", 1)):
        lines = ["index\tsentence1\tsentence2\tgold_label"] + [
            f"{i}\t{a}\t{b}\t{y}" for i, (a, b, y) in enumerate(pairs[:n])
        ]
        (mnli / f"{name}.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


def test_regression_and_token_tasks_run(tiny: Path, tmp_path: Path) -> None:
    data = _small_fixtures(tmp_path / "data")
    results = tmp_path / "r.jsonl"
    finetune(
        [tiny],
        ["stsb", "conll2003", "mnli"],
        seeds=(0,),
        epochs=1,
        batch_size=4,
        data_dir=data,
        results=results,
        device="cpu",
        max_train_examples=8,
    )
    rows = read_results(results)
    assert [(r["task"], r["metric"], r["n_train"], r["n_eval"]) for r in rows] == [
        ("stsb", "pearson", 8, 12), ("stsb", "spearman", 8, 12), ("conll2003", "f1", 6, 6),
        ("mnli", "acc_m", 3, 2), ("mnli", "acc_mm", 3, 1)]  # evaluation sets stay complete
    assert all(-1.0 <= r["value"] <= 1.0 for r in rows)
    assert rows[4]["value"] in (0.0, 1.0)
    assert len(load_task("stsb", "dev", data)) == 12


def test_predict_keeps_order_and_ignores_padding(tiny: Path) -> None:
    spec = get_task("stsb")  # regression: raw floats make order or padding mistakes visible
    tok = load_tokenizer(str(tiny), spec)
    texts = [
        "great", "the movie was a film with actors and plot", "awful plot",
        "it had some scenes it had",
    ]
    examples = [Example(t, "the film", 0.0) for t in texts]
    feats = encode(tok, spec, examples, max_len=64)
    backbone = BertModel.from_pretrained(tiny)
    head = build_head(spec, 32, seed=0)
    together = predict(
        backbone, head, tok, spec, feats, examples, torch.device("cpu"), batch_size=4
    )
    alone = [
        predict(backbone, head, tok, spec, [f], [e], torch.device("cpu"))[0]
        for f, e in zip(feats, examples, strict=True)
    ]
    assert together == pytest.approx(alone, abs=1e-5)
    assert len(set(together)) == len(texts)


def test_checkpoint_json_from_a_run_and_bad_json(tmp_path: Path) -> None:
    folder = _bert(
        tmp_path / "runs" / "mlsm-a" / "checkpoints" / "step-0000050",
        meta={
            "step": 50,
            "readiness": 0.25,
            "objective": "mlsm",
            "run": str(tmp_path / "runs" / "mlsm-a"),
        },
    )
    assert resolve_model(folder).name == "mlsm-a@step-50"
    (folder / "checkpoint.json").write_text("{step: 50", encoding="utf-8")
    with pytest.raises(UserError, match="checkpoint.json"):
        resolve_model(folder)


def test_fidelity_options_fixed_order_clip_and_conll_test(
    tiny: Path, tmp_path: Path, monkeypatch
) -> None:
    """The Hitchhikers' Guide §4.2 / the official fine-tuning script: one data order for every seed
    (only the head differs), optional clipping, CoNLL-2003 scored on test as well as valid."""
    import mlsm.evaluate.finetune.task_cell as ft

    data = _small_fixtures(tmp_path / "data")
    conll = data / "conll2003"
    (conll / "test.txt").write_text(
        "-DOCSTART- -X- -X- O\n\nEU NNP B-NP B-ORG\nrejects VBZ B-VP O\n\n", encoding="utf-8"
    )
    seen: list[list[str]] = []
    clips: list[float] = []
    real_collate, real_clip = ft.collate, torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(
        ft,
        "collate",
        lambda tok, spec, feats, dev: (
            seen.append([str((f["inputs"]["input_ids"], f["label"])) for f in feats]),
            real_collate(tok, spec, feats, dev),
        )[1],
    )
    monkeypatch.setattr(
        torch.nn.utils, "clip_grad_norm_", lambda p, c: (clips.append(c), real_clip(p, c))[1]
    )

    def orders(**kw) -> list[list[list[str]]]:
        out = []
        for seed in (1, 2):
            seen.clear()
            finetune(
                [tiny],
                ["stsb"],
                seeds=(seed,),
                epochs=1,
                batch_size=4,
                data_dir=data,
                device="cpu",
                results=tmp_path / f"o{seed}{sorted(kw)}.jsonl",
                **kw,
            )
            out.append(
                [b for b in seen if len(b) == 4][:3]
            )  # training batches (eval batches are 64)
        return out

    a, b = orders(fixed_order=True, clip=0.0)
    assert a == b and not clips  # same order for every seed; no clipping
    a, b = orders()
    assert a != b and clips and set(clips) == {1.0}  # default: per-seed order, clip 1.0
    results = tmp_path / "conll.jsonl"
    finetune(
        [tiny],
        ["conll2003"],
        seeds=(0,),
        epochs=1,
        batch_size=4,
        data_dir=data,
        results=results,
        device="cpu",
        eval_test=True,
    )
    rows = read_results(results)
    assert [(r["metric"], r["n_eval"]) for r in rows] == [("f1", 6), ("f1_test", 1)]
