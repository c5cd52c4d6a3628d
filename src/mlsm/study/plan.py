"""What a study would run, resolved but not run: `mlsm study STUDY.yaml --print`.

Every arm's run config as `Study.arm_config` resolves it (recipe, base, overrides, objective, then
the study's store, run folder, readiness and dictionary: what pre-training would train), each
dictionary with its settings and the arms that share it, and each arm's stages at their
readiness points, in the order `run_study` runs them (`runner.STAGES`). Nothing is read from or
written to the study folder, so the plan says what the stages *are*, not which of them a re-run
would find complete and skip. A reader can check a study against a paper field by field from it
without the Python API.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mlsm.config import config_to_dict
from mlsm.evaluate.finetune.finetune_config import config_of
from mlsm.study.folder import Study, only_arms
from mlsm.study.runner import STAGES
from mlsm.study.spec import StudySpec, arm_dictionary, readiness_label


def study_plan(spec: StudySpec, stages: list[str] | None = None,
               arms: list[str] | None = None) -> dict[str, Any]:
    """The plan of `spec` as plain data (YAML-ready): `stages` / `arms` restrict it as they
    restrict `run_study`. Writes nothing, not even the study folder."""
    spec = only_arms(spec, arms)
    study = Study(spec, log=lambda line: None, create=False)
    wanted = [s for s in STAGES if (not stages or s in stages) and _has_work(spec, s)]
    plan: dict[str, Any] = {"study": spec.name, "out": str(spec.root), "stages": wanted,
                            "executor": dataclasses.asdict(spec.executor)}
    if "store" in wanted:
        plan["store"] = {**dataclasses.asdict(spec.corpus), "path": str(study.store)}
    if "dictionary" in wanted:
        plan["dictionaries"] = _dictionaries(study)
    # the fine-tuning settings finetune() runs with: a preset's values filled in
    finetune = {**dataclasses.asdict(spec.finetune),
                **dataclasses.asdict(config_of(spec.finetune, {}))}
    evaluations = {"probe": dataclasses.asdict(spec.probe), "finetune": finetune,
                   "blimp": dataclasses.asdict(spec.blimp),
                   "readout": spec.readout and dataclasses.asdict(spec.readout)}
    plan["evaluation"] = {k: v for k, v in evaluations.items() if k in wanted and v}
    plan["arms"] = {arm: {"stages": _arm_stages(study, arm, wanted),
                          "config": config_to_dict(study.arm_config(arm))} for arm in spec.arms}
    return plan


def _has_work(spec: StudySpec, stage: str) -> bool:
    """Whether the study gives `stage` anything to do (no pair sets: no probe and no BLiMP; no
    tasks: no fine-tuning; no `readout` group: no readouts)."""
    return {"probe": bool(spec.blimp.data), "blimp": bool(spec.blimp.data),
            "finetune": bool(spec.finetune.tasks), "readout": spec.readout is not None
            }.get(stage, True)


def _dictionaries(study: Study) -> dict[str, Any]:
    """Each dictionary once (path -> its settings, the arms sharing it, its target store)."""
    out: dict[str, Any] = {}
    for arm in study.spec.arms:
        path = study.dictionary_path(arm)
        if path is None:
            continue
        objective = study.arm_config(arm).objective
        entry = out.setdefault(str(path), {
            "teacher": objective.teacher, "layer": objective.layer,
            "settings": dataclasses.asdict(arm_dictionary(study.spec, arm)), "arms": []})
        entry["arms"].append(arm)
        targets = study.targets_path(arm)
        if targets is not None:
            entry["targets"] = str(targets)
    return out


def _arm_stages(study: Study, arm: str, wanted: list[str]) -> list[str]:
    """The arm's stages as `run_study` would run them, one entry per readiness checkpoint
    (`stage@P%`); a checkpoint its objective cannot score says why."""
    spec, out = study.spec, []
    at = readiness_label
    if "pretrain" in wanted:
        cfg = study.arm_config(arm)
        out.append(f"pretrain: {cfg.train.steps} steps, checkpoints at "
                   + ", ".join(at(f) for f in spec.readiness))
    blimp_fracs = spec.blimp.readiness if spec.blimp.data else []
    heads = (["latent"] if study.is_latent(arm) else []) + list(spec.probe.controls)
    for stage in ("probe", "finetune", "blimp", "readout"):
        if stage not in wanted:
            continue
        if stage == "finetune":
            ft = config_of(spec.finetune, {})
            cells = (f"{len(spec.finetune.tasks)} tasks x {len(ft.seed_list())} seeds x "
                     f"{len(ft.lrs)} lrs")
            out += [f"finetune@{at(f)}: {cells}" for f in spec.finetune.readiness]
            continue
        fracs = spec.readiness if stage == "readout" else blimp_fracs
        names = [("probe" if h == "latent" else f"probe-{h}") for h in heads] \
            if stage == "probe" else [stage]
        for f in fracs:
            why = None if stage == "readout" else study.unscored_reason(arm, f)
            out += [f"{name}@{at(f)}" + (f": skipped ({why})" if why else "") for name in names]
    return out
