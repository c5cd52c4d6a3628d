"""Atomic, durable writes: a reader sees the old file (or folder) or the new one, never half of
one, and once a write returns it survives a power cut (file and directory entry are fsynced).

Every file mlsm writes goes through these helpers, so every write has the same guarantees.
Files get the permissions `open()` would give them (0666 minus the umask), not mkstemp's 0600.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import glob
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn


def umask() -> int:
    """The process umask (os.umask can only be read by setting it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a directory by path (a directory: so a rename inside it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def settle_tree(folder: Path) -> None:
    """Give every file and folder below `folder` the permissions open()/mkdir() would (0666 /
    0777 minus the umask: transformers' save_pretrained writes model.safetensors 0600, and a
    shared checkpoint must not turn private), and fsync each of them and `folder` itself."""
    mask = umask()
    for path in Path(folder).rglob("*"):
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)
        fsync_path(path)
    fsync_path(folder)


def atomic_write(path: str | os.PathLike, write: Callable[[str], object]) -> None:
    """Call write(tmp_path) on a temporary sibling of `path`, fsync it, rename it over `path`,
    then fsync the directory. On any failure `path` is untouched and the temporary is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~umask())  # mkstemp makes files private; respect the umask instead
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        _reraise_named(exc, path)
    fsync_path(path.parent)


_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how Rust libraries (safetensors) report one


def name_the_file(exc: BaseException, path: Path) -> BaseException:
    """An OSError from a write (disk full, EFBIG, EIO) names no file when it comes from a plain
    write(); give it the target's name, so the CLI reports it as the user's environment in one
    line ("No space left on device: PATH") rather than as a bug. A library that wraps the OS
    error in its own type (safetensors' SafetensorError: "... (os error 28)") is read back as the
    OSError it carries, so it meets the same edge."""
    if isinstance(exc, OSError) and exc.filename is None and exc.errno is not None:
        return type(exc)(exc.errno, exc.strerror or str(exc), str(path))
    found = None if isinstance(exc, OSError) else _OS_ERROR.search(str(exc))
    if isinstance(exc, Exception) and found:
        code = int(found.group(1))
        return OSError(code, os.strerror(code), str(path))
    return exc


def _reraise_named(exc: BaseException, path: Path) -> NoReturn:
    named = name_the_file(exc, path)
    if named is exc:
        raise exc
    raise named from exc


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def atomic_write_json(path: str | os.PathLike, payload: Any) -> None:
    atomic_write_text(path, json.dumps(payload, indent=2, sort_keys=True) + "\n")


def remove_stale_builds(target: Path, tag: str) -> list[Path]:
    """Delete the hidden build folders of `target` (`.NAME.TAG-*`) that a killed run (SIGKILL, a
    power cut) left behind; returns them. Only for a caller that holds `target`'s lock, so no
    other process is building there."""
    stale = [p for p in target.parent.glob(f".{glob.escape(target.name)}.{tag}-*") if p.is_dir()]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def make_temp_dir(target: Path, tag: str) -> Path:
    """A fresh hidden sibling folder of `target` to build it in, with umask permissions."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.{tag}-", dir=target.parent))
    tmp.chmod(0o777 & ~umask())  # mkdtemp makes it private; outputs are meant to be shared
    return tmp


_RENAME_EXCHANGE = 2  # linux/fs.h


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name, use_errno=True) if name else None
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return False
    at_fdcwd = -100
    rc = fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    return rc == 0


def replace_dir(tmp: Path, target: Path) -> None:
    """Put the finished folder `tmp` at `target`. An old `target` is swapped out atomically
    (where the OS can) and deleted only afterwards: a crash never leaves `target` missing."""
    if target.exists():
        if _exchange(tmp, target):
            fsync_path(target.parent)
            shutil.rmtree(tmp, ignore_errors=True)
            return
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        target.rename(old)
        tmp.rename(target)
        fsync_path(target.parent)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(target)
        fsync_path(target.parent)


@contextlib.contextmanager
def building_dir(target: Path, tag: str) -> Iterator[Path]:
    """Yield a fresh hidden sibling of `target` to write a whole folder into. When the block ends,
    the tree is fsynced and put at `target` (`replace_dir`); on any failure it is removed and
    `target` is untouched: a reader never sees a half-written folder."""
    tmp = make_temp_dir(target, tag)
    try:
        yield tmp
        settle_tree(tmp)
        replace_dir(tmp, target)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        _reraise_named(exc, target)


STAGING = ".mlsm-staging-"  # hidden: report folders leave ".name" entries alone


@contextlib.contextmanager
def files_as_one(folder: str | os.PathLike, ours: Callable[[str], bool]) -> Iterator[Path]:
    """Write the several files of one output (a report's Markdown, CSV, JSON and figures) as one
    unit. The body writes them (and folders of them) into the hidden folder yielded (inside
    `folder`); only when every one is written are they renamed into `folder`, Markdown first (it
    marks the folder as mlsm's), and then the entries of `ours`' names that this set lacks (an
    earlier run's figure of a task no longer there) removed. A failure or a kill while writing
    leaves the earlier set whole; a rerun repairs."""
    target = Path(folder)
    target.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=STAGING, dir=target))
    try:
        yield stage
        new = sorted((p.name for p in stage.iterdir()), key=lambda n: (not n.endswith(".md"), n))
        for name in new:  # a folder of the set (a study's comparison/) swapped in whole
            if (stage / name).is_dir():
                replace_dir(stage / name, target / name)
            else:
                os.replace(stage / name, target / name)
        for entry in os.scandir(target):
            if ours(entry.name) and entry.name not in new and not entry.is_symlink():
                shutil.rmtree(entry.path) if entry.is_dir() else os.unlink(entry.path)
        fsync_path(target)
    except BaseException as exc:
        _reraise_named(_outside(exc, stage, target), target)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _outside(exc: BaseException, stage: Path, target: Path) -> BaseException:
    """An OSError naming a file in the staging folder, renamed to name its place in `target`
    (the staging folder is gone once the error is read: a full disk names OUT/blimp.json)."""
    name = getattr(exc, "filename", None)
    if isinstance(exc, OSError) and name and Path(name).is_relative_to(stage):
        return type(exc)(exc.errno, exc.strerror, str(target / Path(name).relative_to(stage)))
    return exc
