"""Train a WordPiece (BERT-style) or Unigram (SentencePiece-style) tokenizer.

For from-scratch runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import PreTrainedTokenizerFast

from mlsm.artifacts.outputs import OutputKind, guard_output, writing
from mlsm.data.corpus import iter_documents
from mlsm.errors import UserError
from mlsm.fileio import building_dir
from mlsm.inputs import check_apart
from mlsm.limits import MAX_DOC_BYTES

# (unk, cls, sep, pad, mask) for each kind, in the conventions of BERT and of XLM-R/DeBERTa-v3.
_SPECIALS = {
    "wordpiece": ("[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"),
    "unigram": ("<unk>", "<s>", "</s>", "<pad>", "<mask>"),
}


def _backend(kind: str, vocab_size: int, lowercase: bool) -> tuple[Tokenizer, trainers.Trainer]:
    unk, cls, sep, pad, mask = _SPECIALS[kind]
    specials = [pad, unk, cls, sep, mask]
    if kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token=unk))
        tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials)
    else:
        tok = Tokenizer(models.Unigram())
        norm = [normalizers.NFKC()] + ([normalizers.Lowercase()] if lowercase else [])
        tok.normalizer = normalizers.Sequence(norm)
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(
            vocab_size=vocab_size, special_tokens=specials, unk_token=unk
        )
    return tok, trainer


def train_tokenizer(
    sources: str | list[str],
    out: str | Path,
    *,
    kind: str = "wordpiece",
    vocab_size: int = 30522,
    lowercase: bool = False,
    text_field: str = "text",
    max_doc_bytes: int = MAX_DOC_BYTES,
) -> PreTrainedTokenizerFast:
    """Train a tokenizer on the documents of `sources` and save it as an HF folder at `out`;
    a document longer than `max_doc_bytes` is refused."""
    if kind not in _SPECIALS:
        raise UserError(f"tokenizer kind {kind!r} is unknown; use wordpiece or unigram")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not (
            len(_SPECIALS[kind]) < vocab_size < 2**31):
        raise UserError(f"--vocab-size must be a whole number between {len(_SPECIALS[kind]) + 1} "
                        f"and {2**31 - 1}, got {vocab_size!r}; e.g. 30522 (BERT)")
    sources = [sources] if isinstance(sources, str | Path) else list(sources)
    out = Path(out)
    _check_out(out, sources)
    with writing(out, TOKENIZER_KIND):  # one writer: a second one refuses before training
        return _train_and_save(sources, out, kind, vocab_size, lowercase, text_field,
                               max_doc_bytes)


def _train_and_save(sources: list, out: Path, kind: str, vocab_size: int, lowercase: bool,
                    text_field: str, max_doc_bytes: int) -> PreTrainedTokenizerFast:
    """`train_tokenizer` under `out`'s lock: train, then put the folder in place whole."""
    tok, trainer = _backend(kind, vocab_size, lowercase)
    seen = [0]

    def documents() -> Iterator[str]:
        for doc in iter_documents([str(s) for s in sources], text_field, max_doc_bytes):
            seen[0] += 1
            yield doc

    tok.train_from_iterator(documents(), trainer=trainer)
    if not seen[0]:
        raise UserError(f"no text in {', '.join(map(str, sources))}; pass text or .jsonl files "
                        "(for .jsonl, name the field with --text-field)")
    unk, cls, sep, pad, mask = _SPECIALS[kind]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, tok.token_to_id(cls)), (sep, tok.token_to_id(sep))],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token=unk,
        cls_token=cls,
        sep_token=sep,
        pad_token=pad,
        mask_token=mask,
        bos_token=cls if kind == "unigram" else None,
        eos_token=sep if kind == "unigram" else None,
    )
    try:
        with building_dir(out, "tokenizer") as tmp:  # an older tokenizer there is replaced whole
            fast.save_pretrained(tmp)
    except Exception as exc:  # the Rust writer raises a plain Exception ("File too large")
        if isinstance(exc, OSError) and exc.filename is not None:
            raise
        raise UserError(f"could not write tokenizer {out} ({' '.join(str(exc).split())}); free "
                        "space and re-run (an earlier tokenizer there is intact)") from None
    return fast


# What save_pretrained writes into a tokenizer folder: an --out holding anything else is not ours.
_TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "vocab.txt", "added_tokens.json", "chat_template.jinja"}


TOKENIZER_KIND = OutputKind("tokenizer", files=_TOKENIZER_FILES.__contains__,
                            ours=lambda out: (out / "tokenizer_config.json").is_file())


def _check_out(out: Path, sources: list) -> None:
    """Refuse an --out that is a file, lies inside or is a source, or holds files other than a
    tokenizer's (they would be replaced): before the minutes of training."""
    check_apart(out, "--out", {f"source {s}": s for s in sources}, contains=True)
    guard_output(out, TOKENIZER_KIND)
