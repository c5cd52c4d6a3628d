"""Fine-tuning tasks: one registry entry per task, loaders for local files and HF datasets (the
metrics are `mlsm.evaluate.finetune.task_metrics`).

The task list and metrics follow the evaluation protocol of the *Hitchhikers' Guide to Masked Latent
Semantic Modeling* (anonymous, under review; §4.2): GLUE + WiC + CoNLL-2003. Local files are read in
their *original distributed* formats:

- GLUE TSVs (``glue_data/<TASK>/``): tab separated, ``csv.QUOTE_NONE`` because sentences contain
  bare quote characters; CoLA train/dev have no header, every other file has one.
- WiC (Pilehvar & Camacho-Collados 2019): ``<split>.data.txt`` + ``<split>.gold.txt``.
- CoNLL-2003 (Tjong Kim Sang & De Meulder 2003): one ``token POS chunk NER`` line per token.

GLUE test sets are unlabeled, so every task is scored on its dev split(s).
"""

from __future__ import annotations

import csv
import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from mlsm.errors import UserError
from mlsm.evaluate.finetune import qa
from mlsm.evaluate.finetune.qa_data import from_hf_row, squad_reader
from mlsm.evaluate.finetune.task_metrics import (
    metric_acc,
    metric_acc_f1,
    metric_entity_f1,
    metric_mcc,
    metric_pearson_spearman,
)
from mlsm.inputs import bounded_lines, read_text


@dataclass(frozen=True)
class Example:
    """One example. ``text`` is a string, or a list of words for token tasks (CoNLL).

    ``label`` is a class id (classification), a float (regression) or one tag id per word.
    """

    text: str | list[str]
    text_pair: str | None
    label: int | float | list[int]


# (task folder, split) -> examples (QA tasks: `qa_data.QAExample`s)
Reader = Callable[[Path, str], list[Any]]


# ----------------------------------------------------------------------------- file readers


def read_tsv(path: Path) -> list[list[str]]:
    """All rows of a GLUE TSV (BOM stripped; quotes are literal characters)."""
    try:  # each line read up to MAX_DOC_BYTES only (a line of 100 MB of tabs: 100M fields)
        lines = (line for _, line in bounded_lines(path, "a TSV row", encoding="utf-8-sig"))
        return list(csv.reader(lines, delimiter="\t", quoting=csv.QUOTE_NONE))
    except UnicodeDecodeError as exc:
        raise UserError(f"{path} is not UTF-8 text (byte {exc.start}); expected a GLUE TSV "
                        "file, point --data-dir at the GLUE folders") from None
    except csv.Error as exc:  # a NUL byte, a field beyond csv's size limit
        raise UserError(f"{path} is not a TSV table ({exc}); expected a GLUE TSV file, point "
                        "--data-dir at the GLUE folders") from None


def _find(folder: Path, names: Sequence[str], what: str) -> Path:
    for name in names:
        if (folder / name).is_file():
            return folder / name
    raise UserError(f"{folder}: no {' or '.join(names)} found; expected {what}")


def _label_id(value: str, labels: tuple[str, ...], path: Path) -> int:
    if value not in labels:
        raise UserError(f"{path}: label {value!r} is not one of {list(labels)}; "
                        "is this the right task folder?")
    return labels.index(value)


def _score(value: str, path: Path) -> float:
    """An STS-B similarity score, 0 to 5 (float() also takes "nan", "inf" and 1e300, which
    trained on a NaN loss and appended NaN results without a word)."""
    try:
        score = float(value)
    except ValueError:
        score = math.nan
    if not 0 <= score <= 5:
        raise UserError(f"{path}: score {value!r} is not a number from 0 to 5; "
                        "expected the STS-B score column (0-5)")
    return score


def _glue_reader(
    files: dict[str, tuple[str, ...]], a: str, b: str | None, y: str, labels: tuple[str, ...]
) -> Reader:
    """Reader for a GLUE TSV with a header: columns named ``a``, ``b`` (optional), label ``y``."""

    def read(folder: Path, split: str) -> list[Example]:
        path = _find(folder, files[split], f"a GLUE TSV with header columns {[a, b, y]}")
        rows = read_tsv(path)
        head = rows[0] if rows else []
        missing = [c for c in (a, b, y) if c is not None and c not in head]
        if missing:
            raise UserError(f"{path}: header lacks columns {missing}; "
                            f"expected GLUE TSV columns {[a, b, y]}")
        ia, iy = head.index(a), head.index(y)
        ib = head.index(b) if b is not None else None
        out = []
        for row in rows[1:]:
            if len(row) != len(head):
                raise UserError(f"{path}: a row has {len(row)} fields, header has {len(head)}; "
                                "expected the original GLUE TSV")
            lab = _score(row[iy], path) if not labels else _label_id(row[iy], labels, path)
            out.append(Example(row[ia], row[ib] if ib is not None else None, lab))
        return out

    return read


def _read_cola(folder: Path, split: str) -> list[Example]:
    """CoLA train/dev: no header; columns source, label, original mark, sentence."""
    path = _find(folder, (f"{split}.tsv",),
                 "CoLA TSVs without header: source, label, mark, sentence")
    out = []
    for row in read_tsv(path):
        if len(row) != 4 or row[1] not in ("0", "1"):
            raise UserError(f"{path}: expected 4 tab-separated columns "
                            "(source, label 0/1, mark, sentence) and no header")
        out.append(Example(row[3], None, int(row[1])))
    return out


def _mrpc_rows(path: Path) -> list[list[str]]:
    rows = read_tsv(path)
    if not rows or rows[0][:3] != ["Quality", "#1 ID", "#2 ID"] or any(len(r) != 5 for r in rows):
        raise UserError(f"{path}: expected MRPC columns "
                        "Quality, #1 ID, #2 ID, #1 String, #2 String")
    return rows[1:]


def _mrpc_source(folder: Path, split: str) -> tuple[Path, Callable[[list[str]], bool]]:
    """The file holding ``split`` and a filter on its rows (GLUE TSV, else msr_paraphrase_*.txt)."""
    if (folder / f"{split}.tsv").is_file():
        return folder / f"{split}.tsv", lambda r: True
    src = next((d for d in (folder, folder / "original")
                if (d / "msr_paraphrase_train.txt").is_file()), None)
    if src is None:
        raise UserError(f"{folder}: expected MRPC train.tsv/dev.tsv or "
                        "original/msr_paraphrase_train.txt (+ dev_ids.tsv)")
    if (src / "dev_ids.tsv").is_file():
        dev = {tuple(r[:2]) for r in read_tsv(src / "dev_ids.tsv") if len(r) >= 2}
        return (src / "msr_paraphrase_train.txt",
                lambda r: (tuple(r[1:3]) in dev) == (split == "dev"))
    # Without the GLUE split the only other labelled file is the 1,725-pair TEST set: using it as
    # dev (or all of msr_paraphrase_train.txt as train) would silently change what is measured.
    raise UserError(f"{src / 'dev_ids.tsv'}: missing; MRPC's GLUE dev split needs it "
                    "(else dev would be the test set): copy dev_ids.tsv from the GLUE download "
                    "next to msr_paraphrase_train.txt, or use GLUE's train.tsv/dev.tsv")


def _read_mrpc(folder: Path, split: str) -> list[Example]:
    """MRPC from GLUE's train.tsv/dev.tsv, else rebuilt from ``msr_paraphrase_*.txt``.

    GLUE's dev is the part of msr_paraphrase_train.txt whose id pair is in dev_ids.tsv (the GLUE
    download script does the same split); without dev_ids.tsv the loader refuses (the only other
    labelled file, msr_paraphrase_test.txt, is the test set).
    """
    path, keep = _mrpc_source(folder, split)
    return [Example(r[3], r[4], _label_id(r[0], _B, path)) for r in _mrpc_rows(path) if keep(r)]


def _wic_text(word: str, s1: str, lemma: bool) -> str:
    # `wic`: sentence 1 as it is, paired with sentence 2 (the official finetune_eval.py);
    # `wic_lemma` (ours): the target lemma prefixed, so the head on the first token sees which
    # word is asked about (the same for every backbone).
    return f"{word} : {s1}" if lemma else s1


def _read_wic(folder: Path, split: str, lemma: bool = False) -> list[Example]:
    """WiC: ``<split>.data.txt`` (lemma, N/V, "i-j", sentence 1, sentence 2).

    Plus ``<split>.gold.txt`` (T/F). lemma: prefix sentence 1 with "<lemma> : " (`wic_lemma`).
    """
    what = f"WiC files {split}.data.txt and {split}.gold.txt"
    base = folder / split if (folder / split / f"{split}.data.txt").is_file() else folder
    data = _find(base, (f"{split}.data.txt",), what)
    gold = _find(base, (f"{split}.gold.txt",), what)
    rows = read_tsv(data)
    text = read_text(gold, "WiC gold file", "point --data-dir at the WiC folder")
    golds = [g.strip() for g in text.splitlines() if g.strip()]
    if len(rows) != len(golds) or any(len(r) != 5 or r[1] not in ("N", "V") for r in rows):
        raise UserError(f"{data}: expected 5 tab-separated WiC columns (lemma, N/V, i-j, s1, s2), "
                        "one T/F gold line per row")
    return [Example(_wic_text(r[0], r[3], lemma), r[4], _label_id(g, ("F", "T"), gold))
            for r, g in zip(rows, golds, strict=True)]


# HF order
CONLL_TAGS = ("O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC")


def _conll_lines(path: Path) -> list[str]:
    try:  # each line read up to MAX_DOC_BYTES only
        return [line for _, line in bounded_lines(path, "a CoNLL line")]
    except (UnicodeDecodeError, OSError, EOFError, zlib.error) as exc:  # OSError: BadGzipFile
        raise UserError(f"{path} is not CoNLL text ({' '.join(str(exc).split())}); point "
                        "--data-dir at the conll2003 folder") from None


def _read_conll(folder: Path, split: str) -> list[Example]:
    """CoNLL-2003: ``token POS chunk NER`` per line, -DOCSTART- lines.

    A blank line between sentences.
    """
    names = {"train": ("train",), "valid": ("valid", "dev", "testa"),
             "test": ("test", "testb")}[split]
    path = _find(folder, [f"{n}{ext}" for n in names for ext in (".txt", ".txt.gz", "")],
                 "CoNLL-2003 files train/valid/test(.txt|.txt.gz)")
    out: list[Example] = []
    words: list[str] = []
    tags: list[int] = []
    for line in [*_conll_lines(path), ""]:
        cols = line.split()
        if cols and cols[0] != "-DOCSTART-":
            if len(cols) != 4:
                raise UserError(f"{path}: expected 4 space-separated columns "
                                f"(token POS chunk NER) per line, got {line!r}")
            words.append(cols[0])
            tags.append(_label_id(cols[3], CONLL_TAGS, path))
        elif words:
            out.append(Example(words, None, tags))
            words, tags = [], []
    return out


# ----------------------------------------------------------------------------- HF converters


def _hf_pair(a: str, b: str | None) -> Callable[[dict[str, Any]], Example]:
    return lambda r: Example(r[a], r[b] if b else None, r["label"])


def _hf_wic(r: dict[str, Any], lemma: bool = False) -> Example:
    return Example(_wic_text(r["word"], r["sentence1"], lemma), r["sentence2"], int(r["label"]))


def _hf_conll(r: dict[str, Any]) -> Example:
    return Example(list(r["tokens"]), None, [int(t) for t in r["ner_tags"]])


# ----------------------------------------------------------------------------- registry

_WIC_FOLDERS = ("WiC", "wic", "WiC_dataset")
_WIC_HF = (("aps/super_glue", "wic"), ("super_glue", "wic"))


@dataclass(frozen=True)
class TaskSpec:
    """Everything task-specific; the fine-tuning code reads only these fields."""

    name: str
    # "cls" (first-token classification), "reg" (regression), "token" (per-word tags),
    # "qa" (extractive QA: start/end logits per token, `mlsm.evaluate.finetune.qa`)
    # "retrieval" (a BEIR folder: bi-encoder, mlsm.evaluate.finetune.retrieval_cell)
    kind: str
    labels: tuple[str, ...]  # label names by id; empty for regression
    metric: Callable[..., dict[str, float]]
    folders: tuple[str, ...]  # folder names tried under data_dir
    read: Reader
    hf: tuple[tuple[str, str | None], ...]  # HF datasets (path, config) candidates, tried in order
    from_hf: Callable[[dict[str, Any]], Any]
    hf_splits: dict[str, str]  # our split -> HF split
    # metric suffix -> split
    eval_splits: dict[str, str] = field(default_factory=lambda: {"": "dev"})
    train_split: str = "train"
    # a labelled test split scored with `eval_test` (CoNLL-2003; the official finetune_eval.py
    # scores its validation split only)
    test_split: str = ""
    # (predictions, examples) -> {metric: extra fields of its result row} (SQuAD 2.0 thresholds)
    row_extras: Callable[..., dict[str, dict[str, Any]]] | None = None
    # QA: a question may have no answer (SQuAD 2.0), so decoding may answer "" when the null
    # ([CLS]) score wins; False (SQuAD 1.1): always the best span
    unanswerable: bool = False

    @property
    def num_outputs(self) -> int:
        return 1 if self.kind == "reg" else len(self.labels)


_B = ("0", "1")
_NLI2 = ("entailment", "not_entailment")
_GLUE_SPLITS = {"train": "train", "dev": "validation"}
_GT = {"train": ("train.tsv",), "dev": ("dev.tsv",)}
_SQUAD_SPLITS = {"train": "train", "dev": "validation"}


def _glue(config: str) -> tuple[tuple[str, str | None], ...]:
    # The Hub's parquet copy first; the old script name works with older `datasets` versions.
    return (("nyu-mll/glue", config), ("glue", config))


def _scored_elsewhere(*_: Any) -> dict[str, float]:
    raise UserError("a retrieval task is scored by mlsm.evaluate.finetune.retrieval.ir_metrics")


def _not_examples(folder: Path, split: str) -> list[Example]:
    raise UserError(f"{folder}: a retrieval task has no examples to load; fine-tune it with "
                    "`mlsm finetune` or read it with mlsm.evaluate.finetune.beir.read_beir")


def retrieval_task(name: str) -> TaskSpec:
    """A BEIR retrieval task: fine-tune on qrels/train, score on qrels/test (metrics
    mlsm.evaluate.finetune.retrieval.METRICS); NAME_zeroshot: score the checkpoint as it is."""
    zero = name.lower().endswith("_zeroshot")
    base = name[:-len("_zeroshot")] if zero else name
    hub = ((base, None),) if "/" in base else ()  # an HF dataset path in the BEIR layout
    folders = (base, base.lower()) if base != base.lower() else (base,)
    full = name if name in ("scifact", "scifact_zeroshot") else f"beir:{name}"
    return TaskSpec(full, "retrieval", (), _scored_elsewhere, folders, _not_examples, hub,
                    _hf_pair("text", None), {"train": "train", "test": "test"},
                    eval_splits={"": "test"}, train_split="" if zero else "train")


TASKS: dict[str, TaskSpec] = {
    "cola": TaskSpec("cola", "cls", _B, metric_mcc, ("CoLA", "cola"), _read_cola,
                     _glue("cola"), _hf_pair("sentence", None), _GLUE_SPLITS),
    "sst2": TaskSpec("sst2", "cls", _B, metric_acc, ("SST-2", "sst2", "sst-2"),
                     _glue_reader(_GT, "sentence", None, "label", _B),
                     _glue("sst2"), _hf_pair("sentence", None), _GLUE_SPLITS),
    "mrpc": TaskSpec("mrpc", "cls", _B, metric_acc_f1, ("MRPC", "mrpc"), _read_mrpc,
                     _glue("mrpc"), _hf_pair("sentence1", "sentence2"), _GLUE_SPLITS),
    "stsb": TaskSpec("stsb", "reg", (), metric_pearson_spearman, ("STS-B", "stsb", "sts-b"),
                     _glue_reader(_GT, "sentence1", "sentence2", "score", ()),
                     _glue("stsb"), _hf_pair("sentence1", "sentence2"), _GLUE_SPLITS),
    "rte": TaskSpec("rte", "cls", _NLI2, metric_acc, ("RTE", "rte"),
                    _glue_reader(_GT, "sentence1", "sentence2", "label", _NLI2),
                    _glue("rte"), _hf_pair("sentence1", "sentence2"), _GLUE_SPLITS),
    "qnli": TaskSpec("qnli", "cls", _NLI2, metric_acc, ("QNLI", "qnli"),
                     _glue_reader(_GT, "question", "sentence", "label", _NLI2),
                     _glue("qnli"), _hf_pair("question", "sentence"), _GLUE_SPLITS),
    "mnli": TaskSpec("mnli", "cls", ("entailment", "neutral", "contradiction"), metric_acc,
                     ("MNLI", "mnli"),
                     _glue_reader({"train": ("train.tsv",), "dev_matched": ("dev_matched.tsv",),
                                   "dev_mismatched": ("dev_mismatched.tsv",)},
                                  "sentence1", "sentence2", "gold_label",
                                  ("entailment", "neutral", "contradiction")),
                     _glue("mnli"), _hf_pair("premise", "hypothesis"),
                     {"train": "train", "dev_matched": "validation_matched",
                      "dev_mismatched": "validation_mismatched"},
                     eval_splits={"m": "dev_matched", "mm": "dev_mismatched"}),
    "qqp": TaskSpec("qqp", "cls", _B, metric_acc_f1, ("QQP", "qqp"),
                    _glue_reader(_GT, "question1", "question2", "is_duplicate", _B),
                    _glue("qqp"), _hf_pair("question1", "question2"), _GLUE_SPLITS),
    "wic": TaskSpec("wic", "cls", ("F", "T"), metric_acc, _WIC_FOLDERS, _read_wic, _WIC_HF,
                    _hf_wic, _GLUE_SPLITS),
    # ours: sentence 1 prefixed with "<lemma> : " (the official code gives the pair as it is)
    "wic_lemma": TaskSpec("wic_lemma", "cls", ("F", "T"), metric_acc, _WIC_FOLDERS,
                          partial(_read_wic, lemma=True), _WIC_HF,
                          partial(_hf_wic, lemma=True), _GLUE_SPLITS),
    # made by `mlsm demo` from held-out prose when no GLUE data is at hand: original vs
    # word-shuffled
    "word_order": TaskSpec("word_order", "cls", _B, metric_acc, ("WordOrder", "word_order"),
                           _glue_reader(_GT, "sentence", None, "label", _B), (),
                           _hf_pair("sentence", None), _GLUE_SPLITS),
    "conll2003": TaskSpec("conll2003", "token", CONLL_TAGS, metric_entity_f1,
                          ("conll2003", "CoNLL-2003", "conll"), _read_conll,
                          (("eriktks/conll2003", None), ("conll2003", None)), _hf_conll,
                          {"train": "train", "valid": "validation", "test": "test"},
                          eval_splits={"": "valid"}, test_split="test"),
    # SQuAD v1.1 / v2.0 (Rajpurkar et al. 2016, 2018): official JSON files, or the by-article
    # split of a lone dev file (docs/finetune.md, "Extractive QA")
    "squad": TaskSpec("squad", "qa", ("start", "end"), qa.score_v1,
                      ("squad_v1.1", "squad", "SQuAD", "squad1.1", "SQuAD1.1", "squad_v1"),
                      squad_reader("1.1"), (("rajpurkar/squad", None), ("squad", None)),
                      from_hf_row, _SQUAD_SPLITS),
    "squad_v2": TaskSpec("squad_v2", "qa", ("start", "end"), qa.score_v2,
                         ("squad_v2", "squad_v2.0", "SQuAD2.0", "squad2.0", "SQuAD-v2"),
                         squad_reader("2.0"), (("rajpurkar/squad_v2", None), ("squad_v2", None)),
                         from_hf_row, _SQUAD_SPLITS, row_extras=qa.thresholds_v2,
                         unanswerable=True),
    # BEIR SciFact (Wadden et al. 2020; Thakur et al. 2021): dense retrieval, nDCG@10 on test
    "scifact": retrieval_task("scifact"),
    "scifact_zeroshot": retrieval_task("scifact_zeroshot"),
}


def get_task(name: str) -> TaskSpec:
    """The registry entry for ``name`` (case-insensitive; "sst-2" and "sts-b" work too).

    ``beir:NAME`` is any BEIR-format retrieval dataset (folder NAME under --data-dir, else HF
    ``mteb/NAME`` or ``BeIR/NAME``; a NAME with a "/" is an HF dataset path); a ``_zeroshot``
    suffix evaluates it without fine-tuning."""
    if name.lower().startswith("beir:") and len(name) > 5:
        return retrieval_task(name[5:])
    key = name.lower().replace("-", "")
    key = {"squadv2": "squad_v2", "squad2": "squad_v2", "squad_v1": "squad"}.get(key, key)
    if key not in TASKS:
        raise UserError(f"unknown task {name!r}; choose from {', '.join(TASKS)} or beir:NAME "
                        "(a BEIR retrieval folder or HF dataset)")
    return TASKS[key]


def task_folder(spec: TaskSpec, data_dir: str | Path) -> Path:
    """The folder holding ``spec``'s files: ``data_dir/<TASK>``, ``data_dir`` itself, or
    ``data_dir/<any>/<TASK>`` (so ``--data-dir ../shared/data`` finds ``glue/CoLA`` and
    ``scifact`` in one grid)."""
    root = Path(data_dir)
    if root.is_file():  # e.g. dev-v1.1.json.gz itself: readers take the folder and pick its files
        raise UserError(f"--data-dir {root} is a file; pass the folder that holds it "
                        f"(--data-dir {root.parent})")
    for name in spec.folders:
        if (root / name).is_dir():
            return root / name
    if root.is_dir() and root.name in spec.folders:
        return root
    subs = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    for name in spec.folders:
        for sub in subs:
            if (sub / name).is_dir():
                return sub / name
    raise UserError(f"{root}: no folder {' or '.join(spec.folders)} for task {spec.name}; "
                    "point --data-dir at the folder that holds it")


def _load_hf(spec: TaskSpec, split: str) -> list[Example]:
    import datasets  # imported lazily: only needed when no local files are given

    from mlsm.hf import first_line

    errors = []
    for path, config in spec.hf:
        try:
            ds = datasets.load_dataset(path, config, split=spec.hf_splits[split])
        except Exception as exc:  # offline, moved dataset, unsupported script: try the next name
            errors.append(f"{path}: {first_line(exc)}")
            continue
        return [spec.from_hf(r) for r in ds]
    raise UserError(
        f"could not load task {spec.name} from HF datasets ({'; '.join(errors)}); pass --data-dir "
        f"with a {spec.folders[0]}/ folder in the original format"
    )


def load_task(
    name: str, split: str, data_dir: str | Path | None = None, max_examples: int | None = None
) -> list[Example]:
    """Examples of one split: from local files under ``data_dir``, else from HF ``datasets``.

    ``max_examples`` keeps a random subset of n examples in file order, drawn with a fixed seed
    so that every model and every fine-tuning seed sees the same subset (use it for training sets).
    """
    spec = get_task(name)
    if split not in spec.hf_splits:
        raise UserError(f"task {spec.name} has splits {list(spec.hf_splits)}, not {split!r}")
    if data_dir is None:
        examples = _load_hf(spec, split)
    else:
        examples = spec.read(task_folder(spec, data_dir), split)
    if not examples:
        raise UserError(f"task {spec.name}: split {split!r} is empty; check the data files")
    if max_examples is None or max_examples >= len(examples):
        return examples
    keep = np.sort(np.random.default_rng(0).choice(len(examples), size=max_examples, replace=False))
    return [examples[i] for i in keep]
