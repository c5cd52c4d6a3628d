"""Hostile inputs of issue #52's classes on cases the other tests do not try (a red-team re-test):
each case failed on the code before its fix."""

from __future__ import annotations

import json
from pathlib import Path

from tests.test_study_reuse import _ran_since, _raw, _rows, _run


def test_a_study_redoes_blimp_when_its_pairs_changed_in_place(
    corpus_dir, tokenizer_dir, tmp_path
) -> None:
    """The BLiMP folder keeps its path and file names, one phenomenon's pairs are replaced: the
    stage is redone (the old file reused the old pairs' score, exit 0)."""
    raw = _raw(corpus_dir, tokenizer_dir, tmp_path, readout=None)
    out = Path(raw["out"])
    _run(raw)
    first = json.loads((out / "blimp" / "mlm@100pct.json").read_text())
    pairs = sorted(Path(raw["blimp"]["data"][0]).glob("*.jsonl"))[0]
    rows = [json.loads(x) for x in pairs.read_text().splitlines()]
    pairs.write_text("".join(json.dumps({**r, "sentence_good": r["sentence_bad"],
                                         "sentence_bad": r["sentence_good"]}) + "\n"
                             for r in rows))  # the same file name, the pairs swapped
    before = len(_rows(out))
    _run(raw)
    assert _ran_since(out, before) == ["blimp"]
    again = json.loads((out / "blimp" / "mlm@100pct.json").read_text())
    assert again["overall"] != first["overall"]


def test_a_study_redoes_finetuning_when_a_task_file_changed_in_place(
    corpus_dir, tokenizer_dir, tmp_path
) -> None:
    """The task folder keeps its path and file names, its labels are flipped: the fine-tuning
    stage is redone, its old rows superseded (the stage was reused whole, exit 0). A record made
    before the data were fingerprinted is adopted, not redone."""
    from tests.test_study_reuse import _status

    raw = _raw(corpus_dir, tokenizer_dir, tmp_path, readout=None, blimp={})
    tasks = Path(raw["_tasks"])
    raw["finetune"] = {"tasks": ["word_order"], "data_dir": str(tasks), "readiness": [1.0],
                       "seeds": 1, "lrs": [1e-3], "epochs": 1, "batch_size": 16, "max_len": 32}
    out = Path(raw["out"])
    _run(raw)
    status = _status(out)
    legacy = {**status, "finetune:mlm": {**status["finetune:mlm"], "fingerprint": "0" * 16,
                                         "inputs": {k: v for k, v in status["finetune:mlm"]
                                                    ["inputs"].items() if k != "data"}}}
    (out / "status.json").write_text(json.dumps(legacy))
    before = len(_rows(out))
    _run(raw)
    assert _ran_since(out, before) == []  # adopted, recorded with its data from now on
    assert _status(out)["finetune:mlm"]["fingerprint"] == status["finetune:mlm"]["fingerprint"]
    train = tasks / "WordOrder" / "train.tsv"
    lines = train.read_text().splitlines()
    train.write_text("\n".join([lines[0], *(s.rsplit("\t", 1)[0] + "\t" + str(
        1 - int(s.rsplit("\t", 1)[1])) for s in lines[1:])]) + "\n")
    before = len(_rows(out))
    _run(raw)
    assert _ran_since(out, before) == ["finetune"]
    assert (out / "superseded" / "results.jsonl").is_file()


def test_trainer_resume_refuses_another_objective_or_masking_than_the_checkpoints(
        store_dir, teacher_dir, dictionary_path, tmp_path) -> None:
    """`mlsm pretrain --resume` refuses a config that changes the weights (`check_same_run`);
    `train(resume_from_checkpoint=)` trained on with another λ or mask rate than the
    checkpoint's, a mix of two objectives in one run."""
    import dataclasses

    import pytest

    from mlsm.errors import UserError
    from tests.test_hf_trainer import OBJECTIVES, _cfg, _trainer

    objective = OBJECTIVES["mlsm"](dictionary_path, teacher_dir)
    cfg = _cfg(store_dir, tmp_path / "unused", objective)
    trainer, _ = _trainer(cfg, tmp_path / "hf", steps=2, save_strategy="steps", save_steps=1)
    trainer.train()
    checkpoint = str(tmp_path / "hf" / "checkpoint-1")
    other = _cfg(store_dir, tmp_path / "unused", {**objective, "lam": 0.2})
    again, _ = _trainer(other, tmp_path / "again", steps=2)
    with pytest.raises(UserError, match=r"objective\.lam") as info:
        again.train(resume_from_checkpoint=checkpoint)
    assert "\n" not in str(info.value)
    masked = _cfg(store_dir, tmp_path / "unused", objective)
    masked.data = dataclasses.replace(masked.data, mask_rate=0.4)
    again, _ = _trainer(masked, tmp_path / "again2", steps=2)
    with pytest.raises(UserError, match=r"data\.mask_rate"):
        again.train(resume_from_checkpoint=checkpoint)
    same, _ = _trainer(cfg, tmp_path / "same", steps=2)  # its own settings resume
    same.train(resume_from_checkpoint=checkpoint)
