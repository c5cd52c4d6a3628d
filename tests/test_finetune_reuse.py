"""Fine-tuning settings declared once (FinetuneConfig -> CLI flags, finetune(), the study spec),
cells reused only on an exact fingerprint, and one append per cell under concurrent grids."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import threading
from pathlib import Path

import pytest
import torch

import mlsm.evaluate.finetune.finetune as ft
from mlsm.artifacts.results_file import read_results
from mlsm.cli.dataclass_flags import add_dataclass_flags, flag_values
from mlsm.errors import UserError
from mlsm.evaluate.compare.stats import compare_runs
from mlsm.evaluate.finetune.finetune import finetune
from mlsm.evaluate.finetune.finetune_config import FinetuneConfig
from mlsm.study.spec import FinetuneSpec
from tests.test_finetune import _bert, _keyword_sst2

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BASE = {"seeds": (0,), "lrs": (2e-3,), "epochs": 1, "batch_size": 16, "max_len": 32,
        "max_train_examples": 32, "device": "cpu"}


def _parser() -> argparse.ArgumentParser:
    from mlsm.cli import build_parser

    parser, _ = build_parser()
    return parser


# ----------------------------------------------------------------------------- declared once


def test_every_setting_is_a_flag_with_its_default_and_a_study_key() -> None:
    parser = _parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags = {a.dest: a for a in sub.choices["finetune"]._actions}
    study = {f.name: f for f in dataclasses.fields(FinetuneSpec)}
    for f in dataclasses.fields(FinetuneConfig):
        assert f.name in flags, f"mlsm finetune has no flag for {f.name}"
        assert flags[f.name].option_strings == ["--" + f.name.replace("_", "-")]
        default = getattr(FinetuneConfig(), f.name)
        assert f"default {default if not isinstance(default, list) else default[0]}" \
            in flags[f.name].help.replace("'", "")
        assert f.name in study and getattr(FinetuneSpec(), f.name) == default
    # no flags given: the config is FinetuneConfig's defaults; given ones come back typed
    args = parser.parse_args(["finetune", "m", "--tasks", "rte"])
    assert FinetuneConfig.build(flag_values(args, FinetuneConfig)) == FinetuneConfig()
    args = parser.parse_args(["finetune", "m", "--tasks", "rte", "--seeds", "2", "--lrs",
                              "1e-4,3e-4", "--weight-decay", "0.1", "--fixed-order"])
    cfg = FinetuneConfig.build(flag_values(args, FinetuneConfig))
    assert (cfg.seed_list(), cfg.lrs, cfg.weight_decay, cfg.fixed_order) == \
        ([0, 1], [1e-4, 3e-4], 0.1, True)


def test_presets_are_values_of_the_config() -> None:
    from mlsm.evaluate.finetune.protocol import PRESETS

    for name, preset in PRESETS.items():
        cfg = FinetuneConfig.build({"preset": name, "epochs": 7})  # ranges checked, given wins
        assert cfg.epochs == 7 and cfg.preset == name
        assert all(getattr(cfg, k) == v for k, v in preset.values.items() if k != "epochs")


def test_flag_ranges_are_the_declared_ones() -> None:
    """A value outside a field's declared range is refused by the flag and by the dataclass."""
    @dataclasses.dataclass
    class Toy:
        size: int = dataclasses.field(default=2, metadata={"check": (lambda v: v > 1, "> 1")})
        """A size."""

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_dataclass_flags(parser, Toy)
    assert flag_values(parser.parse_args(["--size", "3"]), Toy) == {"size": 3}
    with pytest.raises(argparse.ArgumentError, match="must be > 1"):
        parser.parse_args(["--size", "1"])
    with pytest.raises(UserError, match="finetune.warmup_ratio must be in"):
        FinetuneConfig.build({"warmup_ratio": 1.5})


# ----------------------------------------------------------------------------- fingerprints


@pytest.fixture()
def grid(tmp_path: Path) -> dict:
    model = _bert(tmp_path / "m")
    data = _keyword_sst2(tmp_path / "data", n_train=32, n_dev=16)
    results = tmp_path / "r.jsonl"
    finetune([f"a={model}"], ["sst2"], data_dir=data, results=results, **BASE)
    return {"model": model, "data": data, "results": results, "tmp": tmp_path}


def _trains(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = ft.run_cell
    monkeypatch.setattr(ft, "run_cell", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    return calls


def test_the_same_settings_reuse_the_cell(grid, monkeypatch) -> None:
    calls = _trains(monkeypatch)
    before = grid["results"].read_bytes()
    copy = grid["tmp"] / "copy"  # a copy of the model folder has the same content
    shutil.copytree(grid["model"], copy)
    finetune([f"a={copy}"], ["sst2"], data_dir=grid["data"], results=grid["results"], **BASE)
    assert not calls and grid["results"].read_bytes() == before


def test_the_default_length_reuses_cells_made_at_128(tmp_path: Path, monkeypatch) -> None:
    """max_len 0 (the default) is 128 for a sentence task, resolved before the cell key and the
    fingerprint: cells stored at 128 (the old default, or given) are this default's cells."""
    model, data = _bert(tmp_path / "m"), _keyword_sst2(tmp_path / "data", n_train=32, n_dev=16)
    results = tmp_path / "r.jsonl"
    finetune([f"a={model}"], ["sst2"], data_dir=data, results=results, **{**BASE, "max_len": 128})
    before = results.read_bytes()
    calls = _trains(monkeypatch)
    default = {k: v for k, v in BASE.items() if k != "max_len"}
    finetune([f"a={model}"], ["sst2"], data_dir=data, results=results, **default)
    assert not calls and results.read_bytes() == before
    assert {r["max_len"] for r in read_results(results)} == {128}


def test_a_study_without_max_len_keeps_its_finetuning_fingerprint() -> None:
    """A study's stage fingerprint of a sentence grid is the same at the default max_len (0) as
    at 128, the old default: nothing is superseded or retrained; a retrieval task's differs."""
    from mlsm.artifacts.fingerprint import settings_fingerprint
    from mlsm.study.reuse import finetune_settings

    def fp(**keys: object) -> str:
        return settings_fingerprint(finetune_settings(FinetuneSpec(**keys)))

    assert fp(tasks=["sst2", "squad"]) == settings_fingerprint(
        dataclasses.asdict(FinetuneSpec(tasks=["sst2", "squad"], max_len=128)))
    assert fp(tasks=["sst2", "scifact"]) != fp(tasks=["sst2", "scifact"], max_len=128)


@pytest.mark.parametrize("change, needle", [
    ({"weight_decay": 0.1}, "weight_decay: 0.01 -> 0.1"),
    ({"warmup_ratio": 0.5}, "warmup_ratio: 0.0 -> 0.5"),
    ({"clip": 0.0}, "clip: 1.0 -> 0.0"),
    ({"fixed_order": True}, "fixed_order: False -> True"),
    ({"head": "mean"}, "head: 'cls' -> 'mean'"),
    ("data", "task data:"),
    ("weights", "model files:"),
])
def test_a_changed_input_never_reuses_the_cell(grid, monkeypatch, change, needle) -> None:
    kwargs = {**BASE, "data_dir": grid["data"]}
    if change == "data":  # one label flipped in place, same folder
        tsv = grid["data"] / "SST-2" / "train.tsv"
        lines = tsv.read_text().splitlines()
        text, label = lines[1].rsplit("\t", 1)
        lines[1] = f"{text}\t{1 - int(label)}"
        tsv.write_text("\n".join(lines) + "\n")
    elif change == "weights":  # another model saved under the same folder name
        shutil.rmtree(grid["model"])
        _bert(grid["model"], seed=1)
    else:
        kwargs.update(change)
    calls = _trains(monkeypatch)
    before = grid["results"].read_bytes()
    with pytest.raises(UserError, match="recompute") as err:
        finetune([f"a={grid['model']}"], ["sst2"], results=grid["results"], **kwargs)
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert not calls and grid["results"].read_bytes() == before  # refused before training
    finetune([f"a={grid['model']}"], ["sst2"], results=grid["results"], recompute=True, **kwargs)
    rows = read_results(grid["results"])
    assert len(calls) == 1 and len(rows) == 2 and rows[1]["supersedes"] == rows[0]["fingerprint"]
    cmp = compare_runs(grid["results"])  # a cell keeps its last value
    assert cmp.mean[0, 0] == pytest.approx(rows[1]["value"]) and cmp.count[0, 0] == 1
    finetune([f"a={grid['model']}"], ["sst2"], results=grid["results"], **kwargs)  # now reused
    assert len(calls) == 1 and len(read_results(grid["results"])) == 2


def test_rows_without_a_fingerprint_are_refused(grid) -> None:
    rows = [json.loads(line) for line in grid["results"].read_text().splitlines()]
    old = grid["tmp"] / "old.jsonl"
    old.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "fingerprint"}) + "\n"
                           for r in rows))
    with pytest.raises(UserError, match="before results recorded fingerprints.*--recompute"):
        finetune([f"a={grid['model']}"], ["sst2"], data_dir=grid["data"], results=old, **BASE)
    assert compare_runs(old).count[0, 0] == 1  # compare still reads old rows


def test_two_concurrent_grids_append_a_cell_once(tmp_path, monkeypatch) -> None:
    """Both grids train the cell (they meet at a barrier after training); one appends it."""
    model = _bert(tmp_path / "m")
    data = _keyword_sst2(tmp_path / "data", n_train=32, n_dev=16)
    results = tmp_path / "r.jsonl"
    barrier, one = threading.Barrier(2, timeout=60), threading.Lock()
    real_prepare, real_run = ft.prepare, ft.run_cell

    def serial(fn):  # HF loading patches torch globally: not thread-safe, so one load at a time
        def call(*a, **k):
            with one:
                return fn(*a, **k)
        return call

    monkeypatch.setattr(ft, "prepare", serial(real_prepare))
    monkeypatch.setattr(ft, "run_cell", lambda *a, **k: (serial(real_run)(*a, **k),
                                                         barrier.wait())[0])
    errors: list[BaseException] = []

    def run() -> None:
        try:
            torch.set_num_threads(1)
            finetune([f"a={model}"], ["sst2"], data_dir=data, results=results, **BASE)
        except BaseException as exc:  # noqa: BLE001  (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(read_results(results)) == 1


def test_the_lr_grid_file_is_reused_only_on_its_fingerprint(tmp_path, monkeypatch) -> None:
    """--val-fraction: the grid file's cells follow the rule, and the selected rows record what
    they were chosen on."""
    model = _bert(tmp_path / "m")
    data = _keyword_sst2(tmp_path / "data", n_train=32, n_dev=16)
    results = tmp_path / "r.jsonl"
    kwargs = {**BASE, "lrs": (1e-3, 2e-3), "val_fraction": 0.25, "data_dir": data,
              "results": results}
    finetune([f"a={model}"], ["sst2"], **kwargs)
    chosen = read_results(results)
    assert len(chosen) == 1 and chosen[0]["selected_on"]
    calls = _trains(monkeypatch)
    finetune([f"a={model}"], ["sst2"], **kwargs)  # the very same: nothing trained or added
    assert not calls and read_results(results) == chosen
    with pytest.raises(UserError, match=r"lr-grid.jsonl: cell a sst2 .*weight_decay: 0.01 -> 0.1"):
        finetune([f"a={model}"], ["sst2"], **{**kwargs, "weight_decay": 0.1})
    finetune([f"a={model}"], ["sst2"], **{**kwargs, "weight_decay": 0.1, "recompute": True})
    after = read_results(results)
    assert len(calls) == 2 and len(after) == 2 and after[1]["weight_decay"] == 0.1
    assert after[1]["selected_on"] != after[0]["selected_on"]
    # another lr list: the grid's old cells are reused, the choice over them is not
    with pytest.raises(UserError, match=r"selected rows of a sst2 .*lr choice.*--recompute"):
        finetune([f"a={model}"], ["sst2"], **{**kwargs, "weight_decay": 0.1,
                                             "lrs": (1e-3, 2e-3, 5e-3)})
    assert len(calls) == 3 and len(read_results(results)) == 2


def test_the_cli_refuses_in_one_line_and_recomputes_on_request(grid, capsys) -> None:
    from mlsm.cli import main

    argv = ["finetune", f"a={grid['model']}", "--tasks", "sst2", "--seeds", "1", "--lrs", "2e-3",
            "--epochs", "1", "--batch-size", "16", "--max-len", "32", "--max-train-examples", "32",
            "--data-dir", str(grid["data"]), "--results", str(grid["results"]), "--device", "cpu",
            "--warmup-ratio", "0.5"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "warmup_ratio: 0.0 -> 0.5" in err and "--recompute" in err
    assert main([*argv, "--recompute"]) == 0 and len(read_results(grid["results"])) == 2
    assert main(argv) == 0 and len(read_results(grid["results"])) == 2  # reused now
