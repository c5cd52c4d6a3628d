"""A study end to end whose fine-tuning grid holds extractive QA (SQuAD v1.1) and dense
retrieval (a BEIR folder, fine-tuned and zero-shot): rows for every arm and task, the report,
and skip-if-complete / re-run-only-what-changed across re-runs."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from mlsm.artifacts.results_file import read_results
from mlsm.cli import main
from mlsm.study.runner import OUTPUTS, Study, run_study
from mlsm.study.spec import load_study
from tests.test_qa import _squad_folder
from tests.test_retrieval import _beir
from tests.test_study import _raw

TASKS = ("squad", "beir:toy", "beir:toy_zeroshot")
METRICS = {"squad": {"em", "f1"}, "beir:toy": {"ndcg@10", "recall@100", "mrr@10"},
           "beir:toy_zeroshot": {"ndcg@10", "recall@100", "mrr@10"}}


def _study_file(tmp_path: Path, corpus_dir: Path, tokenizer_dir: Path, teacher_dir: Path,
                **finetune: object) -> Path:
    data = tmp_path / "data"
    _squad_folder(data, "squad_v1.1", 8, seed=1, facts=1)  # by-article train/dev split
    _beir(data, "toy")
    raw = _raw(corpus_dir, tokenizer_dir, teacher_dir, tmp_path / "study",
               finetune={"tasks": list(TASKS), "data_dir": str(data), "readiness": [1.0],
                         "seeds": 1, "lrs": [1e-3], "epochs": 2, "max_steps": 4,
                         "batch_size": 8, "max_len": 48, **finetune})
    raw["readiness"] = [1.0]
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _stages(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "stages.jsonl").read_text().splitlines()]


def _states(path: Path) -> dict[str, tuple]:
    """Each stage's state and fingerprint (a skipped stage keeps them and records no time)."""
    return {k: (v.get("state"), v.get("fingerprint"))
            for k, v in Study(load_study(path)).status().items()}


def test_study_with_qa_and_retrieval_cells(corpus_dir, tokenizer_dir, teacher_dir,
                                           tmp_path) -> None:
    path = _study_file(tmp_path, corpus_dir, tokenizer_dir, teacher_dir)
    out = tmp_path / "study"
    report = run_study(load_study(path), log=lambda s: None)  # Incomplete would raise
    assert report == out / "report.md"
    rows = read_results(out / "results.jsonl")
    got = {(r["model"], r["task"]): set() for r in rows}
    for r in rows:
        got[(r["model"], r["task"])].add(r["metric"])
        assert 0 <= r["value"] <= 100, r
    # each row names what made it: the model's files, the task's data, the settings
    fps = {(r["model"], r["task"]): r["fingerprint"] for r in rows}
    assert all(set(fp) == {"model", "data", "settings"} for fp in fps.values()), fps
    for task in TASKS:
        a, b = fps[("mlm@100%", task)], fps[("mlsm@100%", task)]
        assert a["data"] == b["data"] and a["model"] != b["model"], task
    assert got == {(f"{arm}@100%", task): METRICS[task]
                   for arm in ("mlm", "mlsm") for task in TASKS}
    # the fine-tuned cells trained the bi-encoder (16 training queries): its ranking moved
    ndcg = {(r["model"], r["task"]): r["value"] for r in rows if r["metric"] == "ndcg@10"}
    assert {r["n_train"] for r in rows if r["task"] == "beir:toy"} == {16}
    assert any(ndcg[(m, "beir:toy")] != ndcg[(m, "beir:toy_zeroshot")]
               for m in ("mlm@100%", "mlsm@100%")), ndcg
    text = report.read_text()  # the table of mean dev scores has a column per task and metric
    for task in TASKS:
        for metric in METRICS[task]:
            assert f" {task} {metric} |" in text, (task, metric)
    assert {p.name for p in out.iterdir()} <= set(OUTPUTS), sorted(p.name for p in out.iterdir())

    # a re-run re-runs nothing: no row, the same status, no stage record but the report's
    # (the report is rendered again on every run, from the rows as they are)
    results, stages = (out / "results.jsonl").read_bytes(), _stages(out)
    status = _states(path)
    assert main(["study", str(path)]) == 0  # what a user runs: exit 0, nothing Incomplete
    assert (out / "results.jsonl").read_bytes() == results
    assert _stages(out)[:len(stages)] == stages
    assert [r["stage"] for r in _stages(out)[len(stages):]] == ["report"]
    stages = _stages(out)
    assert _states(path) == status

    # one fine-tuning setting changed: fine-tuning alone runs again, for every arm
    raw = yaml.safe_load(path.read_text())
    raw["finetune"]["max_steps"] = 3
    path.write_text(yaml.safe_dump(raw))
    run_study(load_study(path), log=lambda s: None)
    again = _stages(out)[len(stages):]
    assert {r["stage"] for r in again if r["state"] != "skipped"} <= {"finetune", "report"}
    assert {r["arm"] for r in again if r["stage"] == "finetune" and r["state"] == "done"} == \
        {"mlm", "mlsm"}
    # the arm's old rows moved to superseded/results.jsonl (docs/study.md); the new ones cover
    # every arm and task again, with the new setting on the trained cells
    new = read_results(out / "results.jsonl")
    assert {(r["model"], r["task"]) for r in new} == set(got)
    assert {r["max_steps"] for r in new if r["task"] != "beir:toy_zeroshot"} == {3}
    old = read_results(out / "superseded" / "results.jsonl")
    assert sorted(json.dumps(r, sort_keys=True) for r in old) == \
        sorted(json.dumps(r, sort_keys=True) for r in rows)
