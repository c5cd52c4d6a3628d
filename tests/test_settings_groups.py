"""One settings mechanism (`mlsm.config.Settings`) for every verb's settings group: the dictionary,
the plateau probe, BLiMP scoring and fine-tuning build, read back and merge the same way, and a
study's subclass of each is narrowed to the group wherever a verb takes it."""

from __future__ import annotations

import dataclasses

import pytest

from mlsm.config import Settings
from mlsm.errors import UserError
from mlsm.evaluate.finetune.finetune_config import FinetuneConfig
from mlsm.evaluate.probe.probe_fit_config import ProbeFitConfig
from mlsm.evaluate.zeroshot.blimp_config import BlimpConfig
from mlsm.study.spec import BlimpSpec, DictionarySpec, FinetuneSpec, ProbeSpec
from mlsm.teacher.dictionary_config import DictionaryConfig

# group, its study subclass, one setting changed, and a value that setting refuses
GROUPS = [
    (DictionaryConfig, DictionarySpec, ("lam", 0.1), -1.0),
    (ProbeFitConfig, ProbeSpec, ("patience", 7), 0),
    (BlimpConfig, BlimpSpec, ("limit_per_phenomenon", 5), -1),
    (FinetuneConfig, FinetuneSpec, ("epochs", 2), 0),
]


@pytest.mark.parametrize(("group", "spec", "changed", "bad"), GROUPS,
                         ids=[g.__name__ for g, *_ in GROUPS])
def test_every_group_builds_reads_back_and_merges_alike(group, spec, changed, bad) -> None:
    name, value = changed
    assert group.root() is group and spec.root() is group
    for own in ("build", "given", "over"):  # one mechanism: no group keeps its own copy
        assert own not in vars(group) or own == "build" and group is FinetuneConfig, own
    assert group.over(None, {}) == group()
    config = group.over(None, {name: value})
    assert getattr(config, name) == value and config.given() == {name: value}
    assert group.over(config, {name: None}) == config  # a keyword left at None is not given
    assert getattr(group.over(config, {name: getattr(group(), name)}), name) != value
    narrowed = group.over(spec.build({name: value}), {})  # a study's group, as a verb takes it
    assert type(narrowed) is group and getattr(narrowed, name) == value
    with pytest.raises(UserError, match=f"{name} must be"):
        group.over(None, {name: bad}, "somewhere")
    with pytest.raises(UserError, match=f"somewhere: config must be a {group.__name__}, got dict"):
        group.over({}, {}, "somewhere")


def test_the_groups_are_the_settings_subclasses() -> None:
    """A new settings group joins by subclassing `Settings`; nothing lists the groups elsewhere."""
    found = {c for c in Settings.__subclasses__() if dataclasses.is_dataclass(c)}
    assert found >= {g for g, *_ in GROUPS}
