"""Documentation that is generated from code stays true to it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from mlsm.config import GROUPS, field_docs
from mlsm.objectives import OBJECTIVES
from mlsm.run_config import config_reference

ROOT = Path(__file__).resolve().parents[1]


def test_every_config_field_has_a_docstring() -> None:
    classes = [*GROUPS.values(), *(cls.Config for cls in OBJECTIVES.values())]
    for cls in classes:
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"{cls.__name__}: {missing}"


def test_configuration_reference_is_current() -> None:
    assert (ROOT / "docs" / "configuration.md").read_text().strip() == config_reference().strip(), \
        "regenerate with: python -m mlsm.run_config > docs/configuration.md"
