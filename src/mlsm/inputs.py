"""Reading what users hand to mlsm: one helper per kind of input, each failing with ONE line.

Every file a verb reads (JSON metadata, YAML recipes, text tables) and every output path it is
about to write goes through these helpers at the edge, so a hostile input (binary bytes, a torn
file, a list where a mapping belongs, a folder where a file belongs, an output inside an input)
is a `UserError` naming the file and the fix, never a traceback from deep inside the work.
docs/reliability.md lists the classes of input and the tests that try each against every verb.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import gzip
import json
import os
import stat
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from mlsm.errors import UserError
from mlsm.limits import MAX_DOC_BYTES, MAX_JSON_FILE_BYTES, MAX_YAML_BYTES, MAX_YAML_NODES


def suggest(name: object, valid: Iterable[str]) -> str:
    """' (did you mean X?)' for the closest valid name, or '' when nothing is close."""
    close = difflib.get_close_matches(str(name), list(valid), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def read_text(path: str | os.PathLike, what: str, fix: str) -> str:
    """A UTF-8 text file; missing, a folder, unreadable or binary is one UserError."""
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{what} {p} is a folder, not a file; {fix}")
    check_regular(p, what)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise UserError(f"cannot read {what} {p} ({exc.strerror or exc}); {fix}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{what} {p} is not UTF-8 text (byte {exc.start}); {fix}") from None


def bounded_lines(path: str | os.PathLike, what: str, limit: int = MAX_DOC_BYTES,
                  raised_by: str = "mlsm.limits.MAX_DOC_BYTES",
                  encoding: str = "utf-8") -> Iterator[tuple[int, str]]:
    """(line number, line without its line break) of a text file, gzipped when its name ends in
    .gz; a line longer than `limit` characters is one UserError naming FILE:LINE, `what` a line
    is, the limit and what raises it (`raised_by`), having read that far only: a 400 KB gzip of
    one 400 MB line took 1.3 GB in `mlsm blimp`, and 17 GB in `mlsm rank` before it was killed.
    Decoding errors (UnicodeDecodeError, a bad gzip: OSError, EOFError, zlib.error) are left to
    the caller, whose one line names what the file should be."""
    p = Path(path)
    check_regular(p, "input")
    opener: Callable[..., Any] = gzip.open if p.name.endswith(".gz") else open
    with opener(p, "rt", encoding=encoding, newline="") as f:
        number = 0
        while line := f.readline(limit + 1):
            number += 1
            line = line.rstrip("\r\n")
            if len(line) > limit:
                raise _too_long(p, number, limit, "characters", what, raised_by)
            yield number, line


def bounded_byte_lines(path: str | os.PathLike, what: str, limit: int,
                       raised_by: str) -> Iterator[tuple[int, bytes]]:
    """`bounded_lines` of a plain file in bytes, not decoded (a reader that names the line and
    byte of a decoding error decodes each line itself): a line longer than `limit` bytes is the
    same one UserError, having read that far only."""
    p = Path(path)
    check_regular(p, "input")
    with open(p, "rb") as f:
        number = 0
        while line := f.readline(limit + 1):
            number += 1
            line = line.rstrip(b"\r\n")
            if len(line) > limit:
                raise _too_long(p, number, limit, "bytes", what, raised_by)
            yield number, line


def _too_long(path: Path, number: int, limit: int, unit: str, what: str,
              raised_by: str) -> UserError:
    return UserError(f"{path}:{number} is longer than {limit:,} {unit}, the bound of {what} "
                     f"({raised_by}); split or cut that line")


def check_regular(path: Path, what: str) -> None:
    """Refuse a FIFO, socket or device where a file is read: reading a FIFO named
    checkpoint.json or toy.jsonl waited forever for a writer (a missing path or a folder is left
    to the caller's own line)."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) \
            else "a device"
        raise UserError(f"{what} {path} is {kind}, not a file (reading it would wait or never "
                        "end); pass a regular file")


def loads(text: str | bytes) -> Any:
    """json.loads, with input nested deeper than Python's parser can follow (`[[[[...` a
    hundred thousand deep) raised as the JSONDecodeError every reader already turns into its one
    line, not as a RecursionError."""
    try:
        return json.loads(text)
    except RecursionError:
        doc = text if isinstance(text, str) else ""
        raise json.JSONDecodeError(f"nested deeper than the parser follows (about "
                                   f"{sys.getrecursionlimit()} levels)", doc, 0) from None


def read_json(path: str | os.PathLike, what: str, fix: str, kind: type = dict,
              fields: Mapping[str, str] | None = None, limit: int = MAX_JSON_FILE_BYTES,
              raised_by: str = "mlsm.limits.MAX_JSON_FILE_BYTES") -> Any:
    """A JSON file whose top level is a `kind` (a mapping by default) and whose `fields` have the
    shape the reader uses (`field_problem`); else one UserError naming the file and the fix. A
    file over `limit` bytes (named by `raised_by`) is refused before it is read: it is read and
    parsed whole."""
    p = Path(path)
    with contextlib.suppress(OSError):  # a missing or unreadable file: read_text's own line
        if p.is_file() and (size := p.stat().st_size) > limit:
            raise UserError(f"{what} {p} is {size:,} bytes, beyond the {limit:,} a JSON file read "
                            f"whole may hold ({raised_by}); {fix}")
    text = read_text(p, what, fix)
    try:
        data = loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{what} {p} is torn or not JSON (line {exc.lineno}, column "
                        f"{exc.colno}: {exc.msg}); {fix}") from None
    if not isinstance(data, kind):
        raise UserError(f"{what} {p} must hold a JSON {_KINDS.get(kind, kind.__name__)}, "
                        f"got {type(data).__name__}; {fix}")
    wrong = field_problem(data, fields or {})
    if wrong:
        raise UserError(f"{what} {p} is not one mlsm wrote ({wrong}); {fix}")
    return data


_KINDS = {dict: "object", list: "list"}


def is_number(value: Any) -> bool:
    """An int or float, not a bool (JSON true is not a count)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


_FIELD_KINDS: dict[str, Callable[[Any], bool]] = {
    "number": is_number,
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "text": lambda v: isinstance(v, str),
    "object": lambda v: isinstance(v, dict),
    "list": lambda v: isinstance(v, list),
    "numbers": lambda v: isinstance(v, list) and all(map(is_number, v)),
    "bool": lambda v: isinstance(v, bool),
}


def field_problem(data: Any, fields: Mapping[str, str]) -> str | None:
    """What is wrong with the shape of a parsed JSON object, or None: `fields` maps each key the
    reader uses (dotted for nested objects: "config.train.steps") to its kind, one of number, int,
    text, object, list, numbers (a list of numbers), bool; a trailing "?" lets it be missing or
    null. The message names the key and what it holds: "'config.train' must be an object",
    "'step' must be an integer, not text (\"last\")", "'lam' is missing; it must be a number"."""
    if not isinstance(data, dict):
        return "not a JSON object"
    for key, kind in fields.items():
        value: Any = data
        parts = key.split(".")
        for depth, part in enumerate(parts):
            if not isinstance(value, dict):
                return f"'{'.'.join(parts[:depth])}' must be an object"
            value = value.get(part)
            if value is None:
                break
        if value is None and kind.endswith("?"):
            continue
        want = _ARTICLE[kind.rstrip("?")]
        if value is None:
            return f"'{key}' is missing; it must be {want}"
        if not _FIELD_KINDS[kind.rstrip("?")](value):
            return f"'{key}' must be {want}, not {_json_kind(value)} ({_preview(value)})"
    return None


def _json_kind(value: Any) -> str:
    """The JSON type of a parsed value, in the words of the messages above."""
    if isinstance(value, bool):
        return "true or false"
    kinds = {int: "an integer", float: "a number", str: "text", list: "a list", dict: "an object"}
    return kinds.get(type(value), type(value).__name__)


def _preview(value: Any, limit: int = 30) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_ARTICLE = {"number": "a number", "int": "an integer", "text": "text", "object": "an object",
            "list": "a list", "numbers": "a list of numbers", "bool": "true or false"}


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last one
    silently: a study with two arms of one name would quietly lose the first)."""


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: dict[Any, Any] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: merged keys may be overridden
            continue
        key = loader.construct_object(key_node, deep=True)
        if isinstance(key, Mapping | list):
            continue  # unhashable: let the constructor report it
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (also on line {seen[key] + 1})",
                key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=True)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error on one line: the problem and its line number (1-based)."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + " ".join(str(problem).split())


def parse_yaml(text: str) -> Any:
    """Safe YAML (no Python tags, no duplicate keys) of bounded size: at most MAX_YAML_BYTES
    characters and MAX_YAML_NODES values with its aliases expanded (an alias "bomb" of a few
    hundred bytes stands for hundreds of millions of values, which PyYAML builds as shared
    references and the first reader to walk them expands); raises yaml.YAMLError."""
    if len(text) > MAX_YAML_BYTES:
        raise yaml.YAMLError(f"{len(text):,} characters, beyond the {MAX_YAML_BYTES:,} a YAML "
                             "file may hold (mlsm.limits.MAX_YAML_BYTES)")
    loader = _UniqueKeyLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if _expanded_size(node, {}) > MAX_YAML_NODES:
            raise yaml.YAMLError(f"its aliases expand to more than {MAX_YAML_NODES:,} values "
                                 "(mlsm.limits.MAX_YAML_NODES); write the values out, or use "
                                 "fewer nested aliases")
        return loader.construct_document(node)
    except RecursionError:  # `[[[[...` a hundred thousand deep: PyYAML recurses per level
        raise yaml.YAMLError(f"nested deeper than the parser follows (about "
                             f"{sys.getrecursionlimit()} levels)") from None
    finally:
        loader.dispose()


def _expanded_size(node: yaml.Node, seen: dict[int, int]) -> int:
    """How many values `node` stands for with every alias expanded, each shared node counted
    once per use but computed once (`seen`), so a bomb is measured in time linear in its text."""
    if id(node) in seen:
        return seen[id(node)]
    seen[id(node)] = 1  # a recursive alias (`&a [*a]`) counts as one, not forever
    children: list[yaml.Node] = []
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [part for pair in node.value for part in pair]
    total = 1
    for child in children:
        total += _expanded_size(child, seen)
        if total > (1 << 62):
            break
    seen[id(node)] = total
    return total


def read_yaml(path: str | os.PathLike, what: str, fix: str) -> Any:
    """A YAML file read safely; missing, binary, invalid or with a duplicate key: one UserError
    naming the file and line."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"{what} {p} not found; {fix}")
    if p.is_file() and p.stat().st_size > MAX_YAML_BYTES:  # before it is read
        raise UserError(f"{what} {p} is {p.stat().st_size:,} bytes, beyond the {MAX_YAML_BYTES:,}"
                        f" a YAML file may hold (mlsm.limits.MAX_YAML_BYTES); {fix}")
    try:
        return parse_yaml(read_text(p, what, fix))
    except yaml.YAMLError as exc:
        raise UserError(f"{what} {p} is not valid YAML ({yaml_problem(exc)}); {fix}") from None


def real_path(path: str | os.PathLike) -> Path:
    """`Path.resolve()` of `path` (~ expanded); a symbolic-link loop is the OSError (ELOOP) naming
    the path that Python >= 3.13 raises, not Python 3.11's RuntimeError, so it reads as the
    user's environment (one line), not as a bug."""
    try:
        return Path(path).expanduser().resolve()
    except RuntimeError:
        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(path)) from None


def _within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def check_apart(out: str | os.PathLike, flag: str, inputs: Mapping[str, Any],
                contains: bool = False) -> None:
    """Refuse an output path that is one of the inputs or lies inside an input folder (and, when
    the output folder is replaced as a whole, `contains`: one that holds an input), before
    anything is written. `inputs` maps how each input was named (a flag or key) to its path;
    empty or missing ones are skipped."""
    target = real_path(out)
    for name, value in inputs.items():
        if not value:
            continue
        source = Path(value).expanduser()
        if not source.exists():
            continue
        source = real_path(source)
        clash = _within(target, source) or (contains and _within(source, target))
        if clash:
            how = ("is" if target == source else "lies inside" if _within(target, source)
                   else "holds")
            raise UserError(f"{flag} {out} {how} the input {name} {value}; write the output "
                            "somewhere else (nothing was written)")


def beside(path: str | os.PathLike) -> str:
    """' (did you mean X?)' for an existing folder whose name is close to the first missing part
    of `path` (runs/stor -> runs/store), or '': a mistyped path is usually one letter off."""
    p = Path(path).expanduser()
    parts = p.parts
    for i, name in enumerate(parts):
        parent = Path(*parts[:i]) if i else Path(".")
        if (parent / name).exists():
            continue
        try:
            folders = [e.name for e in parent.iterdir() if e.is_dir()]
        except OSError:
            return ""
        close = difflib.get_close_matches(name, folders, n=1, cutoff=0.6)
        guess = Path(*parts[:i], close[0], *parts[i + 1:]) if close else None
        return f" (did you mean {guess}?)" if guess is not None and guess.is_dir() else ""
    return ""


def store_missing(path: str | os.PathLike) -> str | None:
    """The one line for a token store path that is no folder (None when it is one): checked by
    `TokenStore.open` and, before torch imports, by the verbs that take --store."""
    if Path(path).is_dir():
        return None
    return (f"token store {path} not found (or not a folder){beside(path)}; make one with "
            f"`mlsm prepare SOURCES --tokenizer TOK --out {path}`")
