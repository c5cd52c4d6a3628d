"""Evaluation stages of a study: probes, fine-tuning of readiness checkpoints, BLiMP.

Each function takes the arms whose pre-training is complete, runs its stage per arm (a failure is
recorded for that arm only) and returns the arms that failed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlsm.artifacts.probe_record import (
    has_probe_record,
    read_probe_record,
    record_path,
    write_probe_record,
)
from mlsm.errors import UserError
from mlsm.evaluate.zeroshot.heldout import binomial_p, heldout_masked_tokens
from mlsm.fileio import atomic_write_text
from mlsm.study import reuse
from mlsm.study.folder import Study, only_arms, pretrain_done
from mlsm.study.sameness import fingerprint_of
from mlsm.study.spec import StudySpec, readiness_label

PROBE_KEYS = ("input", "heldout_loss", "heldout_top1", "unigram_loss", "steps")
"""What a BLiMP row keeps of its probe's record: the score travels with the probe's quality."""


def driver_threads(study: Study) -> int | None:
    """torch threads of a stage run here in the driver: the study's whole budget (jobs x
    threads), since locally a stage runs here only when no other arm's runs at once (one arm with
    work, or jobs = 1; a subprocess of a jobs > 1 study reads its study with jobs = 1); None =
    torch's default."""
    e = study.spec.executor
    return e.threads * max(1, e.jobs) if e.threads and e.kind == "local" else e.threads or None


def model_name(arm: str, frac: float) -> str:
    return f"{arm}@{readiness_label(frac)}"


def has_work(study: Study, stage: str, arm: str) -> bool:
    """Whether `stage` may still have work for `arm` (else a slurm driver submits no job for it).
    Fine-tuning decides per cell inside the job (a cell's key needs the task data), so it always
    may."""
    if stage == "finetune":
        return bool(study.spec.finetune.tasks)
    b = study.spec.blimp
    # readiness points PLL cannot score are recorded as skipped by run_probe / run_blimp, no job
    scored = [f for f in study.evaluated(b.readiness) if not study.unscored_reason(arm, f)]
    if stage == "readout":
        return study.spec.readout is not None and not all(
            study.is_done(f"readout:{model_name(arm, f)}", reuse.readout_inputs(study, arm, f),
                          [readout_path(study, arm, f)])
            for f in study.evaluated(study.spec.readiness))
    if stage == "probe":
        heads = probe_heads(study, arm)
        return bool(b.data) and not all(
            study.is_done(f"{probe_stage(h)}:{model_name(arm, f)}",
                          reuse.probe_inputs(study, arm, f, h), [record_path(_probe_dir(
                              study, arm, f, h))]) for f in scored for h in heads)
    return stage != "blimp" or (bool(b.data) and not all(
        study.is_done(f"blimp:{model_name(arm, f)}", reuse.blimp_inputs(study, arm, f),
                      [blimp_path(study, arm, f)]) for f in scored))


_LONGEST_FIRST = ("factored", "latent", "vocab")
"""The probe heads by the width they map into |V| from: factored d -> k -> |V| holds a latent
probe's k -> |V| and more, and a latent arm's k exceeds the student's d in every study here
(v3: k = 1536, d = 256). The fit grows with it (v3 seed 0, CPU s: factored 707-1,532, latent
350-1,034, vocab 107-340), so the runner asks for the widest first: on fewer slots than heads,
the longest fit then never waits behind a short one."""


def probe_heads(study: Study, arm: str) -> list[str]:
    """The probes the probe stage fits on `arm`'s checkpoints, widest first (`_LONGEST_FIRST`):
    its own (head latent) if it predicts latent properties, and each readout control; only
    `study.heads` of those in a view restricted to heads (`Study.at`)."""
    heads = (["latent"] if study.is_latent(arm) else []) + list(study.spec.probe.controls)
    return sorted((h for h in heads if study.heads is None or h in study.heads),
                  key=_LONGEST_FIRST.index)


def run_probe(study: Study, arms: list[str]) -> set[str]:
    """Train the k -> |V| probe of every latent arm, and the readout controls (`probe.controls`)
    of every arm, at each BLiMP readiness point (an arm not scored by PLL is skipped with its
    reason); in a view restricted to heads (`Study.at`), those probes only."""
    fracs = study.spec.blimp.readiness if study.spec.blimp.data else []
    latent = [a for a in arms if "latent" in probe_heads(study, a)]
    failed = _each_checkpoint(study, "probe", latent, fracs, _probe, study.unscored_reason)
    for head in study.spec.probe.controls:
        if study.heads is not None and head not in study.heads:
            continue
        failed |= _each_checkpoint(study, probe_stage(head), arms, fracs,
                                   lambda s, a, f, h=head: _probe(s, a, f, h),
                                   study.unscored_reason)
    return failed


def probe_stage(head: str) -> str:
    """The stage record's name of a probe: `probe` for a latent arm's own, probe-HEAD for a
    readout control."""
    return "probe" if head == "latent" else f"probe-{head}"


def _probe_dir(study: Study, arm: str, frac: float, head: str) -> Path:
    return study.probe_dir(arm, frac) if head == "latent" else reuse.control_dir(study, arm, frac,
                                                                                   head)


def _each_checkpoint(study: Study, stage: str, arms: list[str], fracs: list[float],
                     score: Callable[[Study, str, float], str | None],
                     unscored: Callable[[str, float], str | None] = lambda a, f: None
                     ) -> set[str]:
    """Run `stage` (`score`) on each readiness checkpoint `fracs` of each arm, one stage record
    per checkpoint (ARM@P%); a checkpoint with an `unscored` reason is recorded as skipped.
    Returns the arms with a failed checkpoint. Only the points `study` evaluates (`Study.at`)."""
    failed = set()
    for arm in arms:
        for frac in study.evaluated(fracs):
            reason = unscored(arm, frac)
            if reason:
                study.skip(stage, model_name(arm, frac), reason)
            elif not study.stage(stage, lambda a=arm, f=frac: score(study, a, f),
                                 model_name(arm, frac)):
                failed.add(arm)
    return failed


def _probe(study: Study, arm: str, frac: float, head: str = "latent") -> str | None:
    """A latent arm's own probe (head latent) or a readout control (vocab, factored) of any arm,
    fitted with the study's probe settings; the controls always by the plateau recipe."""
    from mlsm.evaluate.probe.probe_fit import train_probe_to_plateau

    out = _probe_dir(study, arm, frac, head)
    if study.reusable(f"{probe_stage(head)}:{model_name(arm, frac)}",
                      reuse.probe_inputs(study, arm, frac, head), [record_path(out)],
                      moved=[out]):
        return "skipped"
    p = study.spec.probe
    if p.recipe == "paper" and head == "latent":
        _paper_probe(study, arm, frac, out)
        return None
    train_probe_to_plateau(study.checkpoint(arm, frac), out, p, threads=driver_threads(study),
                           head=head)
    return None


def _paper_probe(study: Study, arm: str, frac: float, out: Path) -> None:
    """The Hitchhikers' Guide's probe (§4.3): `probe.steps` steps through the training loop, with
    readiness checkpoints and no plateau stop (resumed when interrupted); then OUT/probe.json with
    its held-out masked-token score next to the unigram's, as the plateau probe writes."""
    import torch

    from mlsm.artifacts.checkpoint import list_checkpoints
    from mlsm.evaluate.probe.probe import load_scorer, run_probe

    p = study.spec.probe
    if driver_threads(study):
        torch.set_num_threads(driver_threads(study))
    checkpoint = study.checkpoint(arm, frac)
    done = {s: folder for s, folder in list_checkpoints(out)}
    steps = p.loop_steps()
    if steps not in done:
        run_probe(checkpoint, recipe="paper", steps=steps, out=str(out),
                  resume="auto" if (out / "metrics.jsonl").is_file() else None)
        done = {s: folder for s, folder in list_checkpoints(out)}
    final = done.get(steps)
    if final is None:  # run_probe returns early only when a signal asked it to stop
        raise KeyboardInterrupt(f"the probe of {model_name(arm, frac)} stopped by a signal; run "
                                "the same command to resume")
    scorer, _ = load_scorer(final)
    held = heldout_masked_tokens(scorer, checkpoint, p.heldout_batches, p.batch_size or 16)
    info = {"recipe": "paper", "checkpoint": str(final), "source": str(checkpoint),
            "input": scorer.input, "steps": steps, "heldout_loss": held["loss"],
            "heldout_top1": held["top1"], "unigram_loss": held["unigram_loss"],
            "unigram_top1": held["unigram_top1"],
            "better_than_unigram": held["loss"] < held["unigram_loss"] * (1 - p.min_delta),
            "n_heldout_targets": held["n"]}
    write_probe_record(out, info)


def run_finetune(study: Study, arms: list[str]) -> set[str]:
    """Fine-tune every readiness checkpoint of every arm on the study's task grid (paired seeds)."""
    ft = study.spec.finetune
    if not ft.tasks:
        return set()
    failed = set()
    for arm in arms:
        if not study.stage("finetune", lambda a=arm: _finetune(study, a), arm):
            failed.add(arm)
    return failed


def _finetune(study: Study, arm: str) -> str | None:
    import torch

    from mlsm.evaluate.finetune.finetune import finetune

    ft = study.spec.finetune
    if study.reusable(f"finetune:{arm}", reuse.finetune_inputs(study, arm), [],
                      supersede=lambda: study.supersede_rows(arm)):
        return "skipped"
    if driver_threads(study):
        torch.set_num_threads(driver_threads(study))
    models = [f"{model_name(arm, f)}={study.checkpoint(arm, f)}" for f in ft.readiness]
    before = _rows_of(study, arm)
    # ft is a FinetuneConfig (with the study's own keys): every setting reaches finetune()
    finetune(models, ft.tasks, ft, results=study.results,
             device="cpu" if study.spec.executor.kind == "local" else "auto",
             report_to=study.arm_config(arm).train.report_to)  # base.train.report_to of the study
    return "skipped" if _rows_of(study, arm) == before else None  # every cell was there


def _rows_of(study: Study, arm: str) -> int:
    """Fine-tuning rows of this arm's models (other arms' jobs may append meanwhile)."""
    return sum(str(r.get("model", "")).startswith(f"{arm}@") for r in study.result_rows())


def blimp_path(study: Study, arm: str, frac: float) -> Path:
    return study.root / "blimp" / f"{model_name(arm, frac).replace('%', 'pct')}.json"


def run_blimp(study: Study, arms: list[str]) -> set[str]:
    """Score BLiMP by PLL: MLM-type arms directly, latent arms through their probe; an arm not
    scored by PLL (MAE-LM, MAE-MLSM) is skipped with its reason."""
    if not study.spec.blimp.data:
        return set()
    return _each_checkpoint(study, "blimp", arms, study.spec.blimp.readiness, _blimp,
                            study.unscored_reason)


def _blimp(study: Study, arm: str, frac: float) -> str | None:
    import torch

    from mlsm.evaluate.probe.probe import load_scorer
    from mlsm.evaluate.zeroshot.blimp import evaluate_blimp
    from mlsm.evaluate.zeroshot.unigram import UnigramControl

    path = blimp_path(study, arm, frac)
    inputs = reuse.blimp_inputs(study, arm, frac)
    if study.reusable(f"blimp:{model_name(arm, frac)}", inputs, [path]):
        return "skipped"
    b = study.spec.blimp
    probe: dict[str, Any] = {}
    folder = study.checkpoint(arm, frac)
    if study.is_latent(arm):
        # the probe stage skips a checkpoint whose probe.json exists: delete it to train again
        info = read_probe_record(study.probe_dir(arm, frac), "delete it and run the study "
                                 "with --stages probe blimp to train that probe again")
        if not info["better_than_unigram"]:
            raise UserError(f"the probe of {model_name(arm, frac)} (held-out loss "
                            f"{info['heldout_loss']:.3f}) is no better than the unigram "
                            f"distribution ({info['unigram_loss']:.3f}); its BLiMP would be noise")
        probe, folder = info, Path(info["checkpoint"])
    if driver_threads(study):
        torch.set_num_threads(driver_threads(study))
    model, tokenizer = load_scorer(folder)
    p = study.spec.probe
    heldout = heldout_masked_tokens(model, study.checkpoint(arm, frac), p.heldout_batches,
                                    p.batch_size or 16, store=b.heldout_store or None)
    controls = _control_scores(study, arm, frac)
    sets = {}
    # scores the same pairs (issue #32), counted on the tokens the run consumed
    control = UnigramControl.consumed_by(study.checkpoint(arm, frac))
    for i, data in enumerate(b.data):
        # b's settings, with each set's own limit; `phenomena` names UIDs of the first set only
        result = evaluate_blimp(model, tokenizer, data, b, progress=None, control=control,
                                limit_per_phenomenon=(b.limits[i] if b.limits else 0)
                                or b.limit_per_phenomenon,
                                phenomena=b.phenomena if i == 0 else [])
        sets[Path(data).name or data] = _set_scores(result)
    first = next(iter(sets.values()))
    row = {"arm": arm, "readiness": frac, "overall": first["overall"], "n_pairs": first["n_pairs"],
           "sets": sets, "heldout": heldout, "threads": torch.get_num_threads(),
           **({"controls": controls} if controls else {}),
           "probe": {k: probe.get(k) for k in PROBE_KEYS} if probe else None,
           "fingerprint": fingerprint_of(inputs), "data": inputs["data"]}  # the report: current
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(row, indent=2) + "\n")
    return None


def _control_scores(study: Study, arm: str, frac: float) -> dict[str, Any]:
    """head -> held-out masked-token scores of ARM@frac through each readout control (the same
    targets as its own head's), with what the row keeps of the control's probe record."""
    from mlsm.evaluate.probe.probe import load_scorer

    b, p, scores = study.spec.blimp, study.spec.probe, {}
    for head in p.controls:
        info = read_probe_record(reuse.control_dir(study, arm, frac, head), "delete it and run "
                                 "the study with --stages probe blimp to fit that control again")
        scorer, _ = load_scorer(info["checkpoint"])
        held = heldout_masked_tokens(scorer, study.checkpoint(arm, frac), p.heldout_batches,
                                     p.batch_size or 16, store=b.heldout_store or None)
        scores[head] = {**held, "probe": {k: info.get(k) for k in PROBE_KEYS}}
    return scores


def _set_scores(result: dict[str, Any]) -> dict[str, Any]:
    """One pair set's entry of a BLiMP row, from `evaluate_blimp`'s result: the accuracies (all,
    per field, per phenomenon), the unigram control's on the same pairs, and the tests."""
    phenomena = result["phenomena"]
    correct = sum(int(v["correct"]) for v in phenomena.values())
    return {"overall": result["overall"], "n_pairs": result["n_pairs"], "correct": correct,
            "p_vs_chance": binomial_p(correct, result["n_pairs"], 0.5),
            "fields": {k: v["accuracy"] for k, v in result["fields"].items()},
            "phenomena": {k: v["accuracy"] for k, v in phenomena.items()},
            "control": result["control"]["overall"],
            "control_phenomena": {k: v["control_accuracy"] for k, v in phenomena.items()},
            "tests": result["tests"]}


def readout_path(study: Study, arm: str, frac: float) -> Path:
    return study.root / "readouts" / f"{model_name(arm, frac).replace('%', 'pct')}.jsonl"


def run_readout(study: Study, arms: list[str]) -> set[str]:
    """Readouts (`mlsm.evaluate.readouts`) of every readiness checkpoint of every arm, one
    JSON-lines file per checkpoint; an arm not scored by PLL gets its linear probes only."""
    if study.spec.readout is None:
        return set()
    return _each_checkpoint(study, "readout", arms, study.spec.readiness, _readout)


def _readout(study: Study, arm: str, frac: float) -> str | None:
    import dataclasses

    import torch

    from mlsm.evaluate.readouts import readout

    path = readout_path(study, arm, frac)
    inputs = reuse.readout_inputs(study, arm, frac)
    if study.reusable(f"readout:{model_name(arm, frac)}", inputs, [path]):
        return "skipped"
    spec = study.spec.readout
    assert spec is not None
    spec = dataclasses.replace(spec, heldout_store=spec.heldout_store
                               or study.spec.blimp.heldout_store)
    if study.unscored_reason(arm, frac):  # no words to read: MAE-LM, CLM
        spec = dataclasses.replace(spec, kinds=[k for k in spec.kinds if k == "probe"])
    scorer = None
    if study.is_latent(arm) and has_probe_record(study.probe_dir(arm, frac)):
        scorer = read_probe_record(study.probe_dir(arm, frac),
                                   "delete it and run the probe stage again")["checkpoint"]
    if driver_threads(study):
        torch.set_num_threads(driver_threads(study))
    rows = readout(study.checkpoint(arm, frac), spec, name=model_name(arm, frac),
                   scorer_path=scorer, log=study.log)
    path.parent.mkdir(parents=True, exist_ok=True)
    stamp = {"arm": arm, "fingerprint": fingerprint_of(inputs), "data": inputs["data"]}
    atomic_write_text(path, "".join(json.dumps({**r, **stamp}) + "\n" for r in rows))
    return None


EVALUATIONS = {"probe": run_probe, "finetune": run_finetune, "blimp": run_blimp,
               "readout": run_readout}
"""Each evaluation stage's function: (study, arms whose pre-training is complete) -> failed arms."""


def run_arm_stage(spec: StudySpec, stage: str, arm: str, point: float | None = None,
                  head: str | None = None) -> set[str]:
    """One evaluation stage of one arm (all of its seeds' runs in a seeded study) in this process,
    at one readiness point or (None) at all, and for the probe stage one head or (None) all:
    what a slurm job or a local subprocess of the study runs. Outcomes go to the study's records
    as the driver's do; returns the runs that failed."""
    study = Study(only_arms(spec, [arm]), log=print, in_job=True).at(point, head)
    return EVALUATIONS[stage](study, [a for a in study.spec.arms if pretrain_done(study, a)])
