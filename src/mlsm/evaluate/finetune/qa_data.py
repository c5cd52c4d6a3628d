"""SQuAD data: the official JSON files, HF ``squad`` / ``squad_v2`` rows, and the by-article
split of a dev file used when no training file is at hand (the CPU-scale protocol).

Official format (v1.1 and v2.0)::

    {"version": ..., "data": [{"title": ..., "paragraphs": [{"context": ...,
        "qas": [{"id": ..., "question": ..., "answers": [{"text": ..., "answer_start": ...}],
                 "is_impossible": ...}]}]}]}

``is_impossible`` exists in v2.0 only; an unanswerable question has no ``answers`` (the v2.0
dev file keeps the would-be spans in ``plausible_answers``, which are not gold answers).
Every answer must sit at its offset: ``context[answer_start:answer_start + len(text)] == text``.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import sys
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlsm.errors import UserError
from mlsm.inputs import loads
from mlsm.limits import MAX_DOC_BYTES, MAX_JSON_FILE_BYTES

# The CPU-scale protocol (docs/finetune.md, "Extractive QA"): with only a dev file, an article
# goes to the evaluation part when the hash of its title falls below this fraction, else to the
# training part. A title decides alone, so the split of an article never depends on the others.
EVAL_FRACTION = 0.25
SPLIT_SALT = "mlsm-squad-article-split-v1"


@dataclass(frozen=True)
class QAExample:
    """One question on one context.

    ``answers``: gold (text, character start) pairs, empty for an unanswerable (v2.0) question.
    """

    qid: str
    title: str
    question: str
    context: str
    answers: tuple[tuple[str, int], ...]

    @property
    def answer_texts(self) -> list[str]:
        return [t for t, _ in self.answers]


def _where(path: Path | str, raw: str, qid: str) -> str:
    """``FILE:LINE`` of the question's id in the raw text (``FILE`` when not found)."""
    pos = raw.find(json.dumps(qid))
    return f"{path}:{raw.count(chr(10), 0, pos) + 1}" if pos >= 0 else str(path)


def check_answer(ex: QAExample, where: Callable[[], str]) -> None:
    """One line naming the place (``where()``, computed on failure only) and the fix when an
    answer is not at its offset."""
    for text, start in ex.answers:
        found = ex.context[start:start + len(text)] if start >= 0 else ""
        if found != text or not text:
            at = ex.context.find(text) if text else -1
            hint = f" (the text is at {at})" if at >= 0 else " (the text is not in the context)"
            raise UserError(
                f"{where()}: question {ex.qid}: answer {text!r} is not at answer_start {start} of "
                f"its context, which holds {found!r} there{hint}; fix answer_start (a character "
                "offset into the context) or the answer text")


def _read_raw(path: Path) -> str:
    """The whole file, at most MAX_JSON_FILE_BYTES (checked before it is read; gzipped: as it
    is decompressed, so a small .gz of gigabytes stops at the bound)."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        data = b""
        too_big = path.suffix != ".gz" and path.stat().st_size > MAX_JSON_FILE_BYTES
        if not too_big:  # a plain file's size says it before a byte is read
            with opener(path, "rb") as f:
                data = f.read(MAX_JSON_FILE_BYTES + 1)
            too_big = len(data) > MAX_JSON_FILE_BYTES
        if too_big:
            raise UserError(f"{path} is larger than {MAX_JSON_FILE_BYTES:,} bytes (the bound of "
                            "a JSON file read whole, mlsm.limits.MAX_JSON_FILE_BYTES); an "
                            "official SQuAD file is 30-40 MB: split it, or point --data-dir at "
                            "the official files")
        return data.decode("utf-8")
    except (UnicodeDecodeError, OSError, EOFError, zlib.error) as exc:
        raise UserError(f"{path} is not a SQuAD JSON file ({' '.join(str(exc).split())}); "
                        "point --data-dir at the official train/dev JSON files") from None


_SHAPE = ('expected the official SQuAD JSON {"data": [{"title", "paragraphs": [{"context", '
          '"qas": [{"id", "question", "answers": [{"text", "answer_start"}]}]}]}]}')


def _field(obj: Any, key: str, kind: type, path: Path, at: str) -> Any:
    value = obj.get(key) if isinstance(obj, dict) else None
    if not isinstance(value, kind) or isinstance(value, bool):
        got = "missing" if value is None else type(value).__name__
        raise UserError(f"{path}: {at}{key} is {got}, not {kind.__name__}; {_SHAPE}")
    return value


def _bounded(text: str, path: Path, what: str) -> str:
    """`text` when it is at most MAX_DOC_BYTES characters (a 20 MB context ran the tokeniser's
    windows out of memory), else one line with the limit."""
    if len(text) > MAX_DOC_BYTES:
        raise UserError(f"{path}: {what} is {len(text):,} characters, more than the "
                        f"{MAX_DOC_BYTES:,} a document may hold (mlsm.limits.MAX_DOC_BYTES); "
                        "split it into paragraphs of their own")
    return text


def _question(qa: Any, title: str, context: str, path: Path, raw: str) -> QAExample:
    qid = _field(qa, "id", str, path, f"a question of {title!r}: ")
    answers = []
    for ans in _field(qa, "answers", list, path, f"question {qid}: "):
        text = _field(ans, "text", str, path, f"question {qid}: answer ")
        answers.append((text, _field(ans, "answer_start", int, path, f"question {qid}: answer ")))
    if qa.get("is_impossible") and answers:
        raise UserError(f"{_where(path, raw, qid)}: question {qid} is_impossible but has "
                        "answers; an unanswerable question has \"answers\": [] (spans go in "
                        "plausible_answers)")
    question = _bounded(_field(qa, "question", str, path, f"question {qid}: "), path,
                        f"question {qid}")
    ex = QAExample(qid, title, question, context,
                   tuple(answers))
    check_answer(ex, lambda: _where(path, raw, qid))
    return ex


def read_squad_json(path: str | Path) -> list[QAExample]:
    """Every question of an official SQuAD JSON file (``.json`` or ``.json.gz``), file order."""
    path = Path(path)
    raw = _read_raw(path)
    try:
        doc = loads(raw)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}:{exc.lineno} is not JSON ({exc.msg}, column {exc.colno}); "
                        "point --data-dir at the official SQuAD JSON files") from None
    out: list[QAExample] = []
    for article in _field(doc, "data", list, path, ""):
        title = str(_field(article, "title", str, path, "an article: "))
        for para in _field(article, "paragraphs", list, path, f"article {title!r}: "):
            context = _bounded(_field(para, "context", str, path, f"a paragraph of {title!r}: "),
                               path, f"a context of {title!r}")
            qas = _field(para, "qas", list, path, f"a paragraph of {title!r}: ")
            out.extend(_question(qa, title, context, path, raw) for qa in qas)
    seen: set[str] = set()
    for ex in out:
        if ex.qid in seen:
            raise UserError(f"{_where(path, raw, ex.qid)}: question id {ex.qid} is used twice; "
                            "give every question its own id")
        seen.add(ex.qid)
    return out


def from_hf_row(row: dict[str, Any]) -> QAExample:
    """A row of HF ``squad`` / ``squad_v2``: answers as {"text": [...], "answer_start": [...]}."""
    ans = row["answers"]
    ex = QAExample(str(row["id"]), str(row.get("title", "")), row["question"], row["context"],
                   tuple(zip(ans["text"], (int(s) for s in ans["answer_start"]), strict=True)))
    check_answer(ex, lambda: f"HF row {ex.qid}")
    return ex


# ----------------------------------------------------------------------------- the split


def in_eval_part(title: str) -> bool:
    """Whether the article titled ``title`` belongs to the evaluation part of the protocol."""
    digest = hashlib.sha256(f"{SPLIT_SALT}|{title}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < EVAL_FRACTION


def split_by_article(examples: Sequence[QAExample], part: str) -> list[QAExample]:
    """The ``"train"`` or ``"dev"`` part of one file's questions, whole articles on each side."""
    keep = [ex for ex in examples if in_eval_part(ex.title) == (part == "dev")]
    other = [ex for ex in examples if in_eval_part(ex.title) != (part == "dev")]
    if not keep or not other:
        raise UserError(f"the by-article split of {len({e.title for e in examples})} article(s) "
                        "leaves one part empty; add articles to the dev file or give a "
                        "training file (train-*.json) beside it")
    return keep


# ----------------------------------------------------------------------------- task readers


def _files(version: str, split: str) -> tuple[str, ...]:
    names = (f"{split}-v{version}.json", f"{split}.json")
    return tuple(n + ext for n in names for ext in ("", ".gz"))


def _first(folder: Path, names: Sequence[str]) -> Path | None:
    return next((folder / n for n in names if (folder / n).is_file()), None)


def squad_reader(version: str):
    """The reader of task folders holding ``train-v{version}.json`` and ``dev-v{version}.json``
    (``.gz`` too; or ``train.json`` / ``dev.json``). Without a training file the dev file is
    split by article: split ``"train"`` is the training part, ``"dev"`` the evaluation part."""

    def read(folder: Path, split: str) -> list[QAExample]:
        dev = _first(folder, _files(version, "dev"))
        train = _first(folder, _files(version, "train"))
        path = train if split == "train" else dev
        if path is not None and (split == "train" or train is not None):
            return _checked(read_squad_json(path), version, path)
        if dev is None:
            raise UserError(f"{folder}: no {' or '.join(_files(version, split)[:2])} found; "
                            f"expected the official SQuAD v{version} JSON files")
        if split == "train":
            print(f"mlsm: note: {folder}: no training file; training on the by-article split of "
                  f"{dev.name} ({1 - EVAL_FRACTION:.0%} of articles), evaluating on the rest "
                  "(docs/finetune.md, Extractive QA)", file=sys.stderr)
        return split_by_article(_checked(read_squad_json(dev), version, dev), split)

    return read


def _checked(examples: list[QAExample], version: str, path: Path) -> list[QAExample]:
    """SQuAD 1.1 has an answer for every question: an unanswerable one means v2.0 data."""
    if version == "1.1":
        bad = next((ex for ex in examples if not ex.answers), None)
        if bad is not None:
            raise UserError(f"{path}: question {bad.qid} has no answer, as in SQuAD 2.0; use "
                            "task squad_v2 for this file")
    return examples
