"""Task registry, metrics (parity with scikit-learn / SciPy / seqeval, and by hand), loaders."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps
from seqeval.metrics import f1_score as seqeval_f1
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

from mlsm.errors import UserError
from mlsm.evaluate.finetune.task_metrics import (
    metric_acc,
    metric_acc_f1,
    metric_entity_f1,
    metric_mcc,
    metric_pearson_spearman,
)
from mlsm.evaluate.finetune.tasks import CONLL_TAGS, TASKS, get_task, load_task

GLUE = Path(__file__).resolve().parents[2] / "shared" / "data" / "glue"


# ----------------------------------------------------------------------------- metrics


def test_metrics_match_references_on_random_data() -> None:
    rng = np.random.default_rng(0)
    for _ in range(5):
        y, p = rng.integers(0, 2, 200), rng.integers(0, 2, 200)
        assert metric_mcc(p, y)["mcc"] == pytest.approx(matthews_corrcoef(y, p))
        assert metric_acc(p, y)["acc"] == pytest.approx(accuracy_score(y, p))
        got = metric_acc_f1(p, y)
        assert got["f1"] == pytest.approx(f1_score(y, p))
        assert got["acc"] == pytest.approx(accuracy_score(y, p))
        a, b = rng.normal(size=100), rng.normal(size=100)
        ps = metric_pearson_spearman(a, b)
        assert ps["pearson"] == pytest.approx(sps.pearsonr(a, b)[0])
        assert ps["spearman"] == pytest.approx(sps.spearmanr(a, b)[0])
    tags = list(CONLL_TAGS)
    gold = [[tags[i] for i in rng.integers(0, 9, 12)] for _ in range(30)]
    pred = [[tags[i] for i in rng.integers(0, 9, 12)] for _ in range(30)]
    assert metric_entity_f1(pred, gold)["f1"] == pytest.approx(seqeval_f1(gold, pred))


def test_metrics_by_hand() -> None:
    # Confusion TP=3, TN=2, FP=1, FN=1: MCC = (3*2 - 1*1) / sqrt(4*4*3*3) = 5/12
    labels = [1, 1, 1, 1, 0, 0, 0]
    preds = [1, 1, 1, 0, 0, 0, 1]
    assert metric_mcc(preds, labels)["mcc"] == pytest.approx(5 / 12)
    # acc 5/7; precision 3/4, recall 3/4 -> F1 3/4
    assert metric_acc_f1(preds, labels) == pytest.approx({"acc": 5 / 7, "f1": 0.75})
    # centred x = (-1, 0, 1), y = (-1, 1, 0): cov 1, both variances 2 -> r = 1/2
    # (ranks equal values)
    assert metric_pearson_spearman([1, 2, 3], [1, 3, 2]) == pytest.approx(
        {"pearson": 0.5, "spearman": 0.5}
    )
    # gold entities PER(0-1), LOC(3); predicted PER(0-1), ORG(3): P = R = 1/2
    gold = [["B-PER", "I-PER", "O", "B-LOC"]]
    pred = [["B-PER", "I-PER", "O", "B-ORG"]]
    assert metric_entity_f1(pred, gold)["f1"] == pytest.approx(0.5)
    assert metric_pearson_spearman([1, 1, 1], [1, 2, 3]) == {"pearson": 0.0, "spearman": 0.0}


def test_registry_is_consistent() -> None:
    assert set(TASKS) == {
        "cola", "sst2", "mrpc", "stsb", "rte", "qnli", "mnli", "qqp", "wic", "wic_lemma",
        "conll2003", "word_order", "squad", "squad_v2", "scifact", "scifact_zeroshot",
    }
    for key, spec in TASKS.items():
        assert spec.name == key
        assert set(spec.eval_splits.values()) <= set(spec.hf_splits)
        # a zero-shot retrieval task has no training split
        assert spec.train_split in spec.hf_splits or (spec.kind == "retrieval"
                                                      and not spec.train_split)
    assert get_task("SST-2") is TASKS["sst2"] and get_task("STS-B") is TASKS["stsb"]
    assert get_task("SQuAD-v2") is TASKS["squad_v2"]
    with pytest.raises(UserError):
        get_task("squad3")


# ------------------------------------------------------------------ fixtures in original formats


def _write(path: Path, lines: list[str], bom: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        ("\ufeff" if bom else "") + "".join(line + "\n" for line in lines), encoding="utf-8"
    )


def _t(*cols: str) -> str:
    return "\t".join(cols)


def test_cola_loader_and_quotes(tmp_path: Path) -> None:
    _write(
        tmp_path / "CoLA" / "train.tsv",
        [_t("gj04", "1", "", 'He said "hi" .'), _t("gj04", "0", "*", '" Bad one .')],
    )
    _write(tmp_path / "CoLA" / "dev.tsv", [_t("cj99", "1", "", "Fine .")])
    train = load_task("cola", "train", tmp_path)
    assert [(e.text, e.label) for e in train] == [('He said "hi" .', 1), ('" Bad one .', 0)]
    assert load_task("cola", "dev", tmp_path / "CoLA")[0].text == "Fine ."
    _write(tmp_path / "bad" / "CoLA" / "train.tsv", [_t("sentence", "label"), _t("x", "1")])
    with pytest.raises(UserError, match="4 tab-separated columns"):
        load_task("cola", "train", tmp_path / "bad")


@pytest.mark.parametrize(
    ("task", "folder", "header", "row", "expect"),
    [
        (
            "sst2", "SST-2", ["sentence", "label"], ["it 's \" good", "1"],
            ("it 's \" good", None, 1),
        ),
        (
            "stsb",
            "STS-B",
            [
                "index", "genre", "filename", "year", "old_index", "source1", "source2",
                "sentence1", "sentence2", "score",
            ],
            ["0", "g", "f", "y", "0", "n", "n", "A b.", "A c.", "3.800"],
            ("A b.", "A c.", 3.8),
        ),
        (
            "rte", "RTE", ["index", "sentence1", "sentence2", "label"],
            ["0", "P .", "H .", "not_entailment"], ("P .", "H .", 1),
        ),
        (
            "qnli", "QNLI", ["index", "question", "sentence", "label"],
            ["0", "Q?", "S.", "entailment"], ("Q?", "S.", 0),
        ),
        (
            "qqp", "QQP", ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"],
            ["0", "1", "2", "Why?", "How?", "1"], ("Why?", "How?", 1),
        ),
    ],
)
def test_glue_header_loaders(
    tmp_path: Path, task: str, folder: str, header: list[str], row: list[str], expect: tuple
) -> None:
    for split in ("train", "dev"):
        _write(tmp_path / folder / f"{split}.tsv", [_t(*header), _t(*row), _t(*row)])
    for split in ("train", "dev"):
        ex = load_task(task, split, tmp_path)
        assert len(ex) == 2 and (ex[0].text, ex[0].text_pair, ex[0].label) == expect


def test_wrong_labels_are_user_errors(tmp_path: Path) -> None:
    _write(
        tmp_path / "STS-B" / "dev.tsv",
        [_t("sentence1", "sentence2", "score"), _t("a", "b", "high")],
    )
    with pytest.raises(UserError, match="not a number"):
        load_task("stsb", "dev", tmp_path)
    _write(
        tmp_path / "RTE" / "dev.tsv",
        [_t("index", "sentence1", "sentence2", "label"), _t("0", "a", "b", "yes")],
    )
    with pytest.raises(UserError, match="not_entailment"):
        load_task("rte", "dev", tmp_path)


def test_mnli_loader_matched_mismatched(tmp_path: Path) -> None:
    header = [
        "index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
        "sentence1_parse", "sentence2_parse", "sentence1", "sentence2", "label1", "gold_label",
    ]
    row = [
        "0", "1", "1e", "fiction", "( a )", "( b )", "(S a)", "(S b)", "P .", "H .", "neutral",
        "neutral",
    ]
    for name in ("train", "dev_matched", "dev_mismatched"):
        _write(tmp_path / "MNLI" / f"{name}.tsv", [_t(*header), _t(*row)])
    assert get_task("mnli").eval_splits == {"m": "dev_matched", "mm": "dev_mismatched"}
    for split in ("train", "dev_matched", "dev_mismatched"):
        assert load_task("mnli", split, tmp_path)[0].label == 1


def _mrpc_rows() -> list[str]:
    head = _t("Quality", "#1 ID", "#2 ID", "#1 String", "#2 String")
    return [
        head,
        _t("1", "11", "12", "A .", '" B .'),
        _t("0", "21", "22", "C .", "D ."),
        _t("1", "31", "32", "E .", "F ."),
    ]


def test_mrpc_loader_all_layouts(tmp_path: Path) -> None:
    rows = _mrpc_rows()
    _write(tmp_path / "glue" / "MRPC" / "train.tsv", rows, bom=True)
    assert [e.label for e in load_task("mrpc", "train", tmp_path / "glue")] == [1, 0, 1]
    # the GLUE download script's split: dev = rows of msr_paraphrase_train.txt listed in dev_ids.tsv
    orig = tmp_path / "raw" / "MRPC" / "original"
    _write(orig / "msr_paraphrase_train.txt", rows, bom=True)
    _write(orig / "dev_ids.tsv", [_t("21", "22")])
    assert [e.text for e in load_task("mrpc", "dev", tmp_path / "raw")] == ["C ."]
    assert [e.text_pair for e in load_task("mrpc", "train", tmp_path / "raw")] == ["\" B .", "F ."]
    # without dev_ids.tsv the only other labelled file is the test set: refuse, never use it as dev
    only = tmp_path / "msr" / "MRPC"
    _write(only / "msr_paraphrase_train.txt", rows)
    _write(only / "msr_paraphrase_test.txt", rows[:2])
    for split in ("dev", "train"):
        with pytest.raises(UserError, match=r"dev_ids\.tsv: missing") as err:
            load_task("mrpc", split, tmp_path / "msr")
        assert "\n" not in str(err.value)
    _write(tmp_path / "bad" / "MRPC" / "train.tsv", [_t("a", "b")])
    with pytest.raises(UserError, match="Quality"):
        load_task("mrpc", "train", tmp_path / "bad")


@pytest.mark.parametrize("nested", [False, True])
def test_wic_loader(tmp_path: Path, nested: bool) -> None:
    base = tmp_path / "WiC" / "dev" if nested else tmp_path / "WiC"
    _write(
        base / "dev.data.txt",
        [
            _t("bank", "N", "3-1", "I sat by the bank .", "The bank lends ."),
            _t("run", "V", "1-0", "I run fast .", "Run away !"),
        ],
    )
    _write(base / "dev.gold.txt", ["F", "T"])
    ex = load_task("wic", "dev", tmp_path)
    assert [e.label for e in ex] == [0, 1]
    # the official finetune_eval.py's input: the two sentences as they are
    assert (ex[0].text, ex[0].text_pair) == ("I sat by the bank .", "The bank lends .")
    lemma = load_task("wic_lemma", "dev", tmp_path)  # ours: the lemma prefixed
    assert [(e.text, e.text_pair, e.label) for e in lemma] == [
        ("bank : I sat by the bank .", "The bank lends .", 0),
        ("run : I run fast .", "Run away !", 1)]
    _write(base / "dev.gold.txt", ["F"])
    with pytest.raises(UserError, match="WiC"):
        load_task("wic", "dev", tmp_path)


CONLL = """-DOCSTART- -X- -X- O

EU NNP B-NP B-ORG
rejects VBZ B-VP O
German JJ B-NP B-MISC
call NN I-NP O

Peter NNP B-NP B-PER
Blackburn NNP I-NP I-PER
"""


@pytest.mark.parametrize("compressed", [False, True])
def test_conll_loader(tmp_path: Path, compressed: bool) -> None:
    folder = tmp_path / "conll2003"
    folder.mkdir()
    if compressed:
        with gzip.open(folder / "valid.txt.gz", "wt", encoding="utf-8") as f:
            f.write(CONLL)
    else:
        (folder / "valid.txt").write_text(CONLL, encoding="utf-8")
    ex = load_task("conll2003", "valid", tmp_path)
    assert [e.text for e in ex] == [["EU", "rejects", "German", "call"], ["Peter", "Blackburn"]]
    assert [[CONLL_TAGS[t] for t in e.label] for e in ex] == [
        ["B-ORG", "O", "B-MISC", "O"],
        ["B-PER", "I-PER"],
    ]
    (folder / "train.txt").write_text("EU B-ORG\n", encoding="utf-8")
    with pytest.raises(UserError, match="token POS chunk NER"):
        load_task("conll2003", "train", tmp_path)


def test_missing_folder_and_subset(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="SST-2"):
        load_task("sst2", "train", tmp_path)
    _write(
        tmp_path / "SST-2" / "train.tsv",
        [_t("sentence", "label")] + [_t(f"s{i}", str(i % 2)) for i in range(50)],
    )
    a = load_task("sst2", "train", tmp_path, max_examples=10)
    b = load_task("sst2", "train", tmp_path, max_examples=10)
    assert a == b and len(a) == 10 and len({e.text for e in a}) == 10
    order = [int(e.text[1:]) for e in a]
    assert order == sorted(order)  # file order kept


# ----------------------------------------------------------------------------- the real GLUE files


@pytest.mark.skipif(not GLUE.is_dir(), reason="shared GLUE data absent")
@pytest.mark.parametrize(
    ("task", "split", "n"),
    [("cola", "train", 8551), ("cola", "dev", 1043), ("sst2", "train", 67349), ("sst2", "dev", 872),
     ("mrpc", "train", 3668), ("mrpc", "dev", 408), ("stsb", "train", 5749), ("stsb", "dev", 1500),
     ("rte", "train", 2490), ("rte", "dev", 277), ("qnli", "dev", 5463)],
)
def test_real_glue_counts(task: str, split: str, n: int) -> None:
    ex = load_task(task, split, GLUE)
    assert len(ex) == n
    assert all(isinstance(e.text, str) and e.text for e in ex)


@pytest.mark.skipif(not (GLUE / "MRPC" / "original").is_dir(), reason="shared GLUE data absent")
def test_real_mrpc_rebuilt_from_msr_matches_glue(tmp_path: Path) -> None:
    orig = tmp_path / "MRPC"
    orig.mkdir()
    for name in ("msr_paraphrase_train.txt", "dev_ids.tsv"):
        (orig / name).write_bytes((GLUE / "MRPC" / "original" / name).read_bytes())
    for split in ("train", "dev"):
        assert load_task("mrpc", split, tmp_path) == load_task("mrpc", split, GLUE)


def test_hf_record_converters() -> None:
    record = {"word": "bank", "sentence1": "A bank .", "sentence2": "The bank .", "label": 1,
              "start1": 2, "end1": 6}
    wic = get_task("wic").from_hf(record)
    assert (wic.text, wic.text_pair, wic.label) == ("A bank .", "The bank .", 1)
    wic = get_task("wic_lemma").from_hf(record)
    assert (wic.text, wic.text_pair, wic.label) == ("bank : A bank .", "The bank .", 1)
    mnli = get_task("mnli").from_hf({"premise": "P", "hypothesis": "H", "label": 2, "idx": 0})
    assert (mnli.text, mnli.text_pair, mnli.label) == ("P", "H", 2)
    ner = get_task("conll2003").from_hf(
        {"tokens": ["EU", "rejects"], "ner_tags": [3, 0], "pos_tags": [1, 2]}
    )
    assert (ner.text, ner.label) == (["EU", "rejects"], [3, 0])
    assert get_task("cola").from_hf({"sentence": "S", "label": 0}).text_pair is None


@pytest.mark.skipif(
    os.environ.get("HF_HUB_OFFLINE") != "1", reason="needs HF_HUB_OFFLINE=1 to fail fast"
)
def test_unreachable_hub_gives_user_error() -> None:
    with pytest.raises(UserError, match="--data-dir"):
        load_task("rte", "dev")
