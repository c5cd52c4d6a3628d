"""Argument types of `mlsm <verb>`: each validates one flag at the edge, so a bad value is one line
naming the flag before any work starts (argparse `type=`), and `OneLineParser` keeps argparse's
errors to one line. docs/reliability.md lists them."""

from __future__ import annotations

import argparse
import contextlib
import errno
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

from mlsm.config import INT_LIMIT


def _number(text: str, kind: type) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not "
                                         f"{'an integer' if kind is int else 'a number'}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    if kind is int and not -INT_LIMIT <= value < INT_LIMIT:  # C integers overflow deep inside
        raise argparse.ArgumentTypeError(f"{text} is out of range (at most {INT_LIMIT - 1})")
    return value


def positive_int(text: str) -> int:
    value = int(_number(text, int))
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(_number(text, int))
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def fraction(text: str) -> float:
    """A number in [0, 1)."""
    value = _number(text, float)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def unit_interval(text: str) -> float:
    """A number in (0, 1]."""
    value = _number(text, float)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
"""The control characters (Unicode category Cc): a line break, a tab, NUL, ESC, DEL, C1."""


def printable(text: str) -> str:
    """`text` with every control character written as its escape (NUL as \\x00, ESC as \\x1b):
    a refusal quoting a path that holds one printed it raw (a NUL, a terminal escape)."""
    return _CONTROL.sub(lambda m: ascii(m[0])[1:-1], text)


def control_problem(value: object) -> str | None:
    """What is wrong with a command-line value that holds a control character, or None: a path is
    taken literally (`a\\nb` is not `a b`, and YAML folded it into another folder name) and every
    value is one line, so no flag or positional may hold one (`overrides` are checked by
    `config.parse_overrides`, in a line of their own)."""
    values = value if isinstance(value, list) else [value]
    bad = next((v for v in values if isinstance(v, str) and _CONTROL.search(v)), None)
    if bad is None:
        return None
    return (f"{bad!r} holds a line break or another control character; a "
            "path is taken literally and a value is one line: pass one without them (nothing "
            "was written)")


def out_dir(text: str) -> str:
    """An output folder: it may exist (as a folder) but must not be an existing file."""
    _refuse_control(text)
    with _path_errors(text):
        if text and Path(text).exists() and not Path(text).is_dir():
            raise argparse.ArgumentTypeError(f"{text} is an existing file; pass a folder "
                                             "(nothing was written)")
    return text


def out_file(text: str) -> str:
    """An output file: it may exist (as a file) but must not be a folder."""
    _refuse_control(text)
    with _path_errors(text):
        if Path(text).is_dir():
            raise argparse.ArgumentTypeError(f"{text} is a folder; pass a file path")
    return text


def _refuse_control(text: str) -> None:
    """A path type checks its value for control characters first: a NUL made `Path.exists`
    raise before `OneLineParser` could name the problem."""
    problem = control_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)


@contextlib.contextmanager
def _path_errors(text: str) -> Iterator[None]:
    """An OSError while a flag's path is checked (a name over 255 bytes) is a usage error: argparse
    turns only ArgumentTypeError/TypeError/ValueError into one line."""
    try:
        yield
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{exc.strerror or exc}: {text}; "
                                         f"{path_fix(exc)}") from None


_PATH_FIXES = {
    errno.ENOSPC: "free disk space and re-run", errno.EDQUOT: "free disk space and re-run",
    errno.EFBIG: "free disk space or raise the file size limit",
    errno.EACCES: "check its permissions or write elsewhere",
    errno.EPERM: "check its permissions or write elsewhere",
    errno.EROFS: "write to a writable file system",
    errno.ELOOP: "remove the symbolic-link loop or pass another path",
    errno.ENAMETOOLONG: "shorten the path (each name at most 255 bytes)",
    errno.ENOENT: "check the path",
    errno.ENOTDIR: "a part of the path is a file, not a folder; check the path",
    errno.EEXIST: "a file or a broken symbolic link is in the way; remove it or pass another "
                  "path",
}


def path_fix(exc: OSError) -> str:
    """What to do about an OSError on a path the user gave, by its errno."""
    default = "check the path, its permissions and the free disk space"
    return _PATH_FIXES.get(exc.errno or 0, default)


def device(text: str) -> str:
    if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; use cpu, cuda, "
                                         "cuda:N (or auto)")
    if text.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text} asked for but no CUDA device is "
                                             "visible; pass --device cpu")
    return text


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line (no usage block): `mlsm VERB: error: ...`, control
    characters escaped; a value holding one is refused, naming its flag (`control_problem`)."""

    def parse_known_args(self, args: Any = None,  # type: ignore[override]
                         namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        parsed, extra = super().parse_known_args(args, namespace)
        for action in self._actions:
            if action.dest in ("overrides", "help", argparse.SUPPRESS) or action.choices:
                continue
            name = "/".join(action.option_strings) or action.metavar or action.dest
            problem = control_problem(getattr(parsed, action.dest, None))
            if problem:
                self.error(f"argument {name}: {problem}")
        return parsed, extra

    def error(self, message: str) -> NoReturn:
        self.exit(2, printable(f"{self.prog}: error: {message} (see {self.prog} --help)") + "\n")
