"""The fingerprints every reuse compares: content decides them, names and copies do not."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlsm.artifacts.fingerprint import (
    differences,
    folder_fingerprint,
    require_same,
    settings_fingerprint,
)
from mlsm.errors import UserError

_json = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=10)


@given(st.dictionaries(st.text(max_size=6), _json, max_size=6))
def test_settings_fingerprint_ignores_key_order(settings: dict) -> None:
    reordered = dict(reversed(list(settings.items())))
    assert settings_fingerprint(settings) == settings_fingerprint(reordered)


def test_settings_fingerprint_sees_every_value() -> None:
    base = {"lr": 1e-4, "weight_decay": 0.01, "order": [1, 2]}
    seen = {settings_fingerprint(base)}
    for change in ({"lr": 2e-4}, {"weight_decay": 0.0}, {"order": [2, 1]}, {"extra": None}):
        seen.add(settings_fingerprint({**base, **change}))
    assert len(seen) == 5


def test_folder_fingerprint_follows_content_not_path(tmp_path: Path) -> None:
    a = tmp_path / "a"
    a.mkdir()
    (a / "model.safetensors").write_bytes(b"\x00" * 100)
    (a / "config.json").write_text("{}")
    (a / "training_state.pt").write_bytes(b"optimizer")
    before = folder_fingerprint(a)
    shutil.copytree(a, tmp_path / "b")
    assert folder_fingerprint(tmp_path / "b") == before  # a copy is the same model
    (a / "training_state.pt").write_bytes(b"other optimizer state")
    assert folder_fingerprint(a) == before  # optimizer state decides no output
    (a / "model.safetensors").write_bytes(b"\x00" * 99 + b"\x01")  # same size, one byte
    assert folder_fingerprint(a) != before
    (a / "model.safetensors").write_bytes(b"\x00" * 100)
    (a / "tokenizer.json").write_text("{}")
    assert folder_fingerprint(a) != before


def test_require_same_names_what_differs() -> None:
    require_same({"a": 1}, {"a": 1}, "cell", "fix")
    assert differences({"a": 1, "b": 2}, {"a": 1, "b": 3, "c": 0}) == ["b: 2 -> 3", "c: None -> 0"]
    with pytest.raises(UserError, match=r"cell was made .*weight_decay: 0.01 -> 0.1.*; pass --x"):
        require_same({"weight_decay": 0.01}, {"weight_decay": 0.1}, "cell", "pass --x")
    with pytest.raises(UserError, match=r"and 2 more"):
        require_same({k: 0 for k in "abcde"}, {k: 1 for k in "abcde"}, "cell", "fix")
