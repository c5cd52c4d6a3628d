"""What every fine-tuning kind (classification, token classification, extractive QA, retrieval)
shares: the step budget (`max_steps`) and the preset run end to end, on tiny data."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mlsm.artifacts.results_file import read_results
from mlsm.errors import UserError
from mlsm.evaluate.finetune.finetune import finetune
from mlsm.evaluate.finetune.protocol import grid_path
from tests.test_finetune import _bert, _keyword_sst2, _small_fixtures
from tests.test_qa import _squad_folder
from tests.test_retrieval import _beir

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _sst2(root: Path) -> Path:
    return _keyword_sst2(root, n_train=40, n_dev=12)


def _squad(root: Path) -> Path:
    _squad_folder(root, "squad_v1.1", 8, seed=1, facts=1)  # a lone dev file, split by article
    return root


def _toy(root: Path) -> Path:
    _beir(root)
    return root


# task -> (its data folder under a root, settings that keep its cells tiny)
KINDS: dict[str, tuple[Callable[[Path], Path], dict]] = {
    "sst2": (_sst2, {"max_len": 32}),
    "conll2003": (_small_fixtures, {"max_len": 32}),
    "squad": (_squad, {"max_len": 48}),
    "beir:toy": (_toy, {"max_len": 32}),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _bert(tmp_path_factory.mktemp("kinds") / "bert")


@pytest.fixture
def optimizer_steps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every AdamW.step call of the test, whichever module made the optimizer."""
    calls: list[int] = []
    real = torch.optim.AdamW.step

    @functools.wraps(real)
    def counted(self: torch.optim.AdamW, *args: object, **kwargs: object) -> object:
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", counted)
    return calls


@pytest.mark.parametrize("task", list(KINDS))
def test_every_kind_honours_max_steps(task: str, tiny: Path, tmp_path: Path,
                                      optimizer_steps: list[int]) -> None:
    """Three epochs of batches of 2 are many more than 2 steps for every task here: the cap
    ends each run after 2 optimizer steps, and without it the run takes all its epochs."""
    make, settings = KINDS[task]
    data = make(tmp_path / "data")
    kw = {"seeds": (0, 1), "lrs": (1e-3,), "epochs": 3, "batch_size": 2, "data_dir": data,
          "device": "cpu", **settings}
    finetune([str(tiny)], [task], max_steps=2, results=tmp_path / "capped.jsonl", **kw)
    assert len(optimizer_steps) == 2 * 2  # two seeds, two steps each
    assert {r["max_steps"] for r in read_results(tmp_path / "capped.jsonl")} == {2}
    optimizer_steps.clear()
    finetune([str(tiny)], [task], max_steps=0, results=tmp_path / "uncapped.jsonl", **kw)
    assert len(optimizer_steps) > 2 * 2 * 2  # at least 3 batches per epoch, 3 epochs


@pytest.mark.parametrize("task", list(KINDS))
def test_the_preset_runs_end_to_end_on_every_kind(task: str, tiny: Path, tmp_path: Path) -> None:
    """`--preset mlm-vs-clm-2025` (a validation split carved from the training data, the best of
    its learning rates chosen on it) trains, scores and reports every task kind it accepts."""
    make, settings = KINDS[task]
    results = tmp_path / "results.jsonl"
    finetune([str(tiny)], [task], preset="mlm-vs-clm-2025", seeds=1, lrs=[1e-4, 1e-3],
             max_steps=2, batch_size=4, data_dir=make(tmp_path / "data"), results=results,
             device="cpu", **settings)
    grid = read_results(grid_path(results))
    val = {r["metric"] for r in grid if r["metric"].endswith("_val")}
    dev = {r["metric"] for r in grid} - val
    assert val and val == {f"{m}_val" for m in dev}  # every dev metric has its validation twin
    assert {float(r["lr"]) for r in grid} == {1e-4, 1e-3}
    rows = read_results(results)
    assert {r["metric"] for r in rows} == dev
    assert {r["preset"] for r in rows} == {"mlm-vs-clm-2025"}
    assert {r["chosen_lr"] for r in rows} <= {1e-4, 1e-3} and len(rows) == len(dev)


def test_a_zero_shot_task_under_the_preset_is_one_line(tiny: Path, tmp_path: Path) -> None:
    """A zero-shot retrieval cell trains nothing: no validation split, no lr to choose."""
    with pytest.raises(UserError, match=r"beir:toy_zeroshot trains nothing.* as beir:toy$"):
        finetune([str(tiny)], ["beir:toy_zeroshot"], preset="mlm-vs-clm-2025",
                 data_dir=_toy(tmp_path / "data"), results=tmp_path / "r.jsonl")
    assert not (tmp_path / "r.jsonl").exists()
