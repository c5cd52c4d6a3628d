"""One writer per output folder: an OS file lock held for the life of the command.

`hold(folder, ...)` takes an exclusive `fcntl.flock` on a hidden sibling file `.NAME.lock` (a
sibling, not a file inside, because some outputs are built elsewhere and renamed into place).
A second mlsm process that wants the same folder refuses at once with one line instead of
waiting or writing over the first one's files. The kernel releases the lock when the process
ends, however it ends (crash, SIGKILL), so a stale lock never blocks a later run.
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mlsm.errors import UserError


def lock_path(folder: str | os.PathLike) -> Path:
    folder = Path(os.path.abspath(folder))  # normalises "out/.." and "." without following links
    if not folder.name:
        raise UserError(f"{folder} cannot be an output folder; pass a folder below it")
    return folder.with_name(f".{folder.name}.lock")


def _acquire(path: Path) -> int | None:
    """An fd holding the lock on `path`, or None if another process holds it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return None
            raise
        # The holder before us may have unlinked the file after we opened it: then we hold a
        # lock nobody else can see; retry on the file that is there now.
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


_HELD: dict[Path, int] = {}  # locks this process holds -> nesting depth (re-entrant)


@contextmanager
def hold(folder: str | os.PathLike, what: str, enabled: bool = True,
         fix: str = "wait for it to finish or choose another output") -> Iterator[None]:
    """Hold the lock of `folder` for the body; `what` names the output in the error
    (e.g. "run directory", "token store") and `fix` what to do instead. enabled=False (DDP ranks
    > 0) does nothing. Re-entrant within a process, so the CLI may lock before a library call
    that locks too."""
    path = lock_path(folder)
    if not enabled:
        yield
        return
    if path in _HELD:  # this process holds it already (an outer `hold`)
        _HELD[path] += 1
        try:
            yield
        finally:
            _HELD[path] -= 1
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = _acquire(path)
    except OSError as exc:
        raise UserError(f"cannot lock {what} {folder} ({exc.strerror or exc}); check that its "
                        "parent folder is writable") from None
    if fd is None:
        holder = _holder(path)
        raise UserError(f"{what} {folder} is being written by {holder} (lock {path}); {fix}")
    try:  # who holds it, for the refusal a second process prints (a hint: not the lock itself)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        pass
    _HELD[path] = 1
    try:
        yield
    finally:
        del _HELD[path]
        path.unlink(missing_ok=True)  # while still locked: a waiter re-checks the inode
        os.close(fd)


def _holder(path: Path) -> str:
    """'pid N' as the holder of the lock `path` wrote it, else 'another mlsm process'."""
    try:
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        text = ""
    return f"pid {text}" if text.isdigit() else "another mlsm process"


@contextmanager
def exclusive(path: str | os.PathLike) -> Iterator[None]:
    """Wait for an exclusive lock on the file `path` for the body: for short read-modify-write
    updates of a file that several processes or threads share (a study's status.json).

    Unlike `hold` it blocks instead of refusing, is not re-entrant, and never removes the lock
    file (removing it would let a waiter lock an unlinked inode). Each call opens its own file
    description, so threads of one process exclude each other as processes do."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the lock
