"""A study reuses a stage only when the fingerprint of its inputs and settings, recorded with the
stage, equals the current one (issue #34 item 1): an edited BLiMP, readout or fine-tuning setting
re-runs that stage (its old output moved to superseded/, never in the report) and not
pre-training; nothing edited re-runs nothing; an edited pre-training config or a rebuilt store
under a finished run is refused in one line; a study folder written before fingerprints
continues without re-training."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from mlsm.errors import Incomplete
from mlsm.study.reuse import blimp_rows
from mlsm.study.runner import STAGES, Study, run_study
from mlsm.study.spec import StudySpec, study_from_dict
from tests.helpers import TINY_MODEL
from tests.test_study import _tiny_tasks

QUIET = {"log": lambda s: None}


def _raw(corpus_dir: Path, tokenizer_dir: Path, tmp_path: Path, **extra: object) -> dict:
    """One MLM arm of 2 steps, BLiMP and a masked-token readout at 100 %."""
    tasks, blimp = _tiny_tasks(tmp_path)
    raw = {
        "name": "reuse", "out": str(tmp_path / "study"),
        "corpus": {"sources": [str(corpus_dir)], "tokenizer": str(tokenizer_dir)},
        "base": {"data": {"max_len": 32}, "model": {"arch": "bert", "overrides": dict(TINY_MODEL)},
                 "optim": {"lr": 1e-3},
                 "train": {"steps": 2, "batch_size": 4, "log_every": 1, "device": "cpu"}},
        "readiness": [1.0],
        "arms": {"mlm": {"objective": {"name": "mlm"}}},
        "blimp": {"data": [str(blimp)], "readiness": [1.0]},
        "probe": {"heldout_batches": 1, "batch_size": 4},
        "readout": {"kinds": ["masked"], "masked_batches": 1, "batch_size": 4},
        "executor": {"kind": "local", "threads": 1},
        "_tasks": str(tasks),
    }
    raw.update(extra)
    return {k: v for k, v in raw.items() if v is not None}  # None: the study has no such stage


def _run(raw: dict, stages: list[str] | None = None) -> Path | None:
    """Run the study (every stage but the report, whose plots take seconds, unless asked)."""
    return run_study(_spec(raw), stages=stages or [s for s in STAGES if s != "report"], **QUIET)


def _spec(raw: dict) -> StudySpec:
    return study_from_dict({k: v for k, v in raw.items() if k != "_tasks"})


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "stages.jsonl").read_text().splitlines()]


def _status(out: Path) -> dict:
    return json.loads((out / "status.json").read_text())


def _ran_since(out: Path, before: int) -> list[str]:
    return [r["stage"] for r in _rows(out)[before:] if r["state"] == "done"]


def test_nothing_edited_reruns_nothing(corpus_dir, tokenizer_dir, tmp_path) -> None:
    raw = _raw(corpus_dir, tokenizer_dir, tmp_path)
    out = Path(raw["out"])
    _run(raw)
    rows, status = _rows(out), _status(out)
    for stage in ("store", "pretrain", "blimp", "readout"):  # every record has its fingerprint
        assert all("fingerprint" in r for r in rows if r["stage"] == stage), stage
    blimp = (out / "blimp" / "mlm@100pct.json").read_text()
    _run(raw)
    assert _ran_since(out, len(rows)) == []
    again = _status(out)
    assert {k: v.get("fingerprint") for k, v in again.items()} == \
        {k: v.get("fingerprint") for k, v in status.items()}
    assert (out / "blimp" / "mlm@100pct.json").read_text() == blimp
    assert not (out / "superseded").exists()


def test_edited_blimp_and_readout_settings_rerun_those_stages_only(
    corpus_dir, tokenizer_dir, tmp_path
) -> None:
    raw = _raw(corpus_dir, tokenizer_dir, tmp_path)
    out = Path(raw["out"])
    _run(raw)
    assert json.loads((out / "blimp" / "mlm@100pct.json").read_text())["n_pairs"] == 10
    before = len(_rows(out))
    raw["blimp"]["limit_per_phenomenon"] = 2  # 2 pairs of each of the 2 phenomena
    _run(raw)
    assert _ran_since(out, before) == ["blimp"]
    assert json.loads((out / "blimp" / "mlm@100pct.json").read_text())["n_pairs"] == 4
    old = list((out / "superseded").rglob("mlm@100pct.json"))
    assert len(old) == 1 and json.loads(old[0].read_text())["n_pairs"] == 10
    assert [r["n_pairs"] for r in blimp_rows(Study(_spec(raw), **QUIET))] == [4]

    before = len(_rows(out))
    raw["readout"]["masked_batches"] = 2
    _run(raw)
    assert _ran_since(out, before) == ["readout"]
    rows = [json.loads(x) for x in (out / "readouts" / "mlm@100pct.jsonl").read_text().splitlines()]
    assert rows and all(r["fingerprint"] == _status(out)["readout:mlm@100%"]["fingerprint"]
                        for r in rows)
    assert len(list((out / "superseded").rglob("mlm@100pct.jsonl"))) == 1


def test_a_stale_row_is_never_in_the_report(corpus_dir, tokenizer_dir, tmp_path) -> None:
    """The setting is edited and only the report is asked for: the old BLiMP file and readout
    rows stay where they are, but the report leaves them out (with a warning)."""
    raw = _raw(corpus_dir, tokenizer_dir, tmp_path)
    out = Path(raw["out"])
    _run(raw, [s for s in STAGES])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["blimp"] and summary["readouts"]
    raw["blimp"]["limit_per_phenomenon"] = 2
    raw["readout"]["batch_size"] = 2
    _run(raw, stages=["report"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["blimp"] == [] and summary["readouts"] == []
    assert (out / "blimp" / "mlm@100pct.json").is_file()  # kept: a revert makes it current again


def test_edited_finetuning_setting_reruns_finetuning_and_supersedes_its_rows(
    corpus_dir, tokenizer_dir, tmp_path
) -> None:
    raw = _raw(corpus_dir, tokenizer_dir, tmp_path, blimp={}, readout=None)
    raw["finetune"] = {"tasks": ["word_order"], "data_dir": raw["_tasks"], "readiness": [1.0],
                       "seeds": 1, "lrs": [1e-3], "epochs": 1, "batch_size": 16, "max_len": 32}
    out = Path(raw["out"])
    _run(raw)
    first = (out / "results.jsonl").read_text().splitlines()
    before = len(_rows(out))
    raw["finetune"]["weight_decay"] = 0.3  # not part of a cell's key: only the fingerprint sees it
    _run(raw)
    assert _ran_since(out, before) == ["finetune"]
    assert (out / "superseded" / "results.jsonl").read_text().splitlines() == first
    now = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert len(now) == len(first) and {r["model"] for r in now} == {"mlm@100%"}


def test_edited_pretraining_config_is_refused_in_one_line(
    corpus_dir, tokenizer_dir, tmp_path
) -> None:
    raw = _raw(corpus_dir, tokenizer_dir, tmp_path, blimp={}, readout=None)
    out = Path(raw["out"])
    _run(raw, ["store", "pretrain"])
    raw["base"]["optim"]["lr"] = 5e-4
    with pytest.raises(Incomplete, match="pretrain:mlm"):
        _run(raw, ["store", "pretrain"])
    error = _status(out)["pretrain:mlm"]["error"]
    assert "optim.lr" in error and "\n" not in error


def test_a_store_rebuilt_under_a_finished_run_is_refused(
    corpus_dir, tokenizer_dir, tmp_path
) -> None:
    """The run's config.yaml still matches, but the token store it trained on was rebuilt in place
    from other text: only the recorded fingerprint can tell, and the run is not redone."""
    from mlsm.data.corpus import prepare_corpus

    raw = _raw(corpus_dir, tokenizer_dir, tmp_path, blimp={}, readout=None)
    out = Path(raw["out"])
    _run(raw, ["store", "pretrain"])
    other = tmp_path / "other.txt"
    other.write_text("a different corpus with other words in it\n" * 50)
    prepare_corpus([str(other)], str(tokenizer_dir), out / "store", overwrite=True)
    with pytest.raises(Incomplete, match="pretrain:mlm"):
        _run(raw, ["pretrain"])
    error = _status(out)["pretrain:mlm"]["error"]
    assert "trained from other inputs (store:" in error and "\n" not in error
    assert _ran_since(out, 0).count("pretrain") == 1


def test_a_study_recorded_before_fingerprints_continues_without_retraining(
    corpus_dir, tokenizer_dir, tmp_path
) -> None:
    """A folder whose records carry no fingerprint (written before this change): the finished
    run is adopted (its config.yaml equals the arm's config), the cheap BLiMP stage is redone."""
    raw = _raw(corpus_dir, tokenizer_dir, tmp_path, readout=None)
    out = Path(raw["out"])
    _run(raw)
    legacy = {k: {f: v for f, v in r.items() if f not in ("fingerprint", "inputs")}
              for k, r in _status(out).items()}
    (out / "status.json").write_text(json.dumps(legacy))
    (out / "stages.jsonl").write_text("".join(
        json.dumps({f: v for f, v in r.items() if f not in ("fingerprint", "inputs")}) + "\n"
        for r in _rows(out)))
    path = out / "blimp" / "mlm@100pct.json"
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items()
                                if k != "fingerprint"}))
    final = out / "runs" / "mlm" / "checkpoints" / "step-0000002" / "model.safetensors"
    weights = final.read_bytes()
    before = len(_rows(out))
    _run(raw)
    assert _ran_since(out, before) == ["blimp"]
    assert final.read_bytes() == weights
    assert "fingerprint" in _status(out)["pretrain:mlm"]  # adopted, recorded from now on
    assert len(blimp_rows(Study(_spec(raw), **QUIET))) == 1  # the redone row is current

    # a newer mlsm whose config has one more key (its default applies: config.yaml still
    # matches) changes the config's fingerprint, not the run: it is adopted again, not refused
    status = _status(out)
    status["pretrain:mlm"]["inputs"]["settings"] = "0" * 16
    status["pretrain:mlm"]["fingerprint"] = "1" * 16
    (out / "status.json").write_text(json.dumps(status))
    before = len(_rows(out))
    _run(raw, ["store", "pretrain"])
    assert _ran_since(out, before) == [] and _status(out)["pretrain:mlm"]["state"] == "done"


def test_signal_exit_zero_is_no_input_of_a_run(corpus_dir, tokenizer_dir, tmp_path) -> None:
    """train.signal_exit_zero says how `mlsm pretrain` exits when stopped, never what it trains:
    setting it changes no pre-training fingerprint (those recorded before the key existed stay
    current) and a run started without it resumes with it."""
    from mlsm.config import save_config
    from mlsm.study.reuse import pretrain_inputs
    from mlsm.study.sameness import check_same_config

    raw = _raw(corpus_dir, tokenizer_dir, tmp_path)
    plain = Study(_spec(copy.deepcopy(raw)), **QUIET)
    raw["base"]["train"]["signal_exit_zero"] = True
    zero = Study(_spec(raw), **QUIET)
    assert zero.arm_config("mlm").train.signal_exit_zero
    assert not plain.arm_config("mlm").train.signal_exit_zero
    assert pretrain_inputs(zero, "mlm")["settings"] == pretrain_inputs(plain, "mlm")["settings"]
    plain.run_dir("mlm").mkdir(parents=True)
    save_config(plain.arm_config("mlm"), plain.run_dir("mlm") / "config.yaml")
    check_same_config(zero.run_dir("mlm"), "mlm", zero.arm_config("mlm"))  # no "restore it" refusal


def test_a_torn_store_meta_is_one_line_not_a_changed_store(tmp_path: Path) -> None:
    """The study keyed its dictionary, target and pre-training stages on the store's fingerprint
    read from meta.json by hand, and took a torn meta.json for "no store": every stage on it
    then looked stale (a dictionary of 48 minutes moved aside and learned again). The store's
    own reader answers now: one line naming the rebuild."""
    from mlsm.errors import UserError
    from mlsm.study.reuse import store_fingerprint

    spec = study_from_dict({"out": str(tmp_path / "s"), "corpus": {"sources": ["x.txt"]},
                            "arms": {"a": {"objective": {"name": "mlm"}}}})
    study = Study(spec, **QUIET)
    assert store_fingerprint(study) is None  # no store yet
    study.store.mkdir(parents=True)
    (study.store / "meta.json").write_text('{"format": "mlsm-token-store", "fingerp')
    with pytest.raises(UserError, match=r"token store .* is damaged .*mlsm prepare"):
        store_fingerprint(study)


def test_a_path_superseded_twice_in_one_second_keeps_both(corpus_dir, tokenizer_dir,
                                                          tmp_path) -> None:
    """`Study.supersede` names its folder by the second; a second move of the same path within
    it replaced the first file kept (or failed on a folder: 'Directory not empty', seen when two
    target builds were set aside back to back). Both are kept now, in <time> and <time>-2."""
    study = Study(_spec(_raw(corpus_dir, tokenizer_dir, tmp_path)), **QUIET)
    made = []
    for text in ("first", "second", "third"):
        (study.root / "blimp").mkdir(parents=True, exist_ok=True)
        (study.root / "blimp" / "x.json").write_text(text)
        (study.root / "targets" / "t").mkdir(parents=True, exist_ok=True)
        (study.root / "targets" / "t" / "meta.json").write_text(text)
        made.append(study.supersede([study.root / "blimp" / "x.json",
                                     study.root / "targets" / "t"]))
    kept = sorted((f / "blimp" / "x.json").read_text() for f in made)
    assert kept == ["first", "second", "third"] and len(set(made)) == 3
    assert sorted((f / "targets" / "t" / "meta.json").read_text() for f in made) == kept
