"""`mlsm <verb>`: argument wiring only; every verb calls a library function.

Arguments are validated here, at the edge, by argparse `type=` functions (`positive_int`,
`fraction`, `out_dir`, ...; the fine-tuning flags are generated from `FinetuneConfig` by
`mlsm.cli.dataclass_flags`): a bad value is one line naming the flag before any work starts.
`main` turns a `UserError` into one line (exit 2) and keeps real bugs loud: an unexpected
exception prints its traceback plus one line asking to report it (exit 1). docs/reliability.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator

from mlsm.cli import evaluation, pretraining
from mlsm.cli.args import OneLineParser, path_fix, printable
from mlsm.errors import Incomplete, Stopped, UserError

_VERBS = [*pretraining.VERBS, *evaluation.VERBS]


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Callable]]:
    parser = OneLineParser(prog="mlsm", description="Masked Latent Semantic Modeling toolkit")
    parser.add_argument("--version", action="version", version=f"mlsm {version()}")
    sub = parser.add_subparsers(dest="verb", required=True)
    handlers = {}
    for add in _VERBS:
        handler = add(sub)
        handlers[next(reversed(sub.choices))] = handler
    return parser, handlers


def version() -> str:
    """The installed distribution's version (importlib.metadata); from a source tree that is
    not installed, the package's own `__version__`."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    import mlsm

    try:
        return installed(mlsm.DISTRIBUTION)
    except PackageNotFoundError:
        return mlsm.__version__


_OVERRIDE = re.compile(r"[A-Za-z_][\w.]*=")


def _split_overrides(parser: argparse.ArgumentParser,
                     argv: list[str]) -> tuple[list[str], list[str]]:
    """Pull `group.key=value` tokens out of a verb's command line, wherever they stand, for the
    verbs that take overrides (argparse alone only takes them right after the positionals).
    A token that is the value of an option (`--config a=b.yaml`) stays with its option."""
    verb = next((t for t in argv if not t.startswith("-")), None)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    verb_parser = sub.choices.get(verb) if verb else None
    if verb_parser is None or "overrides" not in {a.dest for a in verb_parser._actions}:
        return argv, []
    needs_value = {o for a in verb_parser._actions if a.nargs is None and a.option_strings
                   for o in a.option_strings}
    rest, overrides = [], []
    for i, token in enumerate(argv):
        if (i > argv.index(verb) and _OVERRIDE.match(token)
                and (i == 0 or argv[i - 1] not in needs_value)):
            overrides.append(token)
        else:
            rest.append(token)
    return rest, overrides


class Terminated(KeyboardInterrupt):
    """SIGTERM (timeout, Slurm, systemd, kill) raised in the main thread: it unwinds like Ctrl-C,
    so a folder being built is removed and a lock released, instead of a silent exit 143 that
    left a hidden partial build behind."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM raises Terminated while a verb runs (pretrain's loop installs its own handler:
    stop after the step with a checkpoint); the previous handler is restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _one_line(exc: BaseException | str) -> str:
    """The error on one line, its middle left out past ERROR_CHARS characters: a refusal that
    quotes the user's input (a 10 MB qrels id, a 16 MB answer text) printed all of it; the start
    names the file and the problem, the end the fix, so both are kept. Control characters left
    after the line breaks are joined are escaped (`printable`): a path holding NUL or ESC was
    printed raw, into the terminal."""
    line = printable(" ".join(str(exc).split())) or type(exc).__name__
    if len(line) <= ERROR_CHARS:
        return line
    head, tail = ERROR_CHARS * 2 // 3, ERROR_CHARS // 3
    return f"{line[:head]} [... {len(line) - head - tail:,} characters left out ...] {line[-tail:]}"


ERROR_CHARS = 2000


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    parser, handlers = build_parser()
    try:  # argparse exits (--help, bad flags); callers of main() get the status instead
        argv, overrides = _split_overrides(parser, list(sys.argv[1:] if argv is None else argv))
        args, extra = parser.parse_known_args(argv)
        if extra:  # named by the verb's parser, so the line says `mlsm VERB: error: ...`
            sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
            sub.choices[args.verb].error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    if overrides:
        args.overrides = [*args.overrides, *overrides]
    prog = f"mlsm {args.verb}"
    try:
        with _sigterm_interrupts():
            handlers[args.verb](args)
    except UserError as exc:
        print(f"{prog}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except Incomplete as exc:  # it finished what it could; part of it failed
        print(f"{prog}: error: {_one_line(exc)}", file=sys.stderr)
        return 1
    except Stopped as exc:  # a signal stopped it after a checkpoint; it said how to resume
        return exc.status
    except Terminated:
        print(f"{prog}: stopped by SIGTERM; nothing was left half-written (a folder being "
              "built was removed): re-run the same command", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:
        if exc.filename is None:  # not about a path the user gave: a bug until shown otherwise
            return _report_bug(prog, exc)
        # the user's environment (missing file, permissions, disk full): say so in one line
        where = exc.filename if exc.filename2 is None else f"{exc.filename} -> {exc.filename2}"
        print(f"{prog}: error: {_one_line(f'{exc.strerror or exc}: {where}; {path_fix(exc)}')}",
              file=sys.stderr)
        return 2
    except Exception as exc:
        return _report_bug(prog, exc)
    return 0


def _report_bug(prog: str, exc: BaseException) -> int:
    """A real bug stays loud: the whole traceback, then one line saying what to do with it."""
    traceback.print_exc()
    print(f"{prog}: internal error ({type(exc).__name__}: {_one_line(exc)}); "
          "this is a bug in mlsm, please report it with the traceback above and the command "
          "you ran", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
