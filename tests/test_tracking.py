"""train.report_to: a tiny pre-training run read back by each tracker's own reader."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mlsm.config import TRACKERS
from mlsm.errors import UserError
from mlsm.run_config import load_config
from mlsm.train.loop import pretrain
from mlsm.train.tracking import BACKENDS, open_tracker, require

from .helpers import tiny_overrides


def _run(store: Path, out: Path, trackers: str) -> Path:
    return pretrain(load_config(None, tiny_overrides(store, out, **{"train.report_to": trackers})))


def _losses(run: Path) -> dict[int, float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {m["step"]: m["loss"] for m in map(json.loads, lines)}


def test_config_names_the_same_trackers_as_the_tracking_module() -> None:
    assert tuple(TRACKERS) == BACKENDS


def test_tensorboard_events_hold_exactly_the_logged_losses(store_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    import numpy as np
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = _run(store_dir, tmp_path / "r", "[tensorboard]")
    acc = EventAccumulator(str(run / "tensorboard" / run.name))
    acc.Reload()
    read = {e.step: e.value for e in acc.Scalars("loss")}
    logged = _losses(run)
    assert sorted(read) == sorted(logged) == [1, 2, 3, 4, 5, 6]
    # TensorBoard scalars are float32: the logged float64 rounded once, nothing else
    assert all(read[s] == float(np.float32(logged[s])) for s in logged)
    assert {"lr", "grad_norm", "tokens_per_s", "flops_per_s"} <= set(acc.Tags()["scalars"])
    texts = set(acc.Tags()["tensors"])  # add_text is stored as a text-plugin tensor
    assert {"config/text_summary", "git_revision/text_summary"} <= texts


def test_a_missing_tracker_library_is_one_line_before_training(
    store_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now fails as if not installed
    with pytest.raises(UserError, match=r"wandb package is not installed.*\[tracking\]") as err:
        _run(store_dir, tmp_path / "r", "[wandb]")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "r" / "metrics.jsonl").exists()  # no step was trained


def test_unknown_tracker_is_refused_at_config_load(store_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="train.report_to must be a list of distinct trackers"):
        load_config(
            None, tiny_overrides(store_dir, tmp_path / "r", **{"train.report_to": "[neptune]"})
        )
    with pytest.raises(UserError, match="unknown tracker 'neptune'"):
        require(["neptune"], "--report-to")


@pytest.fixture
def mlflow_client(monkeypatch: pytest.MonkeyPatch):
    """MLflow's client class, with runs kept in a local file store (no server, no network)."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return MlflowClient


def test_mlflow_run_holds_the_logged_metrics_offline(tmp_path: Path, mlflow_client) -> None:
    MlflowClient = mlflow_client  # noqa: N806 - the library's class
    with open_tracker(["mlflow"], tmp_path, {"train": {"steps": 2}}, "run-a") as tracker:
        tracker.log({"loss": 2.5, "note": "text is skipped"}, 1)
        tracker.log({"loss": 1.25}, 2)
        run_id = tracker.backends["mlflow"].run_id
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    history = [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")]
    assert sorted(history) == [(1, 2.5), (2, 1.25)]
    run = client.get_run(run_id)
    assert run.data.params["train.steps"] == "2" and "mlflow.source.git.commit" in run.data.tags


_TRACKIO_SCRIPT = """
import json
from mlsm.train.tracking import open_tracker
from trackio.sqlite_storage import SQLiteStorage
with open_tracker(["trackio"], ".", {"train": {"steps": 2}}, "run-a") as tracker:
    tracker.log({"loss": 2.5}, 1)
    tracker.log({"loss": 1.25}, 2)
rows = [(r["step"], r["loss"]) for r in SQLiteStorage.get_logs("mlsm-test", "run-a")]
print("LOGS", json.dumps(rows))
"""


def _run_trackio(tmp_path: Path, script: str, *args: str) -> subprocess.CompletedProcess:
    """Run `script` in a fresh process: trackio reads TRACKIO_DIR when it is imported, so a new
    process keeps ~/.cache untouched."""
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"),
           "TRACKIO_PROJECT": "mlsm-test", "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-c", script, *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)


def test_trackio_run_holds_the_logged_metrics_offline(tmp_path: Path) -> None:
    pytest.importorskip("trackio")
    done = _run_trackio(tmp_path, _TRACKIO_SCRIPT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("LOGS ")  # trackio's own lines go to stderr
    assert json.loads(done.stdout[5:]) == [[1, 2.5], [2, 1.25]], done.stdout


def test_wandb_offline_run_is_written_without_network(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))  # no stored credentials
    from mlsm.train.tracking import wandb_mode

    assert wandb_mode() == "offline"
    with open_tracker(["wandb"], tmp_path, {"train": {"steps": 2}}, "run-a") as tracker:
        tracker.log({"loss": 2.0625}, 1)
        run = tracker.backends["wandb"].run  # still there: logging did not fail
        assert run.offline and "git_revision" in run.config and run.config["train"]["steps"] == 2
    # W&B's record log (protobuf; `wandb sync` uploads it). Its core process writes records (and
    # the summary) asynchronously and 0.31 has no Python reader: only the file is checked here.
    assert len(list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))) == 1


def test_finetune_writes_one_tensorboard_run_per_cell(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from mlsm.artifacts.results_file import read_results
    from mlsm.evaluate.finetune.finetune import finetune

    from .test_finetune import _bert, _keyword_sst2

    model = _bert(tmp_path / "m")
    data = _keyword_sst2(tmp_path / "data", n_train=40, n_dev=16)
    results = tmp_path / "out" / "results.jsonl"
    finetune(
        [f"a={model}"],
        ["sst2"],
        seeds=(0, 1),
        lrs=(2e-3,),
        epochs=2,
        batch_size=4,
        data_dir=data,
        results=results,
        device="cpu",
        report_to=["tensorboard"],
    )
    board = tmp_path / "out" / "tracking" / "tensorboard"
    cells = sorted(p.name for p in board.iterdir())
    assert cells == ["a-sst2-seed0-lr0.002", "a-sst2-seed1-lr0.002"]
    rows = {r["seed"]: r for r in read_results(results)}
    for seed, cell in enumerate(cells):
        acc = EventAccumulator(str(board / cell))
        acc.Reload()
        (final,) = acc.Scalars("eval/acc")
        assert final.step == 2 * 40 // 4 and final.value == pytest.approx(
            rows[seed]["value"], abs=1e-7
        )
        assert [e.step for e in acc.Scalars("train/loss")] == [10, 20]


def test_study_passes_report_to_and_checks_it_before_any_stage(
    corpus_dir: Path,
    tokenizer_dir: Path,
    teacher_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mlsm.study.runner import Study, run_study
    from mlsm.study.spec import study_from_dict

    from .test_study import _raw

    raw = _raw(corpus_dir, tokenizer_dir, teacher_dir, tmp_path / "study")
    raw["base"]["train"]["report_to"] = ["tensorboard", "wandb"]
    spec = study_from_dict(raw)
    assert Study(spec, print).arm_config("mlsm").train.report_to == ["tensorboard", "wandb"]
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(UserError, match=r"base.train.report_to .* wandb package is not installed"):
        run_study(spec, log=lambda s: None)
    assert not (tmp_path / "study" / "stages.jsonl").exists()  # no stage ran


def _interrupted_and_resumed(store: Path, out: Path, trackers: str, at: int = 3) -> Path:
    """A 6-step run that logged every step but was cut off before its last checkpoint (a crash
    between logging and saving), then resumed with --resume auto from checkpoint `at`. The first
    segment's metrics.jsonl is kept as first-metrics.jsonl beside the run."""
    import shutil

    cfg = load_config(None, tiny_overrides(store, out, **{"train.report_to": trackers}))
    run = pretrain(cfg)
    shutil.copy(run / "metrics.jsonl", out.parent / "first-metrics.jsonl")
    for folder in (run / "checkpoints").glob("step-*"):
        if int(folder.name.removeprefix("step-")) > at:
            shutil.rmtree(folder)
    assert (run / "checkpoints" / f"step-{at:07d}").is_dir()
    return pretrain(cfg, resume="auto")


def test_a_resumed_run_continues_one_tensorboard_series(store_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    import numpy as np
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = _interrupted_and_resumed(store_dir, tmp_path / "r", "[tensorboard]")
    (board,) = (run / "tensorboard").iterdir()  # one run folder, written by both segments
    assert len(list(board.glob("events.out.tfevents.*"))) == 2
    acc = EventAccumulator(str(board))
    acc.Reload()
    logged, first = (
        {m["step"]: m["tokens_per_s"] for m in map(json.loads, path.read_text().splitlines())}
        for path in (run / "metrics.jsonl", tmp_path / "first-metrics.jsonl")
    )
    for tag in ("loss", "tokens_per_s"):
        steps = [e.step for e in acc.Scalars(tag)]
        assert steps == [1, 2, 3, 4, 5, 6], tag  # every step once, in order
    # tokens_per_s is a wall-clock rate, different in each segment: steps 1-3 carry the first
    # segment's values and 4-6 the resumed one's, as metrics.jsonl does
    read = {e.step: e.value for e in acc.Scalars("tokens_per_s")}
    assert all(read[s] == float(np.float32(logged[s])) for s in logged)
    assert [logged[s] == first[s] for s in logged] == [True] * 3 + [False] * 3
    texts = [e.step for e in acc.Tensors("config/text_summary")]
    assert texts == [0]  # the config text was written once


def test_a_resumed_run_continues_the_same_wandb_run(
    store_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    run = _interrupted_and_resumed(store_dir, tmp_path / "r", "[wandb]")
    stored = json.loads((run / "tracking.json").read_text())[run.name]["wandb"]
    # W&B names each offline segment offline-run-<time>-<run id>, with "-1" appended when two
    # start within the same second; both carry the stored id
    segments = sorted((run / "wandb").glob("offline-run-*"))
    pattern = re.compile(r"offline-run-\d{8}_\d{6}-([a-z0-9]+)(?:-\d+)?")
    ids = [(pattern.fullmatch(s.name) or re.match("(.*)", s.name)).group(1) for s in segments]
    assert ids == [stored] * len(segments)
    records = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(records) == 2 and {r.name for r in records} == {f"run-{stored}.wandb"}


def test_a_resumed_mlflow_run_is_the_same_run_with_each_step_once(
    tmp_path: Path, mlflow_client
) -> None:
    MlflowClient = mlflow_client  # noqa: N806 - the library's class
    config = {"train": {"steps": 5, "threads": 1}}
    with open_tracker(["mlflow"], tmp_path, config, "run-a") as tracker:
        for step in (1, 2, 3, 4):
            tracker.log({"loss": float(step)}, step)
        first = tracker.backends["mlflow"].run_id
    config["train"]["threads"] = 2  # may change on resume; MLflow params are write-once
    with open_tracker(["mlflow"], tmp_path, config, "run-a", resume_step=2) as tracker:
        for step in (3, 4, 5):  # 3 and 4 replayed after the checkpoint at step 2
            tracker.log({"loss": 10.0 * step}, step)
        assert tracker.backends["mlflow"].run_id == first
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    history = sorted((m.step, m.value) for m in client.get_metric_history(first, "loss"))
    assert history == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 50.0)]
    (run,) = client.search_runs([client.get_run(first).info.experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["train.threads"] == "1"


_TRACKIO_RESUME_SCRIPT = """
import json, shutil, sys
from pathlib import Path
from mlsm.run_config import load_config
from mlsm.train.loop import pretrain
cfg = load_config(None, json.loads(sys.argv[1]))
run = pretrain(cfg)
for folder in (run / "checkpoints").glob("step-*"):
    if int(folder.name.removeprefix("step-")) > 3:
        shutil.rmtree(folder)
pretrain(cfg, resume="auto")
from trackio.sqlite_storage import SQLiteStorage
runs = [(r["name"], r["id"]) for r in SQLiteStorage.get_run_records("mlsm-test")]
stored = json.loads((run / "tracking.json").read_text())[run.name]["trackio"]
logs = [r["step"] for r in SQLiteStorage.get_logs("mlsm-test", run.name)]
runs = [[name, run_id == stored] for name, run_id in runs]
Path(sys.argv[2]).write_text(json.dumps({"runs": runs, "steps": logs}))
"""


def test_trackio_keeps_stdout_clean_and_resumes_the_same_run(
    store_dir: Path, tmp_path: Path
) -> None:
    pytest.importorskip("trackio")
    overrides = tiny_overrides(store_dir, tmp_path / "r", **{"train.report_to": "[trackio]"})
    result = tmp_path / "result.json"
    done = _run_trackio(tmp_path, _TRACKIO_RESUME_SCRIPT, json.dumps(overrides), str(result))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == ""  # mlsm's stdout carries results: trackio's news goes to stderr
    assert "Trackio" in done.stderr
    got = json.loads(result.read_text())
    assert got == {"runs": [["r", True]], "steps": [1, 2, 3, 4, 5, 6]}  # one run, the stored one
