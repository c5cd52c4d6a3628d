"""When two things a study compares are the same: a stage record and the inputs computed now (their
fingerprint and their data), and a run folder's saved config and the arm's config now.

Below the study folder (`mlsm.study.folder`), which asks it whether a stage is done, and the
stages' inputs (`mlsm.study.reuse`), which compute what is compared; it opens only the run
folder's config.yaml.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlsm.artifacts.fingerprint import settings_fingerprint
from mlsm.config import config_to_dict
from mlsm.errors import UserError
from mlsm.inputs import read_yaml
from mlsm.run_config import RunConfig

VOLATILE = (("train", "threads"), ("train", "device"), ("train", "signal_exit_zero"),
            ("train", "eval_every"), ("train", "eval_batches"))  # none changes a weight
"""Config keys that may change between a run and its resumption (they do not change the result)."""

DATA = "data"
"""The inputs key of the content of the data paths a stage reads: recorded with the inputs and
compared by `same_data`, but not hashed into the fingerprint, so the fingerprints of studies
recorded before it stay the same (a running study resumes by them)."""


def fingerprint_of(inputs: dict[str, Any]) -> str:
    """The fingerprint a stage record keeps of its inputs (each itself a fingerprint, or a plain
    setting; `DATA` aside)."""
    return settings_fingerprint({k: v for k, v in inputs.items() if k != DATA})


def same_data(recorded: Any, inputs: dict[str, Any]) -> bool:
    """Whether a stage record's (or row's) `DATA` equals that of `inputs`: a data path whose
    content changed in place is another input. A record from before `DATA` was kept cannot tell
    (it is recorded with it at the stage's next run); a path not found now (None) is not
    judged."""
    old, now = (recorded or {}).get(DATA), inputs.get(DATA)
    if not isinstance(old, dict) or not isinstance(now, dict):
        return True
    return all(old.get(k) == v for k, v in now.items() if v is not None)


def record_matches(record: dict[str, Any], inputs: dict[str, Any]) -> bool:
    """Whether a stage record (status.json's) was made from `inputs`: the same fingerprint and
    the same data."""
    return record.get("fingerprint") == fingerprint_of(inputs) and \
        same_data(record.get("inputs"), inputs)


def without_volatile(config: dict[str, Any]) -> dict[str, Any]:
    """`config` (a run config as a dict, changed in place) less the `VOLATILE` keys."""
    for group, key in VOLATILE:
        config.get(group, {}).pop(key, None)
    return config


def check_same_config(run_dir: Path, arm: str, cfg: RunConfig) -> None:
    """A run folder written with a different resolved config is an error naming the arm and key.
    A config.yaml that is torn or of the wrong shape (hand-edited) is not compared: `pretrain`
    rewrites it on resume and checks the config of the checkpoint it resumes from instead."""
    saved_path = run_dir / "config.yaml"
    if not saved_path.is_file():
        return
    try:
        saved = read_yaml(saved_path, "run config", "")
    except UserError:
        return
    if not isinstance(saved, dict):
        return
    saved = {group: keys for group, keys in saved.items() if isinstance(keys, dict)}
    diff = _first_difference(without_volatile(saved), without_volatile(config_to_dict(cfg)))
    if diff:
        key, old, new = diff
        raise UserError(f"arm {arm}: {key} is {new!r} in the study file but {old!r} in "
                        f"the run already in {run_dir}; restore it, or rename the arm / "
                        "delete that run to train anew")


def _first_difference(a: Any, b: Any, prefix: str = "") -> tuple[str, Any, Any] | None:
    if isinstance(a, dict) and isinstance(b, dict):
        # a key only in `b` is a config field added to mlsm since the run: its default applies
        for key in sorted(a):
            diff = _first_difference(a.get(key), b.get(key), f"{prefix}.{key}" if prefix else key)
            if diff:
                return diff
        return None
    return None if a == b else (prefix, a, b)
