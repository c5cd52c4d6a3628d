"""Content fingerprints, and the one rule of reuse: a stored result, stage, run or artifact is
reused only when the fingerprints of its inputs and settings equal the current ones.

A fingerprint is what decides a result, hashed: the bytes of the files it read (not their paths or
mtimes, which change on a copy and stay the same on an in-place rebuild) and every setting that
changes it. A mismatch is one line saying which inputs or settings differ, with the fix.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from mlsm.errors import UserError

CACHE_FROM = 64 << 20  # digests of files this large are kept on disk (smaller ones re-read)
BLOCK = 1 << 20  # bytes read at a time
# files that change without changing what a model folder computes: the optimizer's state, locks
VOLATILE = ("training_state.pt", ".lock")
_MEMO: dict[tuple[int, ...], str] = {}  # stat key -> digest, for this process
# a file changed this recently is never cached: timestamps tick in jiffies (ms), so a rewrite
# just after the hash could keep the same mtime and ctime ("racy git")
RACY_NS = 2_000_000_000


def stat_key(st: os.stat_result) -> tuple[int, ...]:
    """What says a file is unchanged since it was hashed: device, inode, size, mtime and ctime
    (ns). ctime cannot be set back by a user (`touch -d` sets mtime, and moves ctime), so a
    rewrite that keeps size and mtime still changes the key."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def cache_dir() -> Path:
    """Where digests of large files are kept between processes: $MLSM_CACHE_DIR/digests, else
    $XDG_CACHE_HOME/mlsm/digests, else ~/.cache/mlsm/digests."""
    root = os.environ.get("MLSM_CACHE_DIR") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlsm"
    return Path(root) / "digests"


def _cache_file(key: tuple[int, ...]) -> Path:
    return cache_dir() / hashlib.sha256(repr(key).encode()).hexdigest()[:32]


def _cached(key: tuple[int, ...]) -> str | None:
    try:
        text = _cache_file(key).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text if len(text) == 64 and all(c in "0123456789abcdef" for c in text) else None


def _keep(key: tuple[int, ...], digest: str) -> None:
    """Remember a large file's digest on disk. The cache only saves time: a full disk, a
    read-only home or any other failure to write it leaves the command to go on unharmed."""
    from mlsm.fileio import atomic_write_text

    with contextlib.suppress(OSError):
        atomic_write_text(_cache_file(key), digest + "\n")


def content_digest(path: Path) -> str:
    """sha256 of every byte of the file (a link: of its target), never of a part. Kept per
    process, and on disk for large files, under `stat_key`: a file is read again only when its
    inode, size, mtime or ctime changed. A file that changed while it was read is not kept."""
    key = stat_key(os.stat(path))
    found = _MEMO.get(key) or (_cached(key) if key[2] >= CACHE_FROM else None)
    if found:
        _MEMO[key] = found
        return found
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(BLOCK), b""):
            h.update(block)
    digest = h.hexdigest()
    settled = time.time_ns() - max(key[3], key[4]) > RACY_NS
    if settled and stat_key(os.stat(path)) == key:
        _MEMO[key] = digest
        if key[2] >= CACHE_FROM:
            _keep(key, digest)
    return digest


def settings_fingerprint(settings: Any) -> str:
    """sha256 (16 hex) of `settings` as canonical JSON: keys sorted, paths and other objects as
    their str(), so the same settings give the same fingerprint in every process."""
    text = json.dumps(settings, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _files(folder: Path) -> Iterable[Path]:
    """The regular files directly in `folder` that decide what it computes, by name (a link is
    followed: its target's bytes are what a reader gets)."""
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.is_file() and not entry.name.startswith(".") and \
                not entry.name.endswith(VOLATILE):
            yield Path(entry.path)


def tree_files(folder: str | os.PathLike) -> dict[str, Path]:
    """relative name -> path of every file below `folder` (hidden ones left out), following
    links to folders as a reader of the tree does, so a swapped link is another content; a link
    back to a folder already walked (a loop) is walked once."""
    out: dict[str, Path] = {}
    seen: set[str] = set()
    root = Path(folder)
    for here, dirs, names in os.walk(root, followlinks=True):
        real = os.path.realpath(here)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(n for n in names if not n.startswith(".")):
            path = Path(here, name)
            if path.is_file():
                out[path.relative_to(root).as_posix()] = path
    return out


def folder_fingerprint(folder: str | os.PathLike) -> str:
    """Fingerprint of a model folder (or any flat folder): each file's name and content digest.
    A copy of the folder fingerprints the same; re-training or re-exporting into it does not."""
    path = Path(folder)
    if path.is_file():
        return settings_fingerprint({"file": content_digest(path)})
    return settings_fingerprint({p.name: content_digest(p) for p in _files(path)})


def path_fingerprint(value: str | os.PathLike) -> str:
    """The content a data setting names: a file's `content_digest`, a folder's files (`tree_files`,
    links followed) by relative name and digest; a value that is no path on this machine (an HF
    dataset name, "") stands for itself. What a reuse decision records of a data path, so the same
    path with other content is another input."""
    path = Path(value)
    if str(value) and path.is_file():
        return content_digest(path)
    if str(value) and path.is_dir():
        return settings_fingerprint({n: content_digest(p) for n, p in tree_files(path).items()})
    return f"name:{value}"


def differences(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """`key: recorded -> current` for each key whose value differs (missing = None), sorted."""
    keys = sorted(set(recorded) | set(current))
    return [f"{k}: {recorded.get(k)!r} -> {current.get(k)!r}" for k in keys
            if recorded.get(k) != current.get(k)]


def require_same(recorded: Mapping[str, Any], current: Mapping[str, Any], what: str,
                 fix: str, shown: int = 3) -> None:
    """Refuse reuse in one line unless `recorded` equals `current`: names what differs (the first
    `shown` keys, then a count) and how to proceed."""
    diff = differences(recorded, current)
    if not diff:
        return
    more = f" (and {len(diff) - shown} more)" if len(diff) > shown else ""
    raise UserError(f"{what} was made from other inputs or settings ({'; '.join(diff[:shown])}"
                    f"{more}); {fix}")
