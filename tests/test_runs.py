"""Run directories as model arguments (mlsm.artifacts.checkpoint).

RUN, RUN@50% and RUN@step-N work in every evaluation entry point.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mlsm.artifacts.checkpoint import readiness_checkpoints, resolve_checkpoint
from mlsm.artifacts.results_file import read_results
from mlsm.errors import UserError
from mlsm.evaluate.compare.stats import compare_runs
from mlsm.evaluate.finetune.finetune import finetune
from mlsm.evaluate.probe.probe import ProbeScorer, load_scorer, run_probe
from mlsm.evaluate.zeroshot.rank import load_encoder

from .test_finetune import _keyword_sst2


def _step(folder: Path) -> int:
    return int(folder.name.removeprefix("step-"))


def test_run_dir_percent_and_step_resolve_to_the_saved_checkpoints(mlm_run: Path) -> None:
    assert _step(resolve_checkpoint(mlm_run)) == 8
    assert _step(resolve_checkpoint(f"{mlm_run}@50%")) == 4
    assert _step(resolve_checkpoint(f"{mlm_run}@10%")) == 1  # round(0.8) = 1, as the loop saves it
    assert _step(resolve_checkpoint(f"{mlm_run}@25%")) == 2
    assert _step(resolve_checkpoint(f"{mlm_run}@step-2")) == 2
    folder = mlm_run / "checkpoints" / "step-0000004"
    assert resolve_checkpoint(folder) == folder  # a checkpoint folder is used as it is
    assert resolve_checkpoint("bert-base-cased") == Path("bert-base-cased")  # hub ids pass through
    assert [_step(p) for p in readiness_checkpoints(mlm_run)] == [1, 2, 4, 8]


@pytest.mark.parametrize(
    ("suffix", "message"),
    [
        ("@75%", r"no checkpoint at 75% readiness \(step 6\); it has step-1 .*step-8 \(100%\)"),
        (
            "@step-3",
            r"no checkpoint at step 3; it has step-1 \(12.5%\), step-2 \(25%\), step-4 \(50%\), "
            r"step-8 \(100%\)",
        ),
        ("@last", r"unknown suffix @last; use RUN, RUN@<percent>%"),
    ],
)
def test_bad_suffixes_list_what_exists(mlm_run: Path, suffix: str, message: str) -> None:
    with pytest.raises(UserError, match=message):
        resolve_checkpoint(f"{mlm_run}{suffix}")


def test_suffix_on_a_non_run_and_an_unfinished_run(mlm_run: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not a run directory"):
        resolve_checkpoint(f"{tmp_path}@50%")
    with pytest.raises(UserError, match="needs a run directory"):
        readiness_checkpoints(mlm_run / "checkpoints" / "step-0000008")
    # an interrupted run: its newest checkpoint is not the final one
    run = tmp_path / "cut"
    (run / "checkpoints").mkdir(parents=True)
    for step in (1, 2):
        src = mlm_run / "checkpoints" / f"step-{step:07d}"
        (run / "checkpoints" / src.name).symlink_to(src.resolve(), target_is_directory=True)
    with pytest.raises(
        UserError, match=r"not finished \(newest checkpoint step-2 of 8 steps\).*@step-2"
    ):
        resolve_checkpoint(run)
    with pytest.raises(UserError, match=r"step-4, step-8 are missing"):
        readiness_checkpoints(run)
    (run / "checkpoints" / "step-0000001").unlink()
    (run / "checkpoints" / "step-0000002").unlink()
    with pytest.raises(UserError, match="no complete checkpoint"):
        resolve_checkpoint(run)


def test_finetune_readiness_all_rows_carry_step_and_readiness(
    mlm_run: Path, tmp_path: Path
) -> None:
    data = _keyword_sst2(tmp_path / "data", n_train=16, n_dev=8)
    results = tmp_path / "results.jsonl"
    reference = mlm_run / "checkpoints" / "step-0000002"  # not a run directory: taken as it is
    finetune([f"mlm={mlm_run}", f"ref={reference}"], ["sst2"], seeds=(0,), epochs=1, batch_size=8,
             data_dir=data, results=results, device="cpu", readiness="all")
    rows = read_results(results)
    assert [(r["model"], r["step"], r["readiness"]) for r in rows] == [
        ("mlm@step-1", 1, 0.125), ("mlm@step-2", 2, 0.25), ("mlm@step-4", 4, 0.5),
        ("mlm@step-8", 8, 1.0),
        ("ref", 2, 0.25),
    ]
    assert {Path(r["run"]).name for r in rows} == {"tiny-mlm"}  # what report.py groups a curve by
    assert compare_runs(results).info["mlm@step-4"]["readiness"] == 0.5
    finetune([f"{mlm_run}@25%"], ["sst2"], seeds=(0,), epochs=1, batch_size=8, data_dir=data,
             results=results, device="cpu")
    assert read_results(results)[-1]["model"] == "tiny-mlm@step-2"  # no name: <run>@step-<N>


def test_rank_loader_takes_a_run_spec(mlm_run: Path) -> None:
    model, _ = load_encoder(f"{mlm_run}@50%")
    saved = load_file(mlm_run / "checkpoints" / "step-0000004" / "model.safetensors")
    emb = next(v for k, v in saved.items() if k.endswith("word_embeddings.weight"))
    assert torch.equal(model.embeddings.word_embeddings.weight, emb)


def test_blimp_scorer_of_an_mlsm_run_goes_through_its_probe(mlsm_run: Path, tmp_path: Path) -> None:
    run = Path(shutil.copytree(mlsm_run, tmp_path / "tiny-mlsm"))  # the probe is written into it
    with pytest.raises(UserError, match=f"train its probe first: mlsm probe {run}"):
        load_scorer(run)
    probe = run_probe(run, steps=2)
    assert probe == run / "probe-step-0000030"  # the run's final checkpoint, default place
    scorer, _ = load_scorer(run)
    assert isinstance(scorer, ProbeScorer)
    heads = load_file(probe / "checkpoints" / "step-0000002" / "heads.safetensors")
    assert torch.equal(scorer.probe.weight, heads["probe.weight"])
    with pytest.raises(UserError, match="probe-step-0000015 has no probe"):  # @50 % has none yet
        load_scorer(f"{run}@50%")
