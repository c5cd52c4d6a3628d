"""docs/study-reference.md, generated from the study file's dataclasses (`mlsm.study.spec`).

`python -m mlsm.study.reference > docs/study-reference.md` writes it; tests/test_docs_truth.py
checks that the file is what this prints, as tests/test_docs.py does for docs/configuration.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mlsm.config import field_docs
from mlsm.evaluate.readouts import ReadoutSpec
from mlsm.study.hypotheses import Hypothesis
from mlsm.study.spec import (
    ArmDictionary,
    ArmSpec,
    BlimpSpec,
    CorpusSpec,
    DictionarySpec,
    ExecutorSpec,
    FinetuneSpec,
    ProbeSpec,
    StudySpec,
)

# (key in the study file, how it is written, its dataclass)
GROUPS: list[tuple[str, str, type]] = [
    ("corpus", "corpus:", CorpusSpec),
    ("dictionary", "dictionary:", DictionarySpec),
    ("arms", "arms: {NAME: {...}} (one entry per arm)", ArmSpec),
    ("arms.NAME.dictionary", "arms: {NAME: {dictionary: {...}}}", ArmDictionary),
    ("probe", "probe:", ProbeSpec),
    ("finetune", "finetune:", FinetuneSpec),
    ("blimp", "blimp:", BlimpSpec),
    ("executor", "executor:", ExecutorSpec),
    ("readout", "readout: (absent = no readout stage)", ReadoutSpec),
    ("hypotheses", "hypotheses: [{...}, ...] (one entry per hypothesis)", Hypothesis),
]


def _default(f: dataclasses.Field) -> str:
    if f.default_factory is not dataclasses.MISSING:
        value: Any = f.default_factory()
    elif f.default is dataclasses.MISSING:
        return "required"
    else:
        value = f.default
    if dataclasses.is_dataclass(value):
        return "(group below)"
    return f"`{value!r}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")  # a bar (|V|) would split the Markdown cell


def _table(cls: type) -> list[str]:
    docs = field_docs(cls)
    rows = ["| key | default | meaning |", "|---|---|---|"]
    rows += [f"| `{f.name}` | {_cell(_default(f))} | {_cell(docs.get(f.name, ''))} |"
             for f in dataclasses.fields(cls)]
    return [*rows, ""]


def study_reference() -> str:
    """Markdown reference of every study-file key: default and docstring."""
    lines = ["# Study-file reference", "",
             "Generated from the dataclasses in `src/mlsm/study/spec.py` (and the `Hypothesis`",
             "and `ReadoutSpec` they hold) by",
             "`python -m mlsm.study.reference > docs/study-reference.md`. A study file is YAML;",
             "every key is checked and an unknown one is a one-line error naming the valid keys.",
             "How the stages use them: [study.md](study.md); the run-config keys of `base` and",
             "of an arm's `overrides`: [configuration.md](configuration.md).", "",
             "## top level", "", *_table(StudySpec)]
    for _, written, cls in GROUPS:
        lines += [f"## `{written}`", "", *_table(cls)]
    return "\n".join(lines)


if __name__ == "__main__":
    print(study_reference())
