"""`mlsm <verb>`: argument wiring only; every verb calls a library function."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from mlsm.errors import UserError


def _prepare(a: argparse.Namespace) -> None:
    from mlsm.data.corpus import prepare_corpus

    store = prepare_corpus(a.sources, a.tokenizer, a.out, text_field=a.text_field, overwrite=a.overwrite)
    print(f"token store {store.path}: {store.n_tokens:,} tokens in {store.n_docs:,} documents")


def _train_tokenizer(a: argparse.Namespace) -> None:
    from mlsm.data.tokenizer import train_tokenizer

    tok = train_tokenizer(a.sources, a.out, kind=a.kind, vocab_size=a.vocab_size, lowercase=a.lowercase, text_field=a.text_field)
    print(f"{a.kind} tokenizer with {len(tok):,} entries saved to {a.out}")


def _pretrain(a: argparse.Namespace) -> None:
    from mlsm.config import load_config
    from mlsm.train.loop import pretrain

    run = pretrain(load_config(a.config, a.overrides), resume=a.resume)
    print(f"run directory: {run}")


def _add_prepare(sub: argparse._SubParsersAction) -> Callable:
    p = sub.add_parser("prepare", help="tokenise text into a token store")
    p.add_argument("sources", nargs="+", help="files, directories, globs (.txt/.jsonl[.gz]) or hf:NAME[,CONFIG][@SPLIT]")
    p.add_argument("--tokenizer", required=True, help="HF tokenizer folder or hub id (must have a mask token)")
    p.add_argument("--out", required=True, help="token store directory to write")
    p.add_argument("--text-field", default="text", help="JSON field holding the text (default: text)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing store of other inputs")
    return _prepare


def _add_train_tokenizer(sub: argparse._SubParsersAction) -> Callable:
    p = sub.add_parser("train-tokenizer", help="train a WordPiece or Unigram tokenizer")
    p.add_argument("sources", nargs="+", help="files, directories, globs or hf:NAME")
    p.add_argument("--out", required=True, help="folder for the tokenizer")
    p.add_argument("--kind", choices=["wordpiece", "unigram"], default="wordpiece")
    p.add_argument("--vocab-size", type=int, default=30522)
    p.add_argument("--lowercase", action="store_true")
    p.add_argument("--text-field", default="text")
    return _train_tokenizer


def _add_pretrain(sub: argparse._SubParsersAction) -> Callable:
    p = sub.add_parser("pretrain", help="pre-train a student (MLM, MLSM, KD, ...)")
    p.add_argument("--config", help="YAML recipe (see configs/)")
    p.add_argument("--resume", nargs="?", const="auto", default=None,
                   help="continue a run: 'auto' (newest checkpoint in train.out) or a checkpoint folder")
    p.add_argument("overrides", nargs="*", help="group.key=value overrides, e.g. optim.lr=3e-4 train.steps=200")
    return _pretrain


# One line per verb. --- verbs ---
_VERBS = [_add_prepare, _add_train_tokenizer, _add_pretrain]


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Callable]]:
    parser = argparse.ArgumentParser(prog="mlsm", description="Masked Latent Semantic Modeling toolkit")
    sub = parser.add_subparsers(dest="verb", required=True)
    handlers = {}
    for add in _VERBS:
        handler = add(sub)
        handlers[next(reversed(sub.choices))] = handler
    return parser, handlers


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    parser, handlers = build_parser()
    args = parser.parse_args(argv)
    try:
        handlers[args.verb](args)
    except UserError as exc:
        print(f"mlsm {args.verb}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"mlsm {args.verb}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
