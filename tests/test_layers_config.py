"""The configuration layer without circles, and each range declared once beside its field.

`mlsm.config` is the schema: a leaf that imports no objective (not even inside a function) and
keeps no table that other modules fill. The objective union resolves in `mlsm.objectives`, a whole
run config in `mlsm.run_config`. Ranges are `ranged(default, (predicate, text))` on the field
itself; λ's range is `mlsm.defaults.lam_range`, read by every place that takes a λ.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import math
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

from mlsm import config, defaults
from mlsm.config import GROUPS, field_check
from mlsm.errors import UserError
from mlsm.objectives import INTERNAL, OBJECTIVES
from mlsm.run_config import config_from_dict

ROOT = Path(__file__).resolve().parents[1]
# what the leaf may import (limits: the bounds some fields default to)
CONFIG_IMPORTS = {"mlsm", "mlsm.errors", "mlsm.inputs", "mlsm.fileio", "mlsm.limits"}


def _imports(relative: str) -> set[str]:
    """The mlsm modules a source file imports, at the top or inside a function (a lazy import is
    still a circle)."""
    tree = ast.parse((ROOT / "src" / "mlsm" / relative).read_text())
    named = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            named.add(node.module)
        elif isinstance(node, ast.Import):
            named.update(a.name for a in node.names)
    return {m for m in named if m == "mlsm" or m.startswith("mlsm.")}


def test_the_schema_imports_no_objective_anywhere_in_its_source() -> None:
    ours = _imports("config.py")
    assert ours <= CONFIG_IMPORTS, sorted(ours - CONFIG_IMPORTS)


@pytest.mark.parametrize("relative", ["train/throughput.py", "train/flops.py"])
def test_flop_accounting_reaches_no_higher_floor(relative: str) -> None:
    """The training loop logs FLOP/s through train/throughput.py, which counts with
    train/flops.py: neither reaches up into evaluate/ or study/, nor into the rest of train/."""
    beside = {"mlsm.train", "mlsm.train.flops", "mlsm.train.throughput"}
    up = [m for m in _imports(relative) if m.startswith(("mlsm.evaluate", "mlsm.study",
                                                         "mlsm.run_config"))
          or (m.startswith("mlsm.train") and m not in beside)]
    assert not up, up


def test_using_the_schema_loads_no_objective() -> None:
    """In a fresh interpreter: build every group, parse overrides, dump a config; no objective
    module (nor the run-config door above them) gets loaded."""
    code = """if True:
        import sys, dataclasses
        from mlsm import config
        groups = {n: config.build_dataclass(c, {}, n) for n, c in config.GROUPS.items()}
        config.check_groups(groups["model"], groups["train"])
        config.merge({}, config.parse_overrides(["train.steps=3", "objective.name=mlsm"]))
        config.config_to_dict(groups["data"])
        config.field_docs(config.TrainConfig)
        print(sorted(m for m in sys.modules
                     if m.startswith(("mlsm.objectives", "mlsm.run_config"))))
    """
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_schema_keeps_no_table_filled_from_outside() -> None:
    for gone in ("FIELD_CHECKS", "OBJECTIVE_CONFIGS", "register_objective", "load_config",
                 "config_from_dict", "resolve_objective"):
        assert not hasattr(config, gone), gone


# Every range that FIELD_CHECKS used to hold (commit 788daa3), with a value outside it. The
# objective's options are looked up on every objective Config that has the key.
FORMER_TABLE: list[tuple[str, object]] = [
    ("data.max_len", 3), ("data.mask_rate", 1.0), ("data.mask_split", [0.5, 0.5, 0.5]),
    ("optim.lr", -1.0), ("optim.weight_decay", -0.1), ("optim.eps", 0.0),
    ("optim.betas", [0.9, 1.0]), ("optim.schedule", "cosine"), ("optim.warmup", -1.0),
    ("optim.decay", -1.0), ("optim.min_lr_ratio", 1.5), ("optim.clip", -1.0),
    ("model.max_params", 0.0), ("train.steps", 0), ("train.batch_size", 0),
    ("train.micro_batch_size", -1), ("train.precision", "fp8"), ("train.device", "tpu"),
    ("train.out", ""), ("train.readiness", [0.0]), ("train.save_every", -1),
    ("train.keep_last", -1), ("train.log_every", 0), ("train.peak_flops", -1.0),
    ("train.threads", 1025), ("train.report_to", ["neptune"]),
    ("objective.temperature", 0.0), ("objective.lam", 1.0), ("objective.fista_iters", 0),
    ("objective.kappa", 1.5), ("objective.clm_fraction", -0.1),
    ("objective.decoder_layers", -1), ("objective.decoder_width", -1),
    ("objective.decoder_heads", -1),
]


def _fields_named(key: str) -> list[tuple[str, dataclasses.Field]]:
    group, name = key.split(".")
    classes = ({o: c.Config for o, c in {**OBJECTIVES, **INTERNAL}.items()} if group == "objective"
               else {group: GROUPS[group]})
    return [(owner, f) for owner, cls in classes.items() for f in dataclasses.fields(cls)
            if f.name == name]


@pytest.mark.parametrize(("key", "bad"), FORMER_TABLE, ids=[k for k, _ in FORMER_TABLE])
def test_each_former_table_range_lives_on_its_field(key: str, bad: object) -> None:
    found = _fields_named(key)
    assert found, f"{key}: no field of that name"
    for owner, f in found:
        check = field_check(f)
        assert check is not None, f"{key} ({owner}): no range beside the field"
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING \
            else f.default
        assert check[0](default) and not check[0](bad), (key, owner, default, bad)
        group, name = key.split(".")
        raw = {"objective": {"name": owner, name: bad}} if group == "objective" \
            else {group: {name: bad}}
        with pytest.raises(UserError, match=rf"^{key} must be "):
            config_from_dict(raw)


def test_a_config_built_in_python_meets_the_same_ranges() -> None:
    """build_objective with a typed Config (the Python API, MLSMTrainer) checks the fields'
    ranges too, not only a config read from YAML."""
    import torch

    from mlsm.objectives import Context, build_objective
    from mlsm.objectives.kd import KDConfig
    from mlsm.objectives.mae_lm import MAELMConfig

    ctx = Context(None, torch.device("cpu"), 1)  # refused before the tokenizer is read
    with pytest.raises(UserError, match=r"^objective.temperature must be positive, got 0"):
        build_objective(KDConfig(teacher="t", temperature=0.0), ctx)
    with pytest.raises(UserError, match=r"^objective.delta must be in \[0, 1\]"):
        build_objective(MAELMConfig(delta=1.5), ctx)


def _numeric_fields() -> list[tuple[str, dataclasses.Field]]:
    classes = [*GROUPS.values(), *(c.Config for c in {**OBJECTIVES, **INTERNAL}.values())]
    out = []
    for cls in classes:
        hints = typing.get_type_hints(cls)
        out += [(cls.__name__, f) for f in dataclasses.fields(cls) if hints[f.name] in (int, float)]
    return out


def test_every_number_declares_its_range_or_is_unbounded_on_purpose() -> None:
    """A new int/float setting comes with its range beside it; seeds (any whole number 0 or more,
    checked for every `*seed`) and the teacher layer (-1 = the dictionary's) are unbounded."""
    unbounded = {"seed", "layer"}
    missing = [f"{owner}.{f.name}" for owner, f in _numeric_fields()
               if field_check(f) is None and f.name not in unbounded]
    assert not missing, missing


# ---------------------------------------------------------------------------- λ, declared once


LAMS = [-0.5, 0.0, 1e-6, 0.05, 0.999, 1.0, 2.0, 1e308]


def _refuses(fn: typing.Callable[[], object]) -> bool:
    try:
        fn()
    except (UserError, argparse.ArgumentTypeError):  # argparse types raise the latter
        return True
    return False


@pytest.mark.parametrize("lam", LAMS)
def test_every_place_that_takes_a_lambda_agrees_with_the_one_range(lam: float) -> None:
    from mlsm.study.spec import DictionarySpec, arm_dictionary_of
    from mlsm.teacher.online_dictionary import _check_options

    inside = 0 < lam < 1  # Berend 2023: unit atoms, unit states, so lam >= 1 codes nothing
    assert defaults.lam_range()[0](lam) == inside
    assert _refuses(lambda: _check_options(4, lam)) == (not inside)
    group = DictionarySpec(n_vectors=10_000)
    assert _refuses(lambda: arm_dictionary_of("a", {"lam": lam}, group)) == (not inside)
    # objective.lam: 0 leaves λ to the dictionary; otherwise the same range
    for name in ("mlsm", "mlsm_naive", "mtl", "mae_mlsm"):
        refused = _refuses(lambda n=name: config_from_dict({"objective": {"name": n, "lam": lam}}))
        assert refused == (not (inside or lam == 0)), (name, lam)


def test_lambda_of_two_in_a_study_file_is_refused_at_load_in_one_line(tmp_path: Path) -> None:
    """`lam: 2` used to pass the study load (its check had no upper bound) and fail hours later,
    at the dictionary stage."""
    from mlsm.study.spec import load_study

    out = tmp_path / "study"
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump({
        "out": str(out),
        "arms": {"mlm": {"objective": {"name": "mlm"}},
                 "mlsm": {"objective": {"name": "mlsm"}, "dictionary": {"lam": 2}}},
    }))
    with pytest.raises(UserError) as err:
        load_study(path)
    message = str(err.value)
    assert "\n" not in message and message.startswith("arms.mlsm.dictionary.lam must be"), message
    assert "(0, 1)" in message
    assert not out.exists()
    assert math.isclose(defaults.LAM, 0.05)  # the hint's λ is the one default
