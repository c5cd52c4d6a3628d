"""The preparation stages of a study: the token store, the dictionaries (and their target
stores) and the pre-training of each arm. Each is reused only when its stage record's fingerprint
equals the current one (`mlsm.study.reuse`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlsm.artifacts.fingerprint import differences
from mlsm.artifacts.legacy import tolerated
from mlsm.defaults import default_k
from mlsm.errors import UserError
from mlsm.run_config import config_from_dict
from mlsm.study import reuse
from mlsm.study.folder import Study, pretrain_done
from mlsm.study.sameness import check_same_config, fingerprint_of
from mlsm.study.spec import arm_base, arm_dictionary, check_arm_dictionary


def started(study: Study, arm: str) -> bool:
    """Whether the arm's run folder holds training already (metrics or a checkpoint)."""
    run = study.run_dir(arm)
    return (run / "metrics.jsonl").exists() or (run / "checkpoints").is_dir()


def pretrain_todo(study: Study, arm: str, cfg: Any = None) -> bool:
    """Whether the arm still needs pre-training; refuses in one line a run of other inputs.

    The run folder's config.yaml must equal the arm's config (`check_same_config`: it names the
    key, and a config key added to mlsm since the run takes its default, so an upgrade of mlsm
    does not orphan a run), and the store and dictionary fingerprints the stage recorded must
    equal the current ones. A run recorded before mlsm kept fingerprints (no fingerprint in
    status.json) is adopted when its config.yaml matches: its fingerprint is recorded from then
    on. A run that is not finished gets a `started` record, so a resume after its store or
    dictionary was rebuilt in place is refused too."""
    check_same_config(study.run_dir(arm), arm, cfg or study.arm_config(arm))
    inputs, key = reuse.pretrain_inputs(study, arm), f"pretrain:{arm}"
    study.note_inputs(inputs)
    record = study.status().get(key, {})
    data = ("store", "dictionary")  # the config itself is compared key by key above
    changed = differences({k: (record.get("inputs") or {}).get(k) for k in data},
                          {k: inputs[k] for k in data}) if "inputs" in record else []
    if changed and started(study, arm):
        raise UserError(f"arm {arm}: the run in {study.run_dir(arm)} was trained from other "
                        f"inputs ({'; '.join(changed)}); restore them, or rename the arm / delete "
                        "that run to train anew (pre-training is never redone by itself)")
    fingerprint = fingerprint_of(inputs)
    if pretrain_done(study, arm):
        if record.get("fingerprint") != fingerprint:  # adopted: recorded from now on
            study.set_status(key, {**record, "state": "done", "fingerprint": fingerprint,
                                   "inputs": inputs})
        return False
    study.set_status(key, {"state": "started", "fingerprint": fingerprint, "inputs": inputs})
    return True


def pretrain_arm(study: Study, arm: str, threads: int | None = None) -> str | None:
    """Pre-train one arm unless its final checkpoint exists; resume an interrupted run.
    threads: torch threads for this process (default: the arm config's, executor.threads)."""
    from mlsm.train.loop import pretrain

    cfg = study.arm_config(arm)
    if threads:  # train.threads is volatile: a resume with another count is the same run
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, threads=threads))
    if not pretrain_todo(study, arm, cfg):
        return "skipped"
    pretrain(cfg, resume="auto" if (study.run_dir(arm) / "metrics.jsonl").exists() else None)
    if not pretrain_done(study, arm):  # `pretrain` returns early only when SIGTERM asked it to stop
        raise KeyboardInterrupt(f"pre-training of {arm} stopped by a signal; run the same "
                                "command to resume")
    return None


def prepare_store(study: Study) -> str | None:
    from mlsm.data.corpus import prepare_corpus
    from mlsm.teacher.teacher import default_teacher_path

    c = study.spec.corpus
    if not c.sources:
        raise UserError("corpus.sources is empty; list the corpus files of the study")
    done = (study.store / "meta.json").is_file()
    # the store checks its own inputs' fingerprint: the same sources are a no-op, others refused
    prepare_corpus(list(c.sources), c.tokenizer or str(default_teacher_path()), study.store,
                   text_field=c.text_field)
    study.note_inputs(reuse.store_inputs(study))
    return "skipped" if done else None


def learn_dictionary_for(study: Study, arm: str) -> str | None:
    from mlsm.data.corpus import TokenStore
    from mlsm.teacher.dictionary import learn_dictionary
    from mlsm.teacher.teacher import load_teacher

    path = study.dictionary_path(arm)
    assert path is not None
    if _shared_done(study, f"dictionary:{arm}", reuse.dictionary_inputs(study, arm),
                    [path, path.with_suffix(".json")], lambda: _legacy_dictionary(study, arm)):
        return "skipped"
    d, ds = study.spec.arms[arm].dictionary, study.spec.dictionary
    assert d is not None  # a dictionary path is only given for an arm with one
    c = arm_dictionary(study.spec, arm)
    teacher = load_teacher(ds.teacher or None, d.layer,
                           init=c.teacher_init, seed=c.teacher_seed)
    check_arm_dictionary(arm, d, ds.n_vectors, ds.k or default_k(teacher.hidden_size))
    path.parent.mkdir(parents=True, exist_ok=True)
    learn_dictionary(TokenStore.open(study.store), teacher, c, out=path)
    return None


def build_targets_for(study: Study, arm: str) -> str | None:
    """Build (or resume) the target store of the arm's dictionary over the study's token store:
    the codes of every position, whatever data order a seed draws (`mlsm targets`)."""
    from mlsm.locking import hold
    from mlsm.teacher.targets import build_target_store, check_targets_out
    from mlsm.teacher.teacher import load_teacher

    out, dictionary = study.targets_path(arm), study.dictionary_path(arm)
    assert out is not None and dictionary is not None
    inputs = reuse.targets_inputs(study, arm)
    if _shared_done(study, f"targets:{arm}", inputs, [out / "meta.json"],
                    lambda: _legacy_targets(out, inputs), moved=[out]):
        return "skipped"
    out.parent.mkdir(parents=True, exist_ok=True)
    check_targets_out(out)
    arm_dict = study.spec.arms[arm].dictionary
    assert arm_dict is not None
    layer = arm_dict.layer
    c = arm_dictionary(study.spec, arm)
    with hold(out, "target store"):
        teacher = load_teacher(study.spec.dictionary.teacher or None, layer,
                               init=c.teacher_init, seed=c.teacher_seed)
        max_len = config_from_dict(arm_base(study.spec, arm)).data.max_len
        build_target_store(study.store, dictionary, teacher, max_len, out)
    return None




def _shared_done(study: Study, key: str, inputs: dict[str, Any], outputs: list[Path],
                 legacy: Callable[[], bool], moved: list[Path] | None = None) -> bool:
    """Whether a dictionary or target store (shared by arms) is done for these inputs. One
    recorded before mlsm kept fingerprints is adopted when its own meta agrees (`legacy`), and
    resumed when it agrees but is unfinished (a target build's build.json). One made from other
    inputs is moved aside and made again, unless a run already trained with it:
    then the study refuses in one line (the runs would no longer match their dictionary)."""
    record = study.status().get(key, {})
    if "fingerprint" not in record and tolerated("study-shared-unrecorded") and legacy():
        if all(p.exists() for p in outputs):
            study.note_inputs(inputs)  # adopted: its fingerprint is recorded from now on
            return True
        # begun before fingerprints from these same inputs (its own build record says so), and
        # not finished: resumed where it stopped, not moved aside (a target store takes hours)
        return study.reusable(key, inputs, outputs, moved=[])
    if all(p.exists() for p in outputs) and record.get("fingerprint") != fingerprint_of(inputs):
        users = [a for a in study.spec.arms
                 if outputs[0] in (study.dictionary_path(a), _targets_meta(study, a))
                 and started(study, a)]
        if users:
            changed = "; ".join(differences(record.get("inputs") or {}, inputs))
            raise UserError(f"{outputs[0]} was made from other inputs or settings ({changed}) "
                            f"and the runs of {', '.join(users)} trained with it; restore those "
                            "settings, or delete it and those runs to make both anew")
    return study.reusable(key, inputs, outputs, moved)


def _targets_meta(study: Study, arm: str) -> Path | None:
    out = study.targets_path(arm)
    return None if out is None else out / "meta.json"


def _legacy_dictionary(study: Study, arm: str) -> bool:
    """A dictionary learned before stage fingerprints: its meta must state the settings."""
    from mlsm.teacher.dictionary import load_dictionary

    path = study.dictionary_path(arm)
    assert path is not None
    try:
        meta = load_dictionary(path).meta
    except UserError:
        return False
    want = reuse.dictionary_settings(study, arm)
    return all(meta.get(k) == want[k] for k in ("layer", "lam", "max_len", "seed")) and \
        want["k"] in (None, meta.get("k"))


def _legacy_targets(out: Path, inputs: dict[str, Any]) -> bool:
    """A target store built (or begun) before stage fingerprints: its own record must name the
    current store and dictionary."""
    from mlsm.teacher.targets import recorded_inputs

    record = recorded_inputs(out) or {}
    return record.get("dictionary_hash") == inputs["dictionary"] and \
        record.get("store_fingerprint") == inputs["store"]
