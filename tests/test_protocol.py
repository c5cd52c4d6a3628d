"""Fine-tuning protocols: the validation carve-out, the best-lr choice on it, the mean-pooled head,
the step cap, the preset, and bootstrap CIs of each mean (parity with SciPy)."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats as sps

from mlsm.artifacts.results_file import append_results, read_results
from mlsm.errors import UserError
from mlsm.evaluate.compare.stats import SELECTED_LR, compare_runs
from mlsm.evaluate.finetune.finetune import finetune, prepare, resolve_model
from mlsm.evaluate.finetune.protocol import (
    PRESETS,
    carve_validation,
    grid_path,
    preset_settings,
    selected_rows,
    split_validation,
    validation_scores,
)
from mlsm.evaluate.finetune.task_cell import build_head, train_cell
from mlsm.evaluate.finetune.tasks import get_task, load_task
from tests.test_finetune import _bert, _keyword_sst2

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _bert(tmp_path_factory.mktemp("tiny") / "bert")


@pytest.mark.parametrize("n", [2, 3, 10, 101, 1000])
@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9])
def test_carve_is_a_deterministic_partition(n: int, fraction: float) -> None:
    train, val = carve_validation(n, "sst2", fraction, seed=7)
    assert sorted(train + val) == list(range(n)) and not set(train) & set(val)
    assert len(val) == min(n - 1, max(1, round(fraction * n)))
    assert (train, val) == carve_validation(n, "sst2", fraction, seed=7)
    if n == 1000:
        assert val != carve_validation(n, "sst2", fraction, seed=8)[1]


def test_the_preset_holds_out_five_percent_as_its_paper() -> None:
    """Gisserot-Boukhlef et al. 2025 (appendix) choose the lr on 5 % of the training set: the
    preset carves 50 of 1,000 examples, and docs/finetune.md's preset table says the same."""
    fraction = preset_settings("mlm-vs-clm-2025")["val_fraction"]
    train, val = carve_validation(1000, "sst2", fraction, seed=0)
    assert (len(train), len(val)) == (950, 50)
    page = (Path(__file__).resolve().parents[1] / "docs" / "finetune.md").read_text()
    stated = re.search(r"validation = (\d+) % of the training set \(`val_fraction=([\d.]+)`", page)
    assert stated and float(stated[1]) / 100 == float(stated[2]) == fraction


def test_validation_comes_from_training_data_only(tmp_path: Path) -> None:
    data = _keyword_sst2(tmp_path / "data")
    train, dev = load_task("sst2", "train", data), load_task("sst2", "dev", data)
    kept, val = split_validation(train, "sst2", 0.25, seed=1)
    assert all(v in train for v in val) and not [v for v in val if v in kept]
    assert len(kept) + len(val) == len(train) and len(dev) == 80


def _grid_rows(lrs: list[float], seeds: list[int]) -> list[dict]:
    """A deterministic fake scorer: validation peaks at lr 1e-4, the dev set at the smallest lr
    (so choosing on dev would pick another lr)."""
    rows = []
    for lr in lrs:
        for seed in seeds:
            val = 0.9 - (math.log10(lr) + 4) ** 2 / 10 + 0.001 * seed
            dev = 0.5 - math.log10(lr) / 100 + 0.01 * seed
            base = {"model": "m", "task": "sst2", "seed": seed, "lr": lr, "epochs": 1,
                    "batch_size": 32, "max_len": 128, "n_train": 90}
            rows += [{**base, "metric": "acc", "value": dev},
                     {**base, "metric": "acc_val", "value": val}]
    return rows


def test_the_best_lr_on_validation_is_reported_with_its_dev_scores() -> None:
    lrs, seeds = [1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4], [0, 1, 2]
    rows = _grid_rows(lrs, seeds)
    chosen = selected_rows(rows, "mlm-vs-clm-2025")
    by_lr = validation_scores(rows)
    assert max(by_lr, key=lambda lr: np.mean(by_lr[lr])) == 1e-4
    assert [(r["seed"], r["metric"], r["lr"], r["chosen_lr"]) for r in chosen] == [
        (s, "acc", SELECTED_LR, 1e-4) for s in seeds]
    assert [r["value"] for r in chosen] == [0.5 + 4 / 100 + 0.01 * s for s in seeds]
    assert chosen[0]["val_score"] == pytest.approx(0.9 + 0.001)
    # a tie goes to the smaller lr
    tied = [{**r, "value": 0.5} for r in rows]
    assert selected_rows(tied, "")[0]["chosen_lr"] == 1e-5


def test_mean_head_is_the_mean_of_unpadded_tokens_then_linear() -> None:
    spec = get_task("sst2")
    head = build_head(spec, 8, seed=3, pooling="mean").eval()
    again = build_head(spec, 8, seed=3, pooling="mean")
    assert torch.equal(head.out.weight, again.out.weight) and head.dense is None
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, 8, generator=gen)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    pooled = torch.stack([hidden[0, :3].mean(0), hidden[1].mean(0)])
    want = pooled @ head.out.weight.T + head.out.bias
    assert torch.allclose(head(hidden, mask), want, atol=1e-6)
    noisy = hidden.clone()
    noisy[0, 3:] = 100.0  # padding never counts
    assert torch.allclose(head(noisy, mask), want, atol=1e-6)


def test_max_steps_caps_a_run(tiny: Path, tmp_path: Path) -> None:
    data = _keyword_sst2(tmp_path / "data")
    spec = get_task("sst2")
    ref = resolve_model(str(tiny))
    prepared = prepare(ref, spec, load_task("sst2", "train", data), {}, 32)
    from mlsm.evaluate.finetune.finetune import _load_backbone

    cfg = {"lr": 1e-3, "epochs": 2, "batch_size": 8, "warmup_ratio": 0.1, "weight_decay": 0.0,
           "max_steps": 7, "head": "mean"}
    head = build_head(spec, 32, 0, "mean")
    steps = train_cell(_load_backbone(str(tiny)), head, prepared.tokenizer, spec, prepared.train,
                       0, cfg, torch.device("cpu"))
    assert steps == 7
    steps = train_cell(_load_backbone(str(tiny)), head, prepared.tokenizer, spec,
                       prepared.train[:40], 0, {**cfg, "max_steps": 0}, torch.device("cpu"))
    assert steps == 10  # 2 epochs of 5 batches


def test_validated_grid_end_to_end_and_resume(tiny: Path, tmp_path: Path) -> None:
    data = _keyword_sst2(tmp_path / "data")
    results = tmp_path / "results.jsonl"
    kwargs = {**preset_settings("mlm-vs-clm-2025", seeds=range(2), lrs=[1e-4, 3e-3],
                                max_steps=6, val_fraction=0.25, batch_size=8),
              "data_dir": data, "results": results, "device": "cpu"}
    finetune([f"a={tiny}", f"b={tiny}"], ["sst2"], **kwargs)
    grid = read_results(grid_path(results))
    assert {(r["metric"], r["n_eval"], r["n_train"]) for r in grid} == {
        ("acc", 80, 180), ("acc_val", 60, 180)}  # dev is scored, validation carved from train
    assert {r["head"] for r in grid} == {"mean"} and {r["max_steps"] for r in grid} == {6}
    rows = read_results(results)
    assert len(rows) == 4 and {r["metric"] for r in rows} == {"acc"}
    for r in rows:
        mine = [g for g in grid if g["model"] == r["model"]]
        assert r["chosen_lr"] == selected_rows(mine, "")[0]["chosen_lr"]
        assert r["lr"] == SELECTED_LR and r["preset"] == "mlm-vs-clm-2025"
        (dev,) = [g["value"] for g in mine if g["seed"] == r["seed"] and g["metric"] == "acc"
                  and g["lr"] == r["chosen_lr"]]
        assert r["value"] == dev
    before = (results.read_bytes(), grid_path(results).read_bytes())
    finetune([f"a={tiny}", f"b={tiny}"], ["sst2"], **kwargs)  # all done: nothing appended
    assert (results.read_bytes(), grid_path(results).read_bytes()) == before
    cmp = compare_runs(results)
    assert cmp.n_pairs[0, 1] == 2  # a and b pair by seed at their chosen lrs


def test_cli_preset_with_overrides(tiny: Path, tmp_path: Path) -> None:
    from mlsm.cli import main

    data = _keyword_sst2(tmp_path / "data", n_train=40, n_dev=20)
    results = tmp_path / "r.jsonl"
    assert main(["finetune", str(tiny), "--tasks", "sst2", "--preset", "mlm-vs-clm-2025",
                 "--seeds", "1", "--lrs", "1e-3,2e-3", "--max-steps", "2", "--data-dir",
                 str(data), "--results", str(results), "--device", "cpu"]) == 0
    (row,) = read_results(results)
    preset = PRESETS["mlm-vs-clm-2025"]
    assert (row["preset"], row["head"], row["epochs"], row["batch_size"], row["max_steps"]) == (
        "mlm-vs-clm-2025", preset.values["head"], preset.values["epochs"],
        preset.values["batch_size"], 2)
    held_out = round(preset.values["val_fraction"] * 40)  # the validation carved from 40
    assert row["n_train"] == 40 - held_out and row["chosen_lr"] in (1e-3, 2e-3)
    assert main(["finetune", str(tiny), "--tasks", "sst2", "--preset", "nope", "--results",
                 str(tmp_path / "x.jsonl")]) == 2


def test_study_preset_refuses_the_keys_it_fixes() -> None:
    from mlsm.study.spec import study_from_dict

    arms = {"mlm": {"objective": {"name": "mlm"}}}
    spec = study_from_dict({"arms": arms, "finetune": {"tasks": ["sst2"],
                                                       "preset": "mlm-vs-clm-2025"}})
    assert spec.finetune.preset == "mlm-vs-clm-2025"
    with pytest.raises(UserError, match="fixes finetune.lrs"):
        study_from_dict({"arms": arms, "finetune": {"preset": "mlm-vs-clm-2025", "lrs": [1e-3]}})
    with pytest.raises(UserError, match="unknown fine-tuning preset"):
        study_from_dict({"arms": arms, "finetune": {"preset": "seed002"}})


def test_mean_cis_equal_scipy(tmp_path: Path) -> None:
    results = tmp_path / "results.jsonl"
    rng = np.random.default_rng(5)
    values = {m: rng.normal(0.7, 0.05, 5) for m in ("A", "B")}
    append_results(results, [
        {"model": m, "task": "sst2", "metric": "acc", "value": float(v), "seed": s, "lr": 2e-5,
         "epochs": 3, "batch_size": 32, "max_len": 128, "n_train": 100}
        for m, vals in values.items() for s, v in enumerate(vals)])
    cmp = compare_runs(results, tmp_path / "out", bootstrap=999)
    for i, m in enumerate(cmp.models):
        ref = sps.bootstrap((values[m],), np.mean, n_resamples=999, confidence_level=0.95,
                            method="percentile", random_state=np.random.default_rng(0))
        low, high = ref.confidence_interval
        assert cmp.mean_ci[i, 0].tolist() == pytest.approx([low, high], abs=1e-12)
        assert low < values[m].mean() < high
        assert f"[{100 * low:.2f}, {100 * high:.2f}]" in cmp.to_markdown()
    with open(tmp_path / "out" / "means.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert float(rows[0]["ci_low"]) == pytest.approx(cmp.mean_ci[0, 0, 0])
    assert compare_runs(results).mean_ci is None  # no --bootstrap, no CI
    json.dumps(cmp.mean_ci.tolist())
