"""Content fingerprints, and the one rule of reuse: a stored result, stage, run or artifact is
reused only when the fingerprints of its inputs and settings equal the current ones.

A fingerprint is what decides a result, hashed: the bytes of the files it read (not their paths or
mtimes, which change on a copy and stay the same on an in-place rebuild) and every setting that
changes it. A mismatch is one line saying which inputs or settings differ, with the fix.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from mlsm.errors import UserError

HASH_WHOLE_BELOW = 64 << 20  # files up to this size are hashed whole
EDGE_BYTES = 1 << 20  # larger files: their head and tail ...
SAMPLES, SAMPLE_BYTES = 62, 64 << 10  # ... and this many blocks spread evenly in between
# files that change without changing what a model folder computes: the optimizer's state, locks
VOLATILE = ("training_state.pt", ".lock")



def content_digest(path: Path) -> str:
    """sha256 of the file's bytes when it is small; else of its head, tail and evenly spread
    sampled blocks (a fixed ~6 MiB whatever the size, so a 100 GB corpus costs no full read)."""
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        if size <= HASH_WHOLE_BELOW:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
            return h.hexdigest()
        step = (size - 2 * EDGE_BYTES - SAMPLE_BYTES) // (SAMPLES + 1)
        spans = [(0, EDGE_BYTES), (size - EDGE_BYTES, EDGE_BYTES)]
        spans += [(EDGE_BYTES + (i + 1) * step, SAMPLE_BYTES) for i in range(SAMPLES)]
        for offset, length in spans:
            fh.seek(offset)
            h.update(fh.read(length))
    return "sampled:" + h.hexdigest()


def settings_fingerprint(settings: Any) -> str:
    """sha256 (16 hex) of `settings` as canonical JSON: keys sorted, paths and other objects as
    their str(), so the same settings give the same fingerprint in every process."""
    text = json.dumps(settings, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _files(folder: Path) -> Iterable[Path]:
    """The regular files directly in `folder` that decide what it computes, by name."""
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.is_file() and not entry.name.startswith(".") and \
                not entry.name.endswith(VOLATILE):
            yield Path(entry.path)


def folder_fingerprint(folder: str | os.PathLike) -> str:
    """Fingerprint of a model folder (or any flat folder): each file's name and content digest.
    A copy of the folder fingerprints the same; re-training or re-exporting into it does not."""
    path = Path(folder)
    if path.is_file():
        return settings_fingerprint({"file": content_digest(path)})
    return settings_fingerprint({p.name: content_digest(p) for p in _files(path)})


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
