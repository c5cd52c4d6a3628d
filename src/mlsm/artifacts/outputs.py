"""The one guard of every output mlsm writes: nothing of the user's is overwritten, and one process
writes an output at a time.

Each verb declares what its output is (an `OutputKind`: the names it writes and how a folder of
its own is recognised) and the rule it writes under (`Rule`); `guard_output` then refuses, in one
line naming the fix and before any work, an output that is

- an existing file where a folder is wanted (or a folder where a file is wanted),
- a non-empty folder mlsm did not write as this kind ("exists and is not a token store"),
- a folder of this kind holding files the kind does not write (they would be replaced with it),
- under `Rule.NEW`, an earlier output of this kind (the verb names the flag that continues it).

`writing` holds the output's lock (`mlsm.locking.hold`) and checks again under it, so a second
process on the same output refuses at once instead of duplicating rows or mixing files.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from mlsm import locking
from mlsm.errors import UserError
from mlsm.inputs import real_path


class Rule(enum.Enum):
    """What a verb may do with an earlier output of its own kind at its destination."""

    SAME_KIND = "same-kind"  # replace or continue it (an export, a tokenizer, a target build)
    NEW = "new"  # refuse it: the verb has an explicit flag for that (pretrain's --resume)


@dataclass(frozen=True)
class OutputKind:
    """What a verb writes at one destination."""

    what: str
    """The kind, as messages name it: "token store", "mlsm run", "BLiMP report"."""
    files: Callable[[str], bool] | None = None
    """Which entry names a folder of this kind may hold; None: any (the kind owns the folder)."""
    ours: Callable[[Path], bool] | None = None
    """Whether a non-empty folder is one mlsm wrote as this kind (its marker file); None: a
    folder holding only this kind's `files` is one."""
    skip_hidden: bool = False
    """Leave ".name" entries alone (the verb writes single files into the folder, never replaces
    it whole, so a user's .git there is safe)."""


def article(noun: str) -> str:
    """'a' or 'an' before `noun` ("an mlsm run": said em-el-es-em)."""
    return "an" if noun[:1].lower() in "aeiou" or noun.startswith("mlsm") else "a"


def guard_output(out: str | os.PathLike, kind: OutputKind, rule: Rule = Rule.SAME_KIND, *,
                 flag: str = "--out", fix_existing: str = "", keep: Iterable = ()) -> None:
    """Refuse `out` as the folder of `kind` under `rule` (see the module docstring). `flag` is how
    the user named it (--out, train.out); `fix_existing` completes the Rule.NEW refusal; `keep`:
    inputs that may lie inside (a report's results.jsonl)."""
    folder = Path(out)
    a_kind = f"{article(kind.what)} {kind.what}"
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{flag} {folder} is an existing file; pass a folder path for the "
                        f"{kind.what} (nothing was written)")
    entries = _entries(folder, kind, keep)
    if not entries:
        return
    foreign = [] if kind.files is None else [n for n in entries if not kind.files(n)]
    ours = kind.ours(folder) if kind.ours is not None else not foreign
    if not ours:
        raise UserError(f"{flag} {folder} exists and is not {a_kind} (it holds "
                        f"{_names(entries)}); choose an empty or new folder (mlsm only "
                        "replaces folders it wrote)")
    if foreign:
        raise UserError(f"{flag} {folder} holds {_names(foreign)}, not part of "
                        f"{a_kind}; move {'it' if len(foreign) == 1 else 'them'} or choose "
                        f"another {flag} (nothing was written)")
    if rule is Rule.NEW:
        raise UserError(f"{flag} {folder} already holds {a_kind}; "
                        f"{fix_existing or f'choose another {flag}'}")


def _names(names: list[str]) -> str:
    """The first three names, each on the message's one line (a name may hold a line break)."""
    return ", ".join(n if n.isprintable() else ascii(n) for n in names[:3]) + (
        ", ..." if len(names) > 3 else "")


def _entries(folder: Path, kind: OutputKind, keep: Iterable) -> list[str]:
    if not folder.is_dir():
        return []
    kept = {real_path(k) for k in keep if k}
    return sorted(e.name for e in folder.iterdir()
                  if not (kind.skip_hidden and e.name.startswith("."))
                  and not (kept and real_path(e) in kept))


def guard_output_file(path: str | os.PathLike, what: str, ours: Callable[[Path], bool], *,
                      flag: str = "--out", example: str = "") -> None:
    """Refuse `path` as an output file of `what`: a folder or a device, or an existing file that
    `ours` does not recognise as one mlsm wrote (it would be replaced)."""
    path = Path(path)
    hint = f" such as {example}" if example else ""
    if path.is_dir():
        raise UserError(f"{flag} {path} is a folder; pass a file path{hint}")
    if path.exists() and not path.is_file():  # /dev/null, a FIFO
        raise UserError(f"{flag} {path} is a device or special file, not a file path; pass a "
                        f"file path{hint}")
    if path.exists() and not ours(path):
        raise UserError(f"{flag} {path} exists and is not {article(what)} {what}; choose "
                        f"another {flag}")


def heading_marker(headings: dict[str, str]) -> Callable[[Path], bool]:
    """`OutputKind.ours` of a report folder: one of its Markdown files (`headings`: name ->
    first-line prefix) is there and starts with the heading mlsm writes. The verbs write their
    Markdown file first, so an interrupted run still marks its folder; a Markdown file of its
    names that does not start so is the user's, and makes the folder not ours."""
    def ours(folder: Path) -> bool:
        present = [name for name in headings if (folder / name).exists()]
        return bool(present) and all(_starts_with(folder / n, headings[n]) for n in present)
    return ours


def _starts_with(path: Path, heading: str) -> bool:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.readline(4096).strip().startswith(heading)
    except (OSError, UnicodeDecodeError):  # a folder, unreadable, binary: not ours
        return False


def report_kind(what: str, writes: Callable[[str], bool], headings: dict[str, str]) -> OutputKind:
    """The kind of a folder a verb writes report files into (blimp, rank, compare, report):
    `writes` says which names it writes, `headings` which Markdown files mark it as mlsm's."""
    return OutputKind(what, files=writes, ours=heading_marker(headings), skip_hidden=True)


@contextmanager
def writing(out: str | os.PathLike, kind: OutputKind, rule: Rule = Rule.SAME_KIND, *,
            flag: str = "--out", fix_existing: str = "", keep: Iterable = (),
            enabled: bool = True) -> Iterator[None]:
    """Hold `out`'s lock for the body (a second writer refuses in one line) and guard it under
    the lock, where no other mlsm process can change it any more."""
    keep = list(keep)
    with locking.hold(out, kind.what, enabled=enabled):
        guard_output(out, kind, rule, flag=flag, fix_existing=fix_existing, keep=keep)
        yield


@contextmanager
def writing_file(path: str | os.PathLike, what: str) -> Iterator[None]:
    """Hold the lock of the output file `path` (a results or scores file) for the body: two
    invocations on one file never both append their rows."""
    with locking.hold(path, what):
        yield
