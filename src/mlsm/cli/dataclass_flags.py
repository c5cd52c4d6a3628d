"""Command-line flags generated from a settings dataclass, so a setting is declared once.

`add_dataclass_flags(parser, cls)` adds one `--name-with-dashes` flag per field: its type from the
annotation, its range from the `metadata={"check": (predicate, "what it must be")}` declared beside
the field (the one `mlsm.config.build_dataclass` checks), its help from the field's docstring and
default; `metadata["aliases"]` adds older spellings of the flag, `metadata["nargs"] = "+"` takes a
list as separate words instead of comma-separated text, a Literal type lists its choices.
`flag_values(args, cls)` reads back the flags the user gave. litgpt and jsonargparse build
whole CLIs from dataclasses the same way; this is the small part mlsm needs, over argparse.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from typing import Any

from mlsm.config import INT_LIMIT, field_docs
from mlsm.errors import UserError


def _parse_scalar(kind: Any) -> Any:
    """text -> value of a scalar or list field's type (lists: comma-separated)."""
    origin = typing.get_origin(kind) or kind
    inner = [a for a in typing.get_args(kind) if a is not type(None)]
    if origin in (types.UnionType, typing.Union) and len(inner) == 1:  # X | None: parse X
        return _parse_scalar(inner[0])
    if origin is typing.Literal:
        choices = [str(c) for c in typing.get_args(kind)]

        def choice(text: str) -> str:
            if text not in choices:
                raise ValueError(f"choose from {', '.join(choices)}, got {text!r}")
            return text
        return choice
    if origin is list:
        (item,) = typing.get_args(kind) or (str,)
        one = _parse_scalar(item)
        return lambda text: [one(t.strip()) for t in text.split(",") if t.strip()]
    if origin is float:
        def number(text: str) -> float:
            value = float(text)
            if not math.isfinite(value):
                raise ValueError(f"{text!r} is not a finite number")
            return value
        return number
    if origin is int:
        def integer(text: str) -> int:
            value = int(text)
            if not -INT_LIMIT <= value < INT_LIMIT:  # C integers overflow deep inside torch
                raise ValueError(f"{text} is out of range (at most {INT_LIMIT - 1})")
            return value
        return integer
    if origin is str:
        return str
    raise TypeError(f"no flag parser for {kind}; declare metadata={{'flag': parse}}")


def _flag_type(f: dataclasses.Field, hint: Any) -> Any:
    """argparse `type=` of a field: parse (metadata "flag", else by its type), then the range
    declared beside it (metadata "check"); a bad value is argparse's one line naming the flag."""
    check = f.metadata.get("check")
    if f.metadata.get("nargs"):  # one value per word (e.g. --phenomena A B): parse each item;
        (hint,) = typing.get_args(hint) or (str,)  # the list's range is checked when it is built
        check = None
    parse = f.metadata.get("flag") or _parse_scalar(hint)

    def convert(text: str) -> Any:
        try:
            value = parse(text)
        except (ValueError, UserError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if check is not None and not check[0](value):
            raise argparse.ArgumentTypeError(f"must be {check[1]}, got {text}")
        return value

    convert.__name__ = f.name  # argparse names the type in "invalid NAME value"
    return convert


def add_dataclass_flags(parser: Any, cls: type) -> None:
    """One `--name-with-dashes` flag per field of the dataclass `cls`: its type, its range
    (metadata "check"), help = the field's docstring and default. Every flag defaults to None
    ("not given"), so `flag_values` returns only what the user set and the dataclass keeps the
    one declaration of each default."""
    docs, hints = field_docs(cls), typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING \
            else f.default
        shown = ((",".join(map(str, default)) or "none") if isinstance(default, list)
                 else repr(default) if isinstance(default, str) else str(default))
        text = f"{docs.get(f.name, '')} (default {shown})".replace("%", "%%")
        flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
        if hints[f.name] is bool and "flag" not in f.metadata:
            parser.add_argument(*flags, action="store_true", default=None, help=text)
        else:
            choices = typing.get_args(hints[f.name]) \
                if typing.get_origin(hints[f.name]) is typing.Literal else ()
            metavar = f.metadata.get("metavar") or ("{" + ",".join(choices) + "}" if choices
                                                    else None)
            parser.add_argument(*flags, type=_flag_type(f, hints[f.name]), default=None,
                                nargs=f.metadata.get("nargs"), metavar=metavar, help=text)


def flag_values(args: Any, cls: type) -> dict[str, Any]:
    """The fields of `cls` that were given as flags (see `add_dataclass_flags`)."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
            if getattr(args, f.name, None) is not None}
