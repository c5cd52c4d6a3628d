"""Token store: contents, idempotence, streaming, and bad inputs.

Bad inputs give one-line errors and leave nothing behind.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from mlsm.data.corpus import TokenStore, iter_documents, prepare_corpus, tokenizer_hash
from mlsm.errors import UserError

from .helpers import SHARED, make_text


def _leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".partial-" in p.name or ".old-" in p.name]


def test_store_matches_direct_tokenisation(
    corpus_dir: Path, tokenizer_dir: Path, store_dir: Path
) -> None:
    store = TokenStore.open(store_dir)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    docs = list(iter_documents([str(corpus_dir)]))
    assert store.n_docs == len(docs) == 80
    for j in (0, 39, 40, 79):  # both files, both formats
        assert store.document(j).tolist() == tok(docs[j], add_special_tokens=False)["input_ids"]
    assert store.tokens.dtype == np.uint16 and store.offsets[-1] == store.n_tokens
    assert store.tokenizer_hash == tokenizer_hash(store.load_tokenizer()) == tokenizer_hash(tok)


def test_prepare_is_idempotent_and_guards_existing(
    corpus_dir: Path, tokenizer_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "s"
    prepare_corpus(str(corpus_dir / "a.txt"), str(tokenizer_dir), out)
    stamp = (out / "meta.json").stat().st_mtime_ns
    prepare_corpus(str(corpus_dir / "a.txt"), str(tokenizer_dir), out)
    assert (out / "meta.json").stat().st_mtime_ns == stamp  # no-op
    with pytest.raises(UserError, match="--overwrite"):
        prepare_corpus(str(corpus_dir / "b.jsonl.gz"), str(tokenizer_dir), out)
    assert TokenStore.open(out).n_docs == 40  # the old store is intact
    store = prepare_corpus(str(corpus_dir / "b.jsonl.gz"), str(tokenizer_dir), out, overwrite=True)
    assert store.meta["sources"] == [str(corpus_dir / "b.jsonl.gz")]
    assert _leftovers(tmp_path) == []


def test_long_documents_are_not_truncated(tokenizer_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "long.txt").write_text(" ".join(make_text(1, sentences=400)))
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.backend_tokenizer.enable_truncation(16)  # a saved truncation setting must not leak in
    store = prepare_corpus(str(tmp_path / "long.txt"), tok, tmp_path / "s", chunk_docs=1)
    assert store.n_tokens > 2000


def test_glob_and_directory_sources(corpus_dir: Path) -> None:
    assert len(list(iter_documents([str(corpus_dir / "*.txt")]))) == 40
    assert len(list(iter_documents([str(corpus_dir)]))) == 80


def _one_line_error(fn, *args, match: str, **kw) -> str:
    with pytest.raises(UserError, match=match) as info:
        fn(*args, **kw)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_bad_inputs_give_one_line_errors(tokenizer_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "store"
    _one_line_error(
        prepare_corpus, str(tmp_path / "missing.txt"), str(tokenizer_dir), out, match="not found"
    )
    (tmp_path / "empty.txt").write_text("\n\n   \n")
    _one_line_error(
        prepare_corpus, str(tmp_path / "empty.txt"), str(tokenizer_dir), out, match="no text"
    )
    (tmp_path / "bin.txt").write_bytes(b"\x7fELF\x00\x00\x01binary")
    _one_line_error(
        prepare_corpus, str(tmp_path / "bin.txt"), str(tokenizer_dir), out, match="binary"
    )
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    _one_line_error(
        prepare_corpus, str(tmp_path / "latin1.txt"), str(tokenizer_dir), out, match="UTF-8"
    )
    with gzip.open(tmp_path / "bad.jsonl.gz", "wt") as fh:
        fh.write(json.dumps({"body": "no text field"}) + "\n")
    _one_line_error(
        prepare_corpus, str(tmp_path / "bad.jsonl.gz"), str(tokenizer_dir), out, match="text-field"
    )
    assert not out.exists() and _leftovers(tmp_path) == []


def test_tokenizer_without_mask_token(
    corpus_dir: Path, tokenizer_dir: Path, tmp_path: Path
) -> None:
    spec = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    spec.pop("mask_token", None)
    nomask = tmp_path / "nomask"
    nomask.mkdir()
    # rename [MASK] everywhere (vocabulary, added tokens): no transformers version can infer it
    (nomask / "tokenizer.json").write_text(
        (tokenizer_dir / "tokenizer.json").read_text().replace('"[MASK]"', '"[NOMASK]"')
    )
    (nomask / "tokenizer_config.json").write_text(
        json.dumps(spec).replace('"[MASK]"', '"[NOMASK]"')
    )
    tok = AutoTokenizer.from_pretrained(nomask)
    assert tok.mask_token_id is None and "[MASK]" not in tok.get_vocab()
    msg = _one_line_error(
        prepare_corpus, str(corpus_dir), str(nomask), tmp_path / "s", match="mask token"
    )
    assert "train-tokenizer" in msg
    assert not (tmp_path / "s").exists()


def test_interrupted_prepare_leaves_no_store(
    corpus_dir: Path, tokenizer_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    import mlsm.data.corpus as corpus

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(corpus.PreTrainedTokenizerBase, "save_pretrained", boom)
    with pytest.raises(KeyboardInterrupt):
        prepare_corpus(str(corpus_dir), str(tokenizer_dir), tmp_path / "s")
    assert not (tmp_path / "s").exists() and _leftovers(tmp_path) == []


@pytest.mark.skipif(not (SHARED / "corpus").is_dir(), reason="shared corpus not present")
def test_real_corpus_valid_split(tmp_path: Path) -> None:
    from mlsm.teacher.teacher import default_teacher_path

    path = SHARED / "corpus" / "enwiki_2015_prefix" / "valid.jsonl.gz"
    store = prepare_corpus(str(path), str(default_teacher_path()), tmp_path / "s")
    assert store.n_docs == 48 and store.n_tokens > 150_000


@pytest.mark.parametrize("num_proc, n", [(1, 1), (1, 37), (2, 37), (2, 80), (2, 500)])
def test_max_docs_keeps_the_first_documents_of_the_whole_store(
    corpus_dir: Path, tokenizer_dir: Path, store_dir: Path, tmp_path: Path, num_proc: int, n: int
) -> None:
    """`--max-docs N` is the whole store's first N documents, token for token (a cut inside a
    unit, across files, with workers, or past the corpus' end), under its own fingerprint; the
    store without a limit keeps its fingerprint."""
    whole = TokenStore.open(store_dir)
    part = prepare_corpus(str(corpus_dir), str(tokenizer_dir), tmp_path / "s", chunk_docs=8,
                          num_proc=num_proc, max_docs=n)
    kept = min(n, whole.n_docs)
    assert part.n_docs == kept and part.n_tokens == whole.offsets[kept]
    assert np.array_equal(part.tokens, whole.tokens[:whole.offsets[kept]])
    assert np.array_equal(part.offsets, whole.offsets[:kept + 1])
    assert part.meta["fingerprint"] != whole.meta["fingerprint"] and "max_docs" not in whole.meta


def test_max_docs_never_reads_past_its_documents(corpus_dir: Path, tokenizer_dir: Path,
                                                 tmp_path: Path) -> None:
    """The rest of the corpus is not read: a damaged file after the first N documents does not
    stop `--max-docs N` (the whole corpus is refused on it)."""
    broken = tmp_path / "z.txt.gz"
    broken.write_bytes(gzip.compress(("a sentence .\n\n" * 50).encode())[:-20])  # truncated
    sources = [str(corpus_dir / "a.txt"), str(broken)]
    with pytest.raises(UserError, match="damaged or truncated"):
        prepare_corpus(sources, str(tokenizer_dir), tmp_path / "all", num_proc=1)
    part = prepare_corpus(sources, str(tokenizer_dir), tmp_path / "s", chunk_docs=8,
                          num_proc=1, max_docs=12)
    assert part.n_docs == 12
