"""`mlsm score`: PLL per sentence and pseudo-perplexity (PPPL) of a corpus.

PLL(W) = Σ_t log P(w_t | W with w_t masked)                  (Salazar et al. 2020, §2, Eq. 2)
PPPL(C) = exp(−(1/N) Σ_{W ∈ C} PLL(W)), N = the scored tokens of C      (Salazar et al. 2020, §2.3)

The scoring itself is `mlsm.evaluate.zeroshot.pll` (batched masked copies, head at the masked
position
only); this module reads the inputs with bounded memory, cuts long ones to a token budget, and
writes the per-sentence JSON lines, the summary and (optionally) a results row.

Inputs:
- a text file (.txt, .txt.gz): one sentence per non-blank line;
- JSON lines (.jsonl, .jsonl.gz): one sentence per line in a text field;
- a token store (`mlsm prepare`): its documents cut into consecutive chunks of at most
  `max_tokens` store tokens (the last chunk of a document shorter), each scored as one
  sequence — by its ids, without re-tokenising, so the model's tokenizer must be the store's.

Bounds: a line is read at most `max_tokens × CHARS_PER_TOKEN` characters at a time (the rest of
an over-long line is skipped, never held), and a sentence longer than `max_tokens` tokens is cut
to its first `max_tokens` tokens at a word boundary; such rows carry ``"truncated": true`` and one
warning line counts them.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from mlsm.errors import UserError
from mlsm.evaluate.zeroshot.pll import VARIANTS, score_token_ids
from mlsm.fileio import atomic_write, atomic_write_json
from mlsm.inputs import bounded_byte_lines, loads
from mlsm.limits import MAX_ROW_BYTES

CHARS_PER_TOKEN = 32  # a line is read at most max_tokens × this many characters (memory bound)
READ_CHARS = 1 << 20  # the skipped tail of an over-long line is read this much at a time
TASK_PREFIX = "pppl:"  # results rows of `--results`: task "pppl:<input name>@<content digest>"
TASK_DIGEST = 12  # hex digits of the input's content digest in the task name
RESULT_METRIC = "neg_log_pppl"  # −log PPPL = Σ PLL / N: higher is better, as compare assumes


@dataclass
class Scored:
    """One scored unit: the token ids (no special tokens), word index per token (or None), and
    where it came from (``line`` of a text file, or ``doc``/``start`` of a token store)."""

    ids: list[int]
    words: list[int] | None
    where: dict[str, int]
    text: str
    truncated: bool = False


@dataclass
class ScoreResult:
    """Per-sentence rows and the corpus summary of one `score_corpus` call."""

    rows: list[dict[str, Any]]
    summary: dict[str, Any] = field(default_factory=dict)


def pppl(plls: list[float], n_tokens: list[int]) -> float:
    """Pseudo-perplexity of a corpus: exp(−Σ PLL / Σ n) (Salazar et al. 2020, §2.3); NaN
    without a scored token."""
    total = sum(n_tokens)
    return math.exp(-math.fsum(plls) / total) if total else math.nan


# --------------------------------------------------------------------------- reading


def _open_text(path: Path) -> TextIO:
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")  # noqa: SIM115 - closed by the caller's `with`


def _bounded_lines(f: TextIO, max_chars: int) -> Iterator[tuple[int, str, bool]]:
    """(line number, at most `max_chars` characters of the line, whether it was longer). The
    tail of a longer line is read in READ_CHARS pieces and dropped: memory stays bounded."""
    number = 0
    while True:
        head = f.readline(max_chars + 1)
        if not head:
            return
        number += 1
        cut = len(head) > max_chars and not head.endswith("\n")
        if cut:
            while (tail := f.readline(READ_CHARS)) and not tail.endswith("\n"):
                pass
            head = head[:max_chars]
            space = head.rfind(" ")  # do not end inside a word
            head = head[:space] if space > 0 else head
        yield number, head.rstrip("\r\n"), cut


def read_sentences(path: str | Path, *, text_field: str = "text", limit: int | None = None,
                   max_chars: int = 1 << 16) -> Iterator[tuple[int, str, bool]]:
    """(line number, sentence, cut) of each non-blank line of a .txt(.gz) or .jsonl(.gz) file,
    at most `limit` of them; each sentence at most `max_chars` characters (`cut` when longer)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"input {p} not found: pass a .txt/.jsonl file (gzipped or not) or a "
                        "token store folder")
    jsonl = ".jsonl" in p.name or p.name.endswith((".json", ".json.gz"))
    n = 0
    try:
        with _open_text(p) as f:
            for number, line, cut in _bounded_lines(f, max_chars):
                if limit is not None and n >= limit:
                    return
                if jsonl and line.strip():
                    line = _json_text(p, number, line, cut, text_field)
                if line.strip():
                    n += 1
                    yield number, line.strip(), cut
    except (UnicodeDecodeError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise UserError(f"{p} is not readable UTF-8 text ({type(exc).__name__}); pass a .txt or "
                        ".jsonl file, gzipped or not") from None


def _json_text(path: Path, number: int, line: str, cut: bool, text_field: str) -> str:
    if cut:
        raise UserError(f"{path}:{number} is a JSON line longer than the read bound; raise "
                        "--max-tokens or split that record")
    try:
        row = loads(line)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}:{number} is not JSON ({exc.msg}); one JSON object per line, "
                        f"the sentence in field {text_field!r}") from None
    text = row.get(text_field) if isinstance(row, dict) else None
    if not isinstance(text, str):
        raise UserError(f"{path}:{number} has no text field {text_field!r}; pass --text-field "
                        "NAME")
    return text


def tokenize_sentences(tokenizer: Any, lines: Iterator[tuple[int, str, bool]], max_tokens: int,
                       with_words: bool) -> list[Scored]:
    """Tokenise without special tokens; cut at `max_tokens` tokens, dropping a word the cut would
    split (when word boundaries are known)."""
    out = []
    for number, text, cut in lines:
        enc = tokenizer(text, add_special_tokens=False, truncation=True,
                        max_length=max_tokens + 1)
        ids = enc["input_ids"]
        words = enc.word_ids() if getattr(tokenizer, "is_fast", False) else None
        if len(ids) > max_tokens:
            cut, keep = True, max_tokens
            if words is not None and words[max_tokens] is not None:
                while keep > 1 and words[keep - 1] == words[max_tokens]:
                    keep -= 1  # the split word's first pieces go too
            ids = ids[:keep]
            words = None if words is None else words[:keep]
        word_index = None if words is None or not with_words else [
            -1 if w is None else w for w in words]
        out.append(Scored(ids, word_index, {"line": number}, text, cut))
    return out


def store_chunks(store: Any, max_tokens: int, limit: int | None) -> Iterator[Scored]:
    """Consecutive chunks of at most `max_tokens` tokens of each document of a token store."""
    n = 0
    for doc in range(store.n_docs):
        ids = store.document(doc)
        for start in range(0, len(ids), max_tokens):
            if limit is not None and n >= limit:
                return
            n += 1
            chunk = [int(t) for t in ids[start:start + max_tokens]]
            yield Scored(chunk, None, {"doc": doc, "start": start}, "")


# --------------------------------------------------------------------------- scoring


def default_max_tokens(model: Any, tokenizer: Any) -> int:
    """The longest sequence the model takes, less the tokenizer's special tokens."""
    from mlsm.evaluate.zeroshot.pll import _model_max_len, as_scorer

    limit = _model_max_len(tokenizer, as_scorer(model)) or 512
    return max(1, limit - tokenizer.num_special_tokens_to_add())


def load_inputs(source: str | Path, tokenizer: Any, *, variant: str, max_tokens: int,
                text_field: str = "text", limit: int | None = None) -> list[Scored]:
    """The sequences to score from a text/JSON-lines file or a token store (module docstring)."""
    path = Path(source)
    if path.is_dir():
        from mlsm.data.corpus import TokenStore, require_same_tokenizer

        if variant != "original":
            raise UserError(f"--variant {variant} needs word boundaries, which a token store "
                            "does not keep; score a text file, or use --variant original")
        store = TokenStore.open(path)
        require_same_tokenizer(tokenizer, store.tokenizer_hash, str(path))
        seqs = list(store_chunks(store, max_tokens, limit))
        for s in seqs:
            s.text = tokenizer.decode(s.ids)
        return seqs
    lines = read_sentences(path, text_field=text_field, limit=limit,
                           max_chars=max_tokens * CHARS_PER_TOKEN)
    if variant == "within_word_l2r" and not getattr(tokenizer, "is_fast", False):
        raise UserError("--variant within_word_l2r needs word boundaries: the model's folder "
                        "must hold a fast tokenizer (tokenizer.json)")
    return tokenize_sentences(tokenizer, lines, max_tokens, variant == "within_word_l2r")


def score_corpus(model: Any, tokenizer: Any, source: str | Path, *, variant: str = "original",
                 max_tokens: int | None = None, text_field: str = "text",
                 limit: int | None = None, token_budget: int = 8192,
                 device: Any = None, progress: bool | None = False) -> ScoreResult:
    """PLL of every sentence (or store chunk) of `source` and the corpus PPPL.

    model, tokenizer: as `score_pll` takes them (`load_scorer` gives both for any checkpoint).
    max_tokens: longest sentence in tokens, without special tokens (default: the model's limit);
    longer ones are cut. Rows: {text, pll, n_tokens, truncated, line | doc+start}.
    """
    if variant not in VARIANTS:
        raise UserError(f"unknown PLL variant {variant!r}: use one of {', '.join(VARIANTS)}")
    ceiling = default_max_tokens(model, tokenizer)
    if max_tokens is not None and max_tokens > ceiling:
        raise UserError(f"--max-tokens {max_tokens} is more than the model takes ({ceiling} "
                        "without special tokens); lower it")
    cap = max_tokens or ceiling
    seqs = [s for s in load_inputs(source, tokenizer, variant=variant, max_tokens=cap,
                                   text_field=text_field, limit=limit) if s.ids]
    if not seqs:
        raise UserError(f"{source}: nothing to score (no non-blank line or token)")
    terms = score_token_ids(model, tokenizer, [s.ids for s in seqs],
                            words=[s.words for s in seqs] if variant != "original" else None,
                            variant=variant, token_budget=token_budget, device=device,
                            progress=progress)  # type: ignore[arg-type]
    rows = [{**s.where, "text": s.text, "pll": float(t.sum()), "n_tokens": len(t),
             "truncated": s.truncated} for s, t in zip(seqs, terms, strict=True)]
    plls, counts = [r["pll"] for r in rows], [r["n_tokens"] for r in rows]
    value = pppl(plls, counts)
    summary = {"input": str(source), "input_sha256": input_digest(source), "variant": variant,
               "max_tokens": cap,
               "n_sentences": len(rows), "n_tokens": sum(counts),
               "n_truncated": sum(r["truncated"] for r in rows), "pppl": value,
               "neg_log_pppl": -math.log(value), "mean_pll": math.fsum(plls) / len(rows),
               "unit": "store chunks" if Path(source).is_dir() else "lines"}
    return ScoreResult(rows, summary)


# --------------------------------------------------------------------------- writing


def summary_path(out: str | Path) -> Path:
    """Where the summary of `--out FILE.jsonl` goes: FILE.summary.json beside it."""
    p = Path(out)
    stem = p.name[: -len(".jsonl")] if p.name.endswith(".jsonl") else p.name
    return p.with_name(f"{stem}.summary.json")


def write_scores(result: ScoreResult, out: str | Path) -> dict[str, Path]:
    """The rows as JSON lines at `out`, then the summary beside it, as one unit: the summary is
    the manifest, written last, and records the rows' sha256 (`rows_sha256`). The old summary is
    removed before the rows are replaced, so after a kill at any point there is either no
    summary or one that matches the rows (`read_scores` requires it); a rerun repairs."""
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in result.rows)
    summary = {**result.summary, "rows_sha256": hashlib.sha256(text.encode()).hexdigest()}
    summary_path(out).unlink(missing_ok=True)
    atomic_write(out, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    atomic_write_json(summary_path(out), summary)
    return {"scores": Path(out), "summary": summary_path(out)}


def read_scores(out: str | Path) -> ScoreResult:
    """The rows and summary `write_scores` wrote at `out`; one line when they are not one
    unit (a run killed while writing them, or one file of another run)."""
    out = Path(out)
    fix = f"run the same `mlsm score ... --out {out}` again: it rewrites both"
    try:  # the rows are hashed as a stream and read line by line, each line bounded
        with out.open("rb") as fh:
            digest = hashlib.file_digest(fh, "sha256").hexdigest()
        summary = loads(summary_path(out).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"the scores at {out} have no readable summary beside them "
                        f"({type(exc).__name__}): a run was stopped while writing them; {fix}"
                        ) from None
    if not isinstance(summary, dict) or summary.get("rows_sha256") != digest:
        raise UserError(f"{out} and {summary_path(out).name} are of different runs (the rows' "
                        f"digest is not the summary's rows_sha256); {fix}")
    rows = []
    for number, line in bounded_byte_lines(out, "a row of scores", MAX_ROW_BYTES,
                                           "mlsm.limits.MAX_ROW_BYTES"):
        if not line:
            continue
        try:
            row = loads(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            row = None
        if not isinstance(row, dict):  # edited together with the summary's digest
            raise UserError(f"{out}:{number} is not a row of scores; {fix}")
        rows.append(row)
    return ScoreResult(rows, summary)


def input_digest(source: str | Path) -> str:
    """What the scores were computed on, by content: the file's sha256, or a token store's
    `folder_fingerprint` (its files by name and content)."""
    from mlsm.artifacts.fingerprint import content_digest, folder_fingerprint

    path = Path(source)
    return folder_fingerprint(path) if path.is_dir() else content_digest(path)


def results_row(result: ScoreResult, model: str, name: str) -> dict[str, Any]:
    """A `results.jsonl` row that `compare`/`report` read: task "pppl:<input name>@<digest>"
    (keyed by the input's content: two files of one name are two tasks, never paired), metric
    RESULT_METRIC (−log PPPL, higher is better; compare shows it ×100), one seed, lr 0
    (nothing was fine-tuned)."""
    s = result.summary
    task = (TASK_PREFIX + Path(str(s["input"]).rstrip("/")).name.replace("|", "_") + "@"
            + s["input_sha256"][:TASK_DIGEST])
    return {"model": name, "path": model, "task": task, "metric": RESULT_METRIC,
            "value": s["neg_log_pppl"], "pppl": s["pppl"], "variant": s["variant"],
            "seed": 0, "lr": 0.0, "epochs": None, "batch_size": None,
            "max_len": s["max_tokens"], "n_train": None, "n_eval": s["n_sentences"],
            "n_tokens": s["n_tokens"]}


def warn_truncated(result: ScoreResult, file: TextIO = sys.stderr) -> None:
    n = result.summary["n_truncated"]
    if n:
        print(f"mlsm score: warning: {n} of {result.summary['n_sentences']} sentences were longer "
              f"than --max-tokens {result.summary['max_tokens']} and were cut (rows marked "
              "truncated)", file=file)
