"""What decides each stage's result, as fingerprints (`mlsm.artifacts.fingerprint`): a stage is
reused only when the fingerprint its record holds equals the one computed here now.

Each stage's inputs are a flat dict of fingerprints: `settings` (the study file's settings of the
stage, `settings_fingerprint`), `checkpoint` (`folder_fingerprint` of the model folder it read),
`store` (the token store's own fingerprint, from its meta.json), `dictionary` (the dictionary's
atom hash, `mlsm.teacher.targets.dictionary_hash`) and, for BLiMP and readouts of a latent arm,
`probe` (the content digest of the probe's record), and `data`: the content of the data paths
the stage reads (`path_fingerprint`: BLiMP pairs, task folders, GLUE, held-out stores), kept
beside the fingerprint rather than in it (`sameness.same_data`). A difference names the input that
changed.
Rows a stage writes (BLiMP files, readout rows) carry their fingerprint, so the report keeps only
rows whose fingerprint equals the current one (`is_current`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from mlsm.artifacts.fingerprint import (
    content_digest,
    folder_fingerprint,
    path_fingerprint,
    settings_fingerprint,
    stat_key,
)
from mlsm.artifacts.probe_record import record_path
from mlsm.config import config_to_dict
from mlsm.defaults import UNIGRAM_ESTIMATE
from mlsm.errors import UserError
from mlsm.inputs import field_problem, is_number, read_json
from mlsm.study.folder import Study
from mlsm.study.sameness import DATA, fingerprint_of, record_matches, same_data, without_volatile
from mlsm.study.spec import ArmDictionary, arm_dictionary, readiness_label

_MEMO: dict[tuple, str | None] = {}
"""Fingerprints of files and folders by (path, size and mtime of each file): a checkpoint is
hashed once per process, and again only when a file in it changed."""


def _stat_key(path: Path) -> tuple:
    """The folder's (or file's) files by name and `stat_key` (inode, size, mtime, ctime): a
    rewrite in place that keeps size and mtime is still another key."""
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    return (str(path.resolve()), *((f.name, stat_key(f.stat())) for f in files if f.is_file()))


def checkpoint_fingerprint(folder: Path) -> str | None:
    """`folder_fingerprint` of a model folder (None while it does not exist)."""
    if not folder.exists():
        return None
    key = ("folder", *_stat_key(folder))
    if key not in _MEMO:
        _MEMO[key] = folder_fingerprint(folder)
    return _MEMO[key]


def store_fingerprint(study: Study) -> str | None:
    """The token store's own fingerprint (its meta.json; None before the store exists)."""
    from mlsm.data.corpus import recorded_fingerprint  # the tokenizers stack: on first use

    return recorded_fingerprint(study.store)


def dictionary_fingerprint(study: Study, arm: str) -> str | None:
    """The hash of the arm's dictionary atoms (None: no dictionary, or not learned yet)."""
    path = study.dictionary_path(arm)
    if path is None or not path.is_file() or not path.with_suffix(".json").is_file():
        return None
    key = ("dictionary", *_stat_key(path), *_stat_key(path.with_suffix(".json")))
    if key not in _MEMO:
        from mlsm.teacher.dictionary import load_dictionary
        from mlsm.teacher.targets import dictionary_hash

        _MEMO[key] = dictionary_hash(load_dictionary(path))
    return _MEMO[key]


def _probe_record(study: Study, arm: str, frac: float) -> str | None:
    info = record_path(study.probe_dir(arm, frac))
    return content_digest(info) if study.is_latent(arm) and info.is_file() else None


def control_dir(study: Study, arm: str, frac: float, head: str) -> Path:
    """Where the readout control `head` of ARM@frac is fitted: beside the arm's own probe."""
    return Path(f"{study.probe_dir(arm, frac)}-{head}")


def _control_records(study: Study, arm: str, frac: float) -> dict[str, str | None]:
    """head -> digest of each readout control's record (None: not fitted yet)."""
    paths = {h: record_path(control_dir(study, arm, frac, h)) for h in study.spec.probe.controls}
    return {h: content_digest(p) if p.is_file() else None for h, p in paths.items()}


def data_inputs(paths: dict[str, str | list[str]]) -> dict[str, str]:
    """setting -> `path_fingerprint` of each data path a stage reads (pair sets, GLUE folders,
    held-out stores), keyed by the setting and the file name (`blimp.data.0:blimp`), never the
    machine's path (records and rows travel in a published copy): the same path with other
    content is another input. Empty settings are left out."""
    found = {}
    for key, value in paths.items():
        if isinstance(value, list):
            found.update({f"{key}.{i}:{Path(v).name}": path_fingerprint(v)
                          for i, v in enumerate(value) if v})
        elif value:
            found[key] = path_fingerprint(value)
    return found


def _task_data(ft: Any) -> dict[str, str | None]:
    """task -> the content of its folder under `data_dir` (None: not found there now; the
    fine-tuning stage then names it, and its rows are not judged by it meanwhile)."""
    from mlsm.errors import UserError
    from mlsm.evaluate.finetune.cell_reuse import data_fingerprint
    from mlsm.evaluate.finetune.tasks import get_task

    found: dict[str, str | None] = {}
    for task in ft.tasks:
        try:
            found[task] = data_fingerprint(get_task(task), ft.data_dir)
        except (UserError, OSError):
            found[task] = None
    return found


def store_inputs(study: Study) -> dict[str, Any]:
    return {"settings": settings_fingerprint(dataclasses.asdict(study.spec.corpus)),
            "store": store_fingerprint(study)}


def dictionary_settings(study: Study, arm: str) -> dict[str, Any]:
    """What the dictionary stage's result depends on besides the store (its file's name holds
    teacher, layer, k, lam and the controls, atoms and teacher_init; n_vectors, max_len, seed and
    teacher_seed are only here)."""
    d = study.spec.arms[arm].dictionary or ArmDictionary()  # (an arm without one: the defaults)
    c = arm_dictionary(study.spec, arm)
    # the settings a study could set before all of DictionaryConfig was its group, always; the
    # others only when not at their default, so the fingerprints of older studies stay the same
    later = {key: value for key, value in c.given().items()
             if key not in ("k", "lam", "n_vectors", "max_len", "seed")
             and not (key == "teacher_seed" and c.teacher_init == "pretrained")}  # unread then
    return {"teacher": study.spec.dictionary.teacher, "layer": d.layer,
            "k": c.k, "lam": float(c.lam), "n_vectors": c.n_vectors, "max_len": c.max_len,
            "seed": c.seed, **later}


def dictionary_inputs(study: Study, arm: str) -> dict[str, Any]:
    return {"settings": settings_fingerprint(dictionary_settings(study, arm)),
            "store": store_fingerprint(study)}


def targets_inputs(study: Study, arm: str) -> dict[str, Any]:
    cfg, c = study.arm_config(arm), arm_dictionary(study.spec, arm)
    # the random teacher's codes are another store (the pre-trained one's settings as before)
    init = {} if c.teacher_init == "pretrained" else {"teacher_init": c.teacher_init,
                                                      "teacher_seed": c.teacher_seed}
    return {"settings": settings_fingerprint({"teacher": study.spec.dictionary.teacher,
                                              "layer": cfg.objective.layer,
                                              "max_len": cfg.data.max_len, **init}),
            "store": store_fingerprint(study), "dictionary": dictionary_fingerprint(study, arm)}


def pretrain_inputs(study: Study, arm: str) -> dict[str, Any]:
    """The arm's resolved run config (less what may change on a resume), store and dictionary."""
    config = without_volatile(config_to_dict(study.arm_config(arm)))
    return {"settings": settings_fingerprint(config), "store": store_fingerprint(study),
            "dictionary": dictionary_fingerprint(study, arm)}


def probe_settings(probe: Any, head: str) -> dict[str, Any]:
    """The study's probe settings that decide the probe of `head`: a latent probe's as they were
    before the readout controls existed (so its fingerprint, and its reuse, are unchanged); a
    control's with its head (and, for factored, its width)."""
    skip = {"controls", "head", "rank"} if head == "latent" else {"controls"}
    settings = {k: v for k, v in dataclasses.asdict(probe).items() if k not in skip}
    return settings if head == "latent" else {**settings, "head": head}


def probe_inputs(study: Study, arm: str, frac: float, head: str = "latent") -> dict[str, Any]:
    """A probe's settings (`probe_settings`), its frozen checkpoint and the unigram estimate it
    starts from."""
    return {"settings": settings_fingerprint(probe_settings(study.spec.probe, head)),
            "unigram": UNIGRAM_ESTIMATE,
            "checkpoint": checkpoint_fingerprint(study.checkpoint(arm, frac))}


def finetune_settings(ft: Any) -> dict[str, Any]:
    """A study's `finetune:` settings as they decide its cells. max_len 0 (each task kind's own
    length) is DEFAULT_MAX_LEN when no task is a retrieval task, so a study that leaves max_len
    unset keeps the stage fingerprint it had while 128 was the default; with a retrieval task
    it is 0 (the model's own length: other cells than at 128)."""
    from mlsm.evaluate.finetune.finetune_config import DEFAULT_MAX_LEN
    from mlsm.evaluate.finetune.tasks import get_task

    values = dataclasses.asdict(ft)
    if not values["max_len"] and all(get_task(t).kind != "retrieval" for t in ft.tasks):
        values["max_len"] = DEFAULT_MAX_LEN
    return values


def finetune_inputs(study: Study, arm: str) -> dict[str, Any]:
    """The fine-tuning settings (`finetune_settings`; and where they run: the device follows the
    executor) and every readiness checkpoint the grid fine-tunes."""
    ft = study.spec.finetune
    return {"settings": settings_fingerprint({**finetune_settings(ft),
                                              "executor": study.spec.executor.kind}),
            "checkpoint": settings_fingerprint({readiness_label(f): checkpoint_fingerprint(
                study.checkpoint(arm, f)) for f in ft.readiness}),
            DATA: _task_data(ft)}


def blimp_inputs(study: Study, arm: str, frac: float) -> dict[str, Any]:
    """The BLiMP settings that can change a score (`decisive()`: not the readiness list, which
    says which models, nor batching or refusal limits), the probe settings (its held-out batches
    score every arm's masked tokens), the checkpoint, the probe of a latent arm, the store and
    how the unigram control is estimated (rows of another estimate are not mixed in)."""
    return {"settings": settings_fingerprint(study.spec.blimp.decisive()),
            "unigram": UNIGRAM_ESTIMATE,
            "probe_settings": settings_fingerprint(probe_settings(study.spec.probe, "latent")),
            "checkpoint": checkpoint_fingerprint(study.checkpoint(arm, frac)),
            "probe": _probe_record(study, arm, frac), "store": store_fingerprint(study),
            DATA: data_inputs({"blimp.data": study.spec.blimp.data,
                               "blimp.heldout_store": study.spec.blimp.heldout_store}),
            **({"controls": _control_records(study, arm, frac)} if study.spec.probe.controls
               else {})}


def readout_inputs(study: Study, arm: str, frac: float) -> dict[str, Any]:
    r = study.spec.readout
    return {"settings": settings_fingerprint(None if r is None else dataclasses.asdict(r)),
            "unigram": UNIGRAM_ESTIMATE, "heldout_store": study.spec.blimp.heldout_store,
            "checkpoint": checkpoint_fingerprint(study.checkpoint(arm, frac)),
            "probe": _probe_record(study, arm, frac), "store": store_fingerprint(study),
            DATA: data_inputs({} if r is None else {f"readout.{k}": getattr(r, k) for k in
                                                     ("glue", "pairs", "store", "heldout_store")})}


def _frac_of(study: Study, arm: str, model: str) -> float | None:
    fracs = set(study.spec.readiness) | set(study.spec.blimp.readiness)
    return next((f for f in sorted(fracs) if f"{arm}@{readiness_label(f)}" == model), None)


def is_current(study: Study, kind: str, row: dict[str, Any]) -> bool:
    """Whether a BLiMP file's row (kind "blimp") or a readout row (kind "readout") was made from
    the current inputs and settings of its stage: its fingerprint equals theirs now."""
    arm = row.get("arm")
    if arm not in study.spec.arms or "fingerprint" not in row:
        return False
    if study.pieces:  # published pieces hold no checkpoint; each row was current when published
        return True
    if kind == "blimp":
        frac = row.get("readiness")
        if not isinstance(frac, float | int):
            return False
        inputs = blimp_inputs(study, arm, float(frac))
    else:
        frac = _frac_of(study, arm, str(row.get("model")))
        if frac is None:
            return False
        inputs = readout_inputs(study, arm, frac)
    return row["fingerprint"] == fingerprint_of(inputs) and same_data(row, inputs)


def finetune_is_current(study: Study, arm: str) -> bool:
    """Whether the arm's fine-tuning record was made from the current settings and checkpoints."""
    record, inputs = study.status().get(f"finetune:{arm}", {}), finetune_inputs(study, arm)
    return record_matches(record, inputs)


def current_rows(study: Study, kind: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows made from the current inputs and settings of their stage (`is_current`);
    the others of the study's arms are left out of the report with one warning (a re-run of the
    stage redoes them), and other arms' (a piece restricted to some arms) without one."""
    ours = [r for r in rows if not isinstance(r.get("arm"), str) or study.owns(r["arm"])]
    kept = [r for r in ours if is_current(study, kind, r)]
    if len(kept) < len(ours):
        study.log(f"[study] warning: {len(ours) - len(kept)} {kind} row(s) were made from other "
                  f"inputs or settings than the study's now and are left out of the report; run "
                  f"the study with --stages {kind} to redo them")
    return kept


def stale_finetuning(study: Study) -> list[str]:
    """The arms whose fine-tuning rows in results.jsonl are not of the current settings and
    checkpoints (their stage record says other inputs)."""
    models = {str(r.get("model", "")) for r in study.result_rows()}
    return [arm for arm in study.spec.arms if any(m.startswith(f"{arm}@") for m in models)
            and not finetune_is_current(study, arm)]


def supersede_stale_finetuning(study: Study) -> None:
    """Move the stale fine-tuning rows out of results.jsonl (to superseded/): the report compares
    what is left."""
    for arm in stale_finetuning(study):
        study.supersede_rows(arm)


def blimp_rows(study: Study) -> list[dict[str, Any]]:
    """The BLiMP stage's result files (blimp/*.json), each checked to have the shape readers
    use, those made from other inputs or settings left out (`current_rows`)."""
    folder = study.root / "blimp"
    files = sorted(folder.glob("*.json")) if folder.is_dir() else []
    # the blimp stage skips a model whose file exists, so a torn one must be deleted to redo it
    fix = "delete it and run the study with --stages blimp to score that model again"
    rows = [read_json(p, "BLiMP result", fix) for p in files]
    for path, row in zip(files, rows, strict=True):
        wrong = _blimp_row_problem(row)
        if wrong:
            raise UserError(f"BLiMP result {path} is not one the study wrote ({wrong}); {fix}")
    return current_rows(study, "blimp", rows)


def _blimp_row_problem(row: dict[str, Any]) -> str | None:
    """What is wrong with the shape of a BLiMP result file (hand-edited, or another tool's), or
    None: the report reads these fields and must not die on a KeyError deep inside."""
    wrong = field_problem(row, {"arm": "text", "readiness": "number", "overall": "number",
                                 "n_pairs": "number", "sets": "object", "heldout": "object?",
                                 "probe": "object?"})
    if wrong or not row["sets"]:
        return wrong or "'sets' must map each pair set to its scores"
    for name, one in row["sets"].items():
        phenomena = one.get("phenomena") if isinstance(one, dict) else None
        if not isinstance(phenomena, dict) or not all(map(is_number, phenomena.values())):
            return f"sets.{name}.phenomena must map each phenomenon to its accuracy"
    return None
