"""BEIR-format retrieval data (Thakur et al. 2021): a corpus, queries and qrels per split.

A BEIR folder holds ``corpus.jsonl`` (``_id``, ``title``, ``text``), ``queries.jsonl`` (``_id``,
``text``) and ``qrels/<split>.tsv`` (header ``query-id  corpus-id  score``); each file may also be
gzipped (``.jsonl.gz``, ``.tsv.gz``), and CRLF line ends are read as the BEIR release ships them.
The same layout on the HF Hub (``mteb/<name>``: configs ``corpus``, ``queries`` and ``default``
with one split per qrels file; or ``BeIR/<name>`` + ``BeIR/<name>-qrels``) loads through
``datasets``. Every id a qrels line names must resolve: a bad line is one `UserError` naming the
file, the line and the fix.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlsm.errors import UserError
from mlsm.inputs import bounded_lines, loads
from mlsm.limits import MAX_QRELS_GRADE

Qrels = dict[str, dict[str, int]]  # query id -> {document id: relevance grade}


@dataclass
class BeirSplit:
    """One split of a BEIR dataset: the corpus, the queries its qrels judge, the qrels."""

    doc_ids: list[str]  # corpus order
    doc_texts: list[str]  # "title text" (BEIR's own joining for bi-encoders), same order
    queries: dict[str, str]  # query id -> text, only the queries the qrels name
    qrels: Qrels
    where: str  # the folder or HF dataset it came from, for messages


def _open_text(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line) of a UTF-8 text file, gzipped or not; one line on an unreadable file
    or on a line longer than MAX_DOC_BYTES characters (`inputs.bounded_lines`: read that far
    only, never held whole: a 200 MB document ran the process out of memory)."""
    number = 0
    try:
        for number, line in bounded_lines(path, "a document or query"):
            yield number, line
    except (UnicodeDecodeError, OSError, EOFError, zlib.error) as exc:
        raise UserError(f"{path}:{number + 1} cannot be read as UTF-8 text "
                        f"({' '.join(str(exc).split())}); expected a BEIR file "
                        "(JSON lines or a qrels TSV), gzipped or not") from None


def _find(folder: Path, stem: str, what: str) -> Path:
    for name in (stem, f"{stem}.gz"):
        if (folder / name).is_file():
            return folder / name
    raise UserError(f"{folder}: no {stem} (or {stem}.gz); a BEIR folder holds corpus.jsonl, "
                    f"queries.jsonl and qrels/<split>.tsv; {what}")


def _json_rows(path: Path, fields: tuple[str, ...]) -> Iterator[tuple[int, dict[str, Any]]]:
    for number, line in _open_text(path):
        if not line.strip():
            continue
        try:
            row = loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{number} is not JSON ({exc.msg}); each line must be one "
                            f"JSON object with {', '.join(fields)}") from None
        if not isinstance(row, dict) or any(not isinstance(row.get(k, ""), str) for k in fields) \
                or "_id" not in row:
            raise UserError(f"{path}:{number}: expected a JSON object with text fields "
                            f"{', '.join(fields)} (BEIR format); fix or remove that line")
        yield number, row


def doc_text(row: dict[str, Any]) -> str:
    """A document as one string: title, a space, text (BEIR's joining for dense models)."""
    return f"{row.get('title') or ''} {row.get('text') or ''}".strip()


def _collect(rows: Iterable[tuple[int, dict[str, Any]]], path: str, text: Callable[..., str],
             what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for number, row in rows:
        key = str(row["_id"])
        if key in out:
            raise UserError(f"{path}:{number}: {what} id {key!r} appears twice; "
                            "give every line its own _id")
        out[key] = text(row)
    if not out:
        raise UserError(f"{path}: no {what}s (the file is empty); a BEIR {what} file holds one "
                        "JSON object per line with _id and text; fill it or point at another "
                        "folder")
    return out


def _is_grade(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def _qrels_rows(path: Path) -> Iterator[tuple[int, str, str, int]]:
    """(line, query id, document id, grade) of a qrels TSV; the header line is skipped."""
    for number, line in _open_text(path):
        cols = line.split("\t")
        if not line.strip() or (number == 1 and not _is_grade(cols[-1])):
            continue  # BEIR's header; a first line of ids and a grade is data
        if len(cols) == 4:  # TREC qrels: query, iteration, document, grade
            cols = [cols[0], cols[2], cols[3]]
        grade = int(float(cols[2])) if len(cols) == 3 and _is_grade(cols[2]) else None
        if grade is None:
            raise UserError(f"{path}:{number}: expected 3 tab-separated columns query-id, "
                            f"corpus-id, score (an integer grade), got {line[:80]!r}")
        yield number, cols[0], cols[1], grade


def check_qrels(rows: Iterable[tuple[int, str, str, int]], where: str, docs: set[str] | dict,
                queries: dict[str, str], names: tuple[str, str]) -> Qrels:
    """Qrels from rows, every id checked against the corpus and the queries (names: their files)."""
    qrels: Qrels = {}
    for number, qid, did, grade in rows:
        if qid not in queries:
            raise UserError(f"{where}:{number}: query-id {qid!r} is not in {names[1]}; fix the "
                            f"id, or add that query to {names[1]}")
        if did not in docs:
            raise UserError(f"{where}:{number}: corpus-id {did!r} is not in {names[0]}; fix the "
                            f"id, or add that document to {names[0]}")
        if abs(grade) > MAX_QRELS_GRADE:  # 1e30 died in pytrec_eval's C int (SystemError)
            raise UserError(f"{where}:{number}: grade {grade:.3g} is beyond +-{MAX_QRELS_GRADE:,}"
                            " (mlsm.limits.MAX_QRELS_GRADE; BEIR grades are 0-2); fix that line")
        qrels.setdefault(qid, {})[did] = grade
    if not any(g > 0 for judged in qrels.values() for g in judged.values()):
        raise UserError(f"{where}: no line with a score above 0 (no relevant document); a qrels "
                        "file lists query-id, corpus-id, score > 0 for each relevant pair")
    return qrels


def splits_of(folder: Path) -> list[str]:
    """The qrels splits present in a BEIR folder."""
    qdir = folder / "qrels"
    names = {p.name.split(".")[0] for p in qdir.glob("*.tsv*")} if qdir.is_dir() else set()
    return sorted(names)


def read_beir(folder: str | Path, split: str) -> BeirSplit:
    """One split of a BEIR folder, every qrels id resolved (else one line naming file:line)."""
    folder = Path(folder)
    qdir = folder / "qrels"
    have = splits_of(folder)
    if split not in have:
        raise UserError(f"{qdir}: no {split}.tsv (splits here: {', '.join(have) or 'none'}); "
                        f"add qrels/{split}.tsv, or use the task's _zeroshot form, which needs "
                        "only qrels/test.tsv")
    corpus_path = _find(folder, "corpus.jsonl", "point --data-dir at a BEIR folder")
    query_path = _find(folder, "queries.jsonl", "point --data-dir at a BEIR folder")
    qrels_path = _find(qdir, f"{split}.tsv", "")
    docs_raw = _collect(_json_rows(corpus_path, ("title", "text")), str(corpus_path), doc_text,
                        "document")
    queries = _collect(_json_rows(query_path, ("text",)), str(query_path),
                       lambda r: str(r.get("text") or ""), "query")
    qrels = check_qrels(_qrels_rows(qrels_path), str(qrels_path), docs_raw, queries,
                        (corpus_path.name, query_path.name))
    return BeirSplit(list(docs_raw), list(docs_raw.values()),
                     {q: queries[q] for q in qrels}, qrels, str(folder))


# ----------------------------------------------------------------------------- HF datasets


def _hf_table(path: str, config: str | None, split: str | None) -> Any:
    import datasets  # lazily: only without local files

    ds = datasets.load_dataset(path, config)
    if split is not None:
        return ds[split]
    if len(ds) != 1:  # corpus/queries configs hold one split, named "corpus"/"queries"/"train"
        raise KeyError(f"{path} {config}: {len(ds)} splits, expected one")
    return next(iter(ds.values()))


def _hf_layouts(name: str, split: str) -> list[tuple[Callable[[], Any], ...]]:
    """(corpus, queries, qrels) table loaders per Hub layout, tried in order."""
    return [
        (lambda: _hf_table(f"mteb/{name}", "corpus", None),
         lambda: _hf_table(f"mteb/{name}", "queries", None),
         lambda: _hf_table(f"mteb/{name}", "default", split)),
        (lambda: _hf_table(f"BeIR/{name}", "corpus", None),
         lambda: _hf_table(f"BeIR/{name}", "queries", None),
         lambda: _hf_table(f"BeIR/{name}-qrels", None, split)),
    ]


def from_tables(corpus: Any, queries: Any, qrels: Any, where: str) -> BeirSplit:
    """A split from three row iterables in BEIR columns (HF datasets rows); ids checked."""
    docs = {str(r["_id"]): doc_text(r) for r in corpus}
    if not docs:
        raise UserError(f"{where}: the corpus is empty; expected BEIR rows _id, title, text")
    texts = {str(r["_id"]): str(r.get("text") or "") for r in queries}
    rows = ((i, str(r["query-id"]), str(r["corpus-id"]), int(r["score"]))
            for i, r in enumerate(qrels, 1))
    judged = check_qrels(rows, f"{where} qrels row", docs, texts, ("the corpus", "the queries"))
    return BeirSplit(list(docs), list(docs.values()), {q: texts[q] for q in judged}, judged,
                     where)


def load_beir_hf(name: str, split: str, hub_names: Iterable[str] = ()) -> BeirSplit:
    """One split from the HF Hub: ``mteb/<name>``, then ``BeIR/<name>`` (+ ``-qrels``).

    ``hub_names``: full dataset paths in the mteb layout tried first (e.g. a private copy)."""
    from mlsm.hf import first_line

    layouts = [(lambda p=p: _hf_table(p, "corpus", None), lambda p=p: _hf_table(p, "queries", None),
                lambda p=p: _hf_table(p, "default", split)) for p in hub_names]
    errors = []
    for corpus, queries, qrels in [*layouts, *_hf_layouts(name, split)]:
        try:
            tables = corpus(), queries(), qrels()
        except Exception as exc:  # offline, absent, another layout: try the next one
            errors.append(first_line(exc))
            continue
        return from_tables(*tables, where=f"HF {name} ({split})")
    raise UserError(f"could not load BEIR dataset {name!r} split {split!r} from HF datasets "
                    f"({'; '.join(errors)[:300]}); pass --data-dir with a {name}/ BEIR folder")
