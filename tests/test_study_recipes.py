"""A study's arms resolve to their recipes, and a study can set every fine-tuning setting."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest
import yaml

from mlsm.config import config_to_dict
from mlsm.errors import UserError
from mlsm.run_config import load_config
from mlsm.study.runner import Study
from mlsm.study.spec import FinetuneSpec, load_study

ROOT = Path(__file__).resolve().parents[1]
HITCHHIKER = ROOT / "configs" / "hitchhiker"
PAPER_STUDY = ROOT / "studies" / "paper_table1.yaml"



def _readme_loop(var: str) -> tuple[int, ...]:
    """The values of the `for VAR in ...; do` loop of configs/hitchhiker/README.md's grid."""
    text = (HITCHHIKER / "README.md").read_text(encoding="utf-8")
    return tuple(int(v) for v in re.search(rf"for {var} in ([\d ]+); do", text)[1].split())


# the README's grid: Table 1 / Fig. 2's teacher layers (k = 3072), Table 2's k (l = 10)
LAYERS, KS = _readme_loop("L"), _readme_loop("K")
# arm of studies/paper_table1.yaml -> (recipe, the grid overrides of configs/hitchhiker/README.md)
PAPER_GRID = {
    "mlm": ("mlm", []),
    "kd": ("kd", []),
    **{f"mlsm_l{layer}_k3072": ("mlsm", [f"objective.layer={layer}"]) for layer in LAYERS},
    **{f"mlsm_l10_k{k}": ("mlsm", []) for k in KS},
    "mtl_l10_kappa025": ("mtl", ["objective.kappa=0.25"]),
    "mtl_l10_kappa05": ("mtl", []),
    "mtl_l10_kappa1": ("mtl", ["objective.kappa=1"]),
}


def test_paper_study_arms_are_the_hitchhiker_recipes(tmp_path) -> None:
    """Every field of every arm's resolved run config equals `mlsm pretrain --config RECIPE` with
    the README's grid overrides, but for what the study sets: store, run folder, dictionary and
    save_every."""
    spec = load_study(PAPER_STUDY, out=str(tmp_path / "study"))
    assert set(spec.arms) == set(PAPER_GRID)  # the whole grid, no arm more
    study = Study(spec, log=lambda s: None)
    for arm, (recipe, grid) in PAPER_GRID.items():
        study_set = [f"data.store={study.store}", f"train.out={study.run_dir(arm)}",
                     "train.save_every=5000"]
        dictionary = study.dictionary_path(arm)
        if dictionary is not None:
            study_set.append(f"objective.dictionary={dictionary}")
            layer, k = re.match(r"mlsm_l(\d+)_k(\d+)$", arm).groups() if arm.startswith(
                "mlsm") else ("10", "3072")
            assert dictionary.name.startswith(f"bert-base-cased_l{layer}_k{k}_lam0.05"), arm
        expected = load_config(HITCHHIKER / f"{recipe}.yaml", [*grid, *study_set])
        assert config_to_dict(study.arm_config(arm)) == config_to_dict(expected), arm


def test_paper_study_probe_and_finetuning_are_the_papers(tmp_path) -> None:
    spec = load_study(PAPER_STUDY, out=str(tmp_path / "study"))
    assert (spec.probe.recipe, spec.probe.steps) == ("paper", 10_000)
    # the official finetune_eval.py: one shuffle for every seed, no clipping; dev sets only
    ft = spec.finetune
    assert (ft.fixed_order, ft.clip, ft.eval_test) == (True, 0.0, False)
    assert ft.max_len == 512  # the official finetune_eval.py's model_max_length


def test_paper_study_covers_table_1_and_table_2(tmp_path) -> None:
    """Table 1 / Fig. 2 is the layer ablation (every layer of the README's grid at k = 3072) and
    Table 2 the k grid at l = 10, each with its own dictionary; read from the resolved arms, not
    their names."""
    spec = load_study(PAPER_STUDY, out=str(tmp_path / "study"))
    study = Study(spec, log=lambda s: None, create=False)
    cells = {(study.arm_config(a).objective.layer, spec.arms[a].dictionary.k)
             for a in spec.arms if study.arm_config(a).objective.name == "mlsm"}
    assert {(layer, 3072) for layer in LAYERS} | {(10, k) for k in KS} == cells
    latent = [a for a in spec.arms if spec.arms[a].dictionary is not None]
    assert len({study.dictionary_path(a) for a in latent}) == len(LAYERS) + len(KS) - 1


def _study(tmp_path: Path, arms: dict, base: dict | None = None) -> Study:
    folder = tmp_path / "studies"
    folder.mkdir(exist_ok=True)
    path = folder / "s.yaml"
    path.write_text(yaml.safe_dump({"name": "s", "out": str(tmp_path / "out"), "arms": arms,
                                    "base": base or {}}))
    return Study(load_study(path), log=lambda s: None)


def test_recipe_is_the_arms_base_then_base_overrides_and_objective(tmp_path) -> None:
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "r.yaml").write_text(yaml.safe_dump({
        "data": {"max_len": 64, "mask_split": [1.0, 0.0, 0.0]},
        "optim": {"lr": 3e-4, "eps": 1e-8},
        "objective": {"name": "kd", "teacher": "t", "teacher_input": "original"}}))
    study = _study(tmp_path, {
        "same": {"recipe": "../recipes/r.yaml"},
        "merged": {"recipe": "../recipes/r.yaml", "objective": {"temperature": 2.0},
                   "overrides": {"optim": {"lr": 1e-3}}},
        "other": {"recipe": "../recipes/r.yaml", "objective": {"name": "mlm"}},
        "plain": {}}, base={"train": {"steps": 7}})
    same = study.arm_config("same")
    assert (same.data.max_len, same.data.mask_split, same.optim.eps, same.train.steps) == \
        (64, [1.0, 0.0, 0.0], 1e-8, 7)
    assert (same.objective.name, same.objective.teacher_input) == ("kd", "original")
    merged = study.arm_config("merged")
    assert (merged.objective.temperature, merged.objective.teacher_input, merged.optim.lr) == \
        (2.0, "original", 1e-3)
    assert study.arm_config("other").objective.name == "mlm"  # no kd key leaks into it
    assert study.arm_config("plain").objective.name == "mlm"
    assert study.arm_config("plain").data.max_len == 128


def test_bad_recipes_are_one_line(tmp_path) -> None:
    with pytest.raises(UserError, match=r"arms.a.recipe nope.yaml is not a file"):
        _study(tmp_path, {"a": {"recipe": "nope.yaml"}})
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(UserError, match=r"arms.a.recipe .* must be a YAML mapping"):
        _study(tmp_path, {"a": {"recipe": "../list.yaml"}})
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({"optim": {"lrr": 1}}))
    with pytest.raises(UserError, match=r"optim.lrr"):
        _study(tmp_path, {"a": {"recipe": "../bad.yaml"}})
    with pytest.raises(UserError, match=r"arms.a.objective has no name"):
        _study(tmp_path, {"a": {"objective": {"kappa": 1.0}}})


# finetune() parameters a study sets itself rather than through its `finetune:` spec
STUDY_OWNED = {"models", "tasks", "config", "results", "device", "readiness", "report_to",
               "settings"}


def test_every_finetune_setting_is_settable_in_a_study() -> None:
    from mlsm.evaluate.finetune.finetune import finetune
    from mlsm.evaluate.finetune.finetune_config import FinetuneConfig

    assert set(inspect.signature(finetune).parameters) <= STUDY_OWNED  # settings: the config's
    fields = {f.name for f in dataclasses.fields(FinetuneSpec)}
    assert {f.name for f in dataclasses.fields(FinetuneConfig)} <= fields
    assert issubclass(FinetuneSpec, FinetuneConfig)  # declared once, not copied


def test_the_study_passes_every_finetune_setting_through(tmp_path, monkeypatch) -> None:
    """Each FinetuneSpec field, set to a value other than its default, reaches finetune()."""
    import mlsm.evaluate.finetune.finetune as ft_module
    from mlsm.evaluate.finetune.finetune_config import FinetuneConfig, config_of
    from mlsm.study import stages

    values = {"tasks": ["rte"], "data_dir": "/data", "readiness": [0.5], "seeds": 2,
              "lrs": [3e-5], "epochs": 4, "batch_size": 8, "max_len": 64,
              "max_train_examples": 100, "warmup_ratio": 0.2, "weight_decay": 0.1,
              "fixed_order": True, "clip": 0.0, "eval_test": True, "max_steps": 100,
              "head": "mean", "val_fraction": 0.1, "temperature": 0.1, "recompute": True}
    defaults = FinetuneSpec()
    # `preset` stands for a set of these values (tests/test_protocol.py checks it reaches finetune)
    assert set(values) == {f.name for f in dataclasses.fields(FinetuneSpec)} - {"preset"}
    assert all(values[k] != getattr(defaults, k) for k in values)
    study = _study(tmp_path, {"mlm": {}})
    study.spec = dataclasses.replace(study.spec, finetune=FinetuneSpec(**values))
    seen: dict = {}
    monkeypatch.setattr(ft_module, "finetune", lambda models, tasks, config, **kw: seen.update(
        kw, models=models, tasks=tasks, config=config))
    stages._finetune(study, "mlm")
    cfg = config_of(seen["config"], {})
    expect = {k: v for k, v in values.items() if k not in ("tasks", "readiness")}
    assert {k: getattr(cfg, k) for k in expect} == expect
    assert type(cfg) is FinetuneConfig and seen["tasks"] == ["rte"]
    assert seen["models"] == [f"mlm@50%={study.checkpoint('mlm', 0.5)}"]
