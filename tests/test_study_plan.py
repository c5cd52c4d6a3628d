"""`mlsm study FILE --print`: every arm's resolved run config and the stages it would run, with
nothing run and nothing written (issue 53: a reader checks a study against its paper without the
Python API)."""

from __future__ import annotations

from pathlib import Path

import yaml

from mlsm.cli import main
from mlsm.config import config_to_dict
from mlsm.run_config import load_config
from mlsm.study.folder import Study
from mlsm.study.spec import load_study
from tests.test_study_recipes import HITCHHIKER, PAPER_GRID, PAPER_STUDY

ROOT = Path(__file__).resolve().parents[1]


def _plan(capsys, argv: list[str]) -> dict:
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert text.startswith("# mlsm study --print")
    return yaml.safe_load(text)


def test_print_resolves_every_arm_to_its_recipe_and_writes_nothing(tmp_path, capsys) -> None:
    """Each printed config is `mlsm pretrain --config RECIPE` with the README's grid overrides and
    what the study sets (built here from the recipe files, not through the study); the study
    folder, and every path the study names in it, stays absent."""
    out = tmp_path / "never" / "study"
    plan = _plan(capsys, ["study", str(PAPER_STUDY), "--out", str(out), "--print"])
    assert not (tmp_path / "never").exists()
    assert list(plan["arms"]) == list(PAPER_GRID)
    study = Study(load_study(PAPER_STUDY, out=str(out)), log=lambda s: None, create=False)
    for arm, (recipe, grid) in PAPER_GRID.items():
        study_set = [f"data.store={out / 'store'}", f"train.out={out / 'runs' / arm}",
                     "train.save_every=5000"]
        dictionary = study.dictionary_path(arm)
        if dictionary is not None:
            study_set.append(f"objective.dictionary={dictionary}")
        expected = load_config(HITCHHIKER / f"{recipe}.yaml", [*grid, *study_set])
        assert plan["arms"][arm]["config"] == config_to_dict(expected), arm
    assert not (tmp_path / "never").exists()


def test_print_lists_the_stages_each_arm_would_run(tmp_path, capsys) -> None:
    """Latent arms get a probe at each BLiMP readiness point, MLM-type arms none; every arm is
    fine-tuned at each fine-tuning readiness point; every distinct dictionary is listed once with
    the arms that share it."""
    plan = _plan(capsys, ["study", str(PAPER_STUDY), "--out", str(tmp_path / "s"), "--print"])
    assert plan["stages"] == ["store", "dictionary", "pretrain", "probe", "finetune", "blimp",
                              "report"]  # no readout group in the paper study
    for arm, entry in plan["arms"].items():
        stages = entry["stages"]
        latent = entry["config"]["objective"]["name"] in ("mlsm", "mtl")
        assert stages[0] == "pretrain: 100000 steps, checkpoints at 10%, 25%, 50%, 100%", arm
        probes = [s for s in stages if s.startswith("probe@")]
        assert probes == (["probe@10%", "probe@25%", "probe@50%", "probe@100%"] if latent
                          else []), arm
        assert [s for s in stages if s.startswith("finetune@")] == [
            f"finetune@{p}: 10 tasks x 5 seeds x 1 lrs" for p in ("10%", "25%", "50%", "100%")]
    shared = {path: d["arms"] for path, d in plan["dictionaries"].items()}
    used = {arm: e["config"]["objective"].get("dictionary") for arm, e in plan["arms"].items()}
    assert shared == {p: [a for a, d in used.items() if d == p] for p in set(used.values()) if p}


def test_print_follows_stages_and_arms(tmp_path, capsys) -> None:
    plan = _plan(capsys, ["study", str(PAPER_STUDY), "--out", str(tmp_path / "s"), "--print",
                          "--stages", "pretrain", "finetune", "--arms", "mlm"])
    assert plan["stages"] == ["pretrain", "finetune"] and list(plan["arms"]) == ["mlm"]
    assert "store" not in plan and "dictionaries" not in plan
    assert list(plan["evaluation"]) == ["finetune"]
    assert not (tmp_path / "s").exists()


def test_print_fills_in_a_preset(tmp_path, capsys) -> None:
    """A study with a fine-tuning preset prints the settings finetune() runs with."""
    from mlsm.evaluate.finetune.protocol import PRESETS

    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"arms": {"mlm": {}}, "out": str(tmp_path / "out"),
                                    "finetune": {"tasks": ["rte"], "preset": "mlm-vs-clm-2025"}}))
    plan = _plan(capsys, ["study", str(path), "--print"])
    fixed = PRESETS["mlm-vs-clm-2025"].values
    assert {k: plan["evaluation"]["finetune"][k] for k in fixed if k != "seeds"} == \
        {k: v for k, v in fixed.items() if k != "seeds"}
    cells = f"x {fixed['seeds']} seeds x {len(fixed['lrs'])} lrs"
    assert cells in plan["arms"]["mlm"]["stages"][-1]
    assert not (tmp_path / "out").exists()
