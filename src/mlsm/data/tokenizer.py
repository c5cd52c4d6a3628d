"""Train a WordPiece (BERT-style) or Unigram (SentencePiece-style) tokenizer.

For from-scratch runs.
"""

from __future__ import annotations

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

from mlsm.data.corpus import iter_documents
from mlsm.errors import UserError

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
) -> PreTrainedTokenizerFast:
    """Train a tokenizer on the documents of `sources` and save it as an HF folder at `out`."""
    if kind not in _SPECIALS:
        raise UserError(f"tokenizer kind {kind!r} is unknown; use wordpiece or unigram")
    sources = [sources] if isinstance(sources, str) else list(sources)
    tok, trainer = _backend(kind, vocab_size, lowercase)
    tok.train_from_iterator(iter_documents(sources, text_field), trainer=trainer)
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
    fast.save_pretrained(out)
    return fast
