"""BLiMP's and the readouts' settings are each declared once (issue 33, item 3).

Every field of `BlimpConfig` is a flag of `mlsm blimp` (same default), a keyword of `evaluate_blimp`
and a key of a study's `blimp:` group, and it changes what it says it changes (scored on the toy
pair sets of tests/test_blimp.py by a scorer whose preferences are known). Every field of
`ReadoutSpec` is a flag of `mlsm readout` and a key of a study's `readout:` group. The study's own
ranges live beside its fields, so `build_dataclass` keeps no side table of checks.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest

from mlsm.cli import build_parser
from mlsm.cli.dataclass_flags import flag_values
from mlsm.config import build_dataclass, field_check
from mlsm.errors import UserError
from mlsm.evaluate.readouts import ReadoutSpec
from mlsm.evaluate.zeroshot.blimp import evaluate_blimp
from mlsm.evaluate.zeroshot.blimp_config import BlimpConfig
from tests.helpers import UnigramScorer

pytestmark = pytest.mark.usefixtures("one_torch_thread_per_module")

BLIMP_OTHER = {"limit_per_phenomenon": 1, "phenomena": ["par_a", "par_c"],
               "variant": "within_word_l2r", "token_budget": 64, "max_sentence_chars": 50}
READOUT_OTHER = {"kinds": ["pairs"], "glue": "g", "tasks": ["sst2", "rte"], "max_train": 5,
                 "max_len": 16, "pairs": ["a b", "c"], "pair_limit": 0, "store": "s",
                 "heldout_store": "h", "masked_batches": 2, "pppl_batches": 0, "batch_size": 4}


def _flags(values: dict, nargs: tuple[str, ...] = ()) -> list[str]:
    out: list[str] = []
    for name, value in values.items():
        out.append(f"--{name.replace('_', '-')}")
        if isinstance(value, list):
            out += value if name in nargs else [",".join(value)]
        else:
            out.append(str(value))
    return out


def _parse(verb: str, extra: list[str]) -> object:
    return build_parser()[0].parse_args([verb, "model", "--out", "o", *extra])


def test_other_values_cover_every_field_and_differ_from_the_defaults() -> None:
    for cls, other in ((BlimpConfig, BLIMP_OTHER), (ReadoutSpec, READOUT_OTHER)):
        default = dataclasses.asdict(cls())
        assert set(other) == set(default), cls
        assert all(other[k] != v for k, v in default.items()), cls


def test_every_blimp_setting_is_a_flag_with_the_dataclass_default() -> None:
    assert flag_values(_parse("blimp", []), BlimpConfig) == {}  # not given: the dataclass's
    given = flag_values(_parse("blimp", _flags(BLIMP_OTHER, nargs=("phenomena",))), BlimpConfig)
    assert given == BLIMP_OTHER
    # the older spelling stays, with 0 = every pair as everywhere else
    assert flag_values(_parse("blimp", ["--limit", "0"]), BlimpConfig) == {
        "limit_per_phenomenon": 0}


def test_every_readout_setting_is_a_flag_with_the_dataclass_default() -> None:
    assert flag_values(_parse("readout", []), ReadoutSpec) == {}
    given = flag_values(_parse("readout", _flags(READOUT_OTHER, nargs=("pairs",))), ReadoutSpec)
    assert given == READOUT_OTHER  # "a b" stays one pair-set path: one word per set


def test_evaluate_blimp_has_no_setting_of_its_own() -> None:
    """Its keywords are BlimpConfig's fields; the signature declares no default of a setting."""
    params = inspect.signature(evaluate_blimp).parameters
    own = {f.name for f in dataclasses.fields(BlimpConfig)} & set(params)
    assert not own, own


def test_each_setting_changes_what_it_says(blimp_dir, tok) -> None:  # noqa: F811
    def score(config: BlimpConfig | None = None, **kw) -> dict:
        return evaluate_blimp(UnigramScorer(), tok, blimp_dir, config, keep_scores=True, **kw)

    base = score()
    assert (base["n_pairs"], base["n_phenomena"], base["variant"]) == (8, 3, "original")
    assert score(limit_per_phenomenon=1)["n_pairs"] == 3  # one pair of each of three
    assert set(score(phenomena=["par_a", "par_c"])["phenomena"]) == {"par_a", "par_c"}
    assert score(variant="within_word_l2r")["variant"] == "within_word_l2r"
    # batching is not a score: a tiny budget gives the same PLLs
    def plls(result: dict) -> list[float]:
        return [x for p in result["pairs"] for x in (p["good"], p["bad"])]

    assert plls(score(token_budget=4)) == pytest.approx(plls(base))
    with pytest.raises(UserError, match="max_sentence_chars|characters"):
        score(max_sentence_chars=3)
    # a config and keywords: the keywords win, None leaves the config's
    both = score(BlimpConfig(limit_per_phenomenon=1, phenomena=["par_a"]),
                 phenomena=None, limit_per_phenomenon=2)
    assert (both["n_pairs"], set(both["phenomena"])) == (2, {"par_a"})


def test_blimp_settings_are_refused_out_of_range_in_one_line() -> None:
    with pytest.raises(UserError, match=r"^evaluate_blimp\(\)\.limit_per_phenomenon must be"):
        BlimpConfig.over(None, {"limit_per_phenomenon": -1})
    with pytest.raises(UserError, match=r"unknown key evaluate_blimp\(\)\.limit\b"):
        BlimpConfig.over(None, {"limit": 5})
    with pytest.raises(UserError, match=r"variant"):
        BlimpConfig.over(None, {"variant": "l2r"})
    with pytest.raises(UserError, match="config must be a BlimpConfig"):
        BlimpConfig.over(ReadoutSpec(), {})  # type: ignore[arg-type]


def _study(tmp_path: Path, **groups: dict) -> object:
    from mlsm.study.spec import study_from_dict

    return study_from_dict({"out": str(tmp_path), **groups,
                            "arms": {"m": {"objective": {"name": "mlm"}}}})


def test_every_setting_is_a_study_key(tmp_path: Path) -> None:
    spec = _study(tmp_path, blimp={**BLIMP_OTHER, "data": ["x"]}, readout=READOUT_OTHER)
    assert dataclasses.asdict(BlimpConfig.over(spec.blimp, {})) == BLIMP_OTHER
    assert dataclasses.asdict(spec.readout) == READOUT_OTHER
    with pytest.raises(UserError, match=r"^blimp.variant"):
        _study(tmp_path, blimp={"variant": "l2r"})
    with pytest.raises(UserError, match=r"^readout.kinds must be readout kinds among"):
        _study(tmp_path, readout={"kinds": ["probe", "bogus"]})


def test_the_study_stage_scores_with_the_groups_settings(tmp_path: Path, monkeypatch) -> None:
    """Each set is scored with the group's settings; the per-set limit wins and `phenomena` is the
    first set's only. (evaluate_blimp itself is tested above; here, what the stage gives it.)"""
    import mlsm.evaluate.probe.probe as probe
    import mlsm.evaluate.zeroshot.blimp as blimp
    import mlsm.evaluate.zeroshot.unigram as unigram
    from mlsm.study import reuse, stages

    spec = _study(tmp_path, blimp={**BLIMP_OTHER, "data": ["one", "two"], "limits": [0, 7]})
    seen: list[BlimpConfig] = []

    def record(model, tokenizer, data, config=None, **kw):
        seen.append(BlimpConfig.over(config, {k: v for k, v in kw.items()
                                          if k not in ("progress", "control")}))
        if len(seen) == 2:
            raise _Stop  # both sets seen: the rest of the stage is not the claim here
        return {"overall": 0.5, "n_pairs": 1, "fields": {}, "tests": {},
                "phenomena": {"u": {"correct": 1, "accuracy": 1.0, "control_accuracy": 0.5}},
                "control": {"overall": 0.5}}

    monkeypatch.setattr(blimp, "evaluate_blimp", record)
    monkeypatch.setattr(probe, "load_scorer", lambda folder: (None, None))
    monkeypatch.setattr(unigram.UnigramControl, "consumed_by", staticmethod(lambda s: None))
    monkeypatch.setattr(stages, "heldout_masked_tokens", lambda *a, **k: {})
    monkeypatch.setattr(reuse, "blimp_inputs", lambda *a: {})
    study = SimpleNamespace(spec=spec, reusable=lambda *a, **k: False, is_latent=lambda a: False,
                            checkpoint=lambda a, f: tmp_path, store=tmp_path, root=tmp_path)
    with pytest.raises(_Stop):
        stages._blimp(study, "m", 1.0)
    assert dataclasses.asdict(seen[0]) == BLIMP_OTHER
    # the second set: its own limit, every phenomenon, the group's other settings
    assert dataclasses.asdict(seen[1]) == {**BLIMP_OTHER, "limit_per_phenomenon": 7,
                                           "phenomena": []}


class _Stop(Exception):
    pass


def test_the_fingerprint_holds_what_decides_a_score(tmp_path: Path) -> None:
    from mlsm.study import reuse

    def settings(**blimp: object) -> str:
        spec = _study(tmp_path, blimp={"data": ["x"], **blimp})
        return reuse.settings_fingerprint(spec.blimp.decisive())  # what blimp_inputs records

    base = settings()
    assert settings(variant="within_word_l2r") != base
    assert settings(limit_per_phenomenon=3) != base
    assert settings(token_budget=64) == settings(max_sentence_chars=99) == base
    assert settings(readiness=[0.5]) == base  # which models, not how one is scored



def test_one_convention_a_new_setting_decides_until_marked() -> None:
    """Both configs mark the settings that cannot change a result (`decides: False`); a field
    without a mark decides, so a forgotten mark makes a fingerprint stricter, never blind."""
    from mlsm.config import deciding

    @dataclasses.dataclass
    class Extended(BlimpConfig):
        new_knob: int = 3
        batching: int = dataclasses.field(default=8, metadata={"decides": False})

    assert deciding(Extended())["new_knob"] == 3 and "batching" not in deciding(Extended())
    assert "new_knob" in Extended().decisive()


def test_a_fine_tuning_cell_fingerprint_holds_what_decides_its_scores() -> None:
    from mlsm.evaluate.finetune.finetune_config import FinetuneConfig

    base = FinetuneConfig().decisive("classification", True)
    for key, value in [("epochs", 1), ("max_steps", 9), ("batch_size", 8), ("head", "mean"),
                       ("val_fraction", 0.1), ("max_len", 64), ("max_train_examples", 50),
                       ("warmup_ratio", 0.1), ("weight_decay", 0.0), ("fixed_order", True),
                       ("clip", 0.0), ("eval_test", True)]:
        assert FinetuneConfig(**{key: value}).decisive("classification", True) != base, key
    for key, value in [("seeds", 2), ("lrs", [1e-3]), ("preset", "x"), ("data_dir", "/d"),
                       ("recompute", True), ("temperature", 0.5)]:  # a classifier has none
        assert FinetuneConfig(**{key: value}).decisive("classification", True) == base, key

# One range per former STUDY_CHECKS entry (commit 24c5b73), with a value outside it: each is now
# declared beside its field and refused through the study file in one line.
FORMER_STUDY_TABLE = [
    ("study", "readiness", [0.5, 0.5]), ("study", "seeds", [1, 1]), ("probe", "steps", -1),
    ("finetune", "readiness", [1.5]), ("blimp", "readiness", [0.0]),
    ("blimp", "limit_per_phenomenon", -1), ("blimp", "limits", [-1]),
    ("executor", "jobs", 0), ("executor", "eval_jobs", -1), ("executor", "threads", -1),
    ("readout", "kinds", ["x"]), ("readout", "max_train", -1), ("readout", "pair_limit", -1),
    ("readout", "masked_batches", 0), ("readout", "pppl_batches", -1),
    ("readout", "batch_size", 0), ("readout", "max_len", 7),
]


@pytest.mark.parametrize(("group", "key", "bad"), FORMER_STUDY_TABLE,
                         ids=[f"{g}.{k}" for g, k, _ in FORMER_STUDY_TABLE])
def test_each_former_study_check_lives_on_its_field(group, key, bad, tmp_path: Path) -> None:
    from mlsm.study import spec as study_spec

    assert not hasattr(study_spec, "STUDY_CHECKS")
    assert "checks" not in inspect.signature(build_dataclass).parameters
    cls = {"study": study_spec.StudySpec, "probe": study_spec.ProbeSpec,
           "finetune": study_spec.FinetuneSpec, "blimp": study_spec.BlimpSpec,
           "executor": study_spec.ExecutorSpec, "readout": ReadoutSpec}[group]
    (f,) = [f for f in dataclasses.fields(cls) if f.name == key]
    assert field_check(f) is not None and not field_check(f)[0](bad)
    raw = {key: bad} if group == "study" else {group: {key: bad}}
    with pytest.raises(UserError, match=rf"^{group}.{key} must be "):
        _study(tmp_path, **raw)
