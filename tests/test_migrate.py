"""`mlsm migrate` and the reader that refuses a checkpoint without its facts (issue #51).

A checkpoint of mlsm 0.1.0 records no latent head and no PLL refusal. They used to come from a
callback that `mlsm.objectives` registered on import, so a process that had not imported the
objectives read the defaults and scored an MAE checkpoint by PLL. Now every reader refuses such a
folder in one line naming `mlsm migrate`, which writes the facts in once (atomically; once only).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import mlsm
from mlsm.artifacts.checkpoint import COMPLETE, Checkpoint
from mlsm.errors import UserError
from mlsm.run_config import load_config
from mlsm.train.loop import pretrain

from .helpers import tiny_overrides

pytestmark = pytest.mark.usefixtures("one_torch_thread")
FACTS = ("latent_head", "pll_refusal")


def _run(store: Path, out: Path, objective: str) -> Path:
    extra = {"train.steps": 2, "train.readiness": "[1.0]", "objective.name": objective}
    return pretrain(load_config(None, tiny_overrides(store, out, **extra)))


@pytest.fixture(scope="module")
def runs(store_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 2-step MLM run and a 2-step MAE-LM run, as today's mlsm writes them (with the facts).
    Their own trainings, not conftest's shared runs: each has one checkpoint (the tests count what
    `mlsm migrate` prints per checkpoint; the shared MLM run has four), and MAE-LM is another
    objective."""
    root = tmp_path_factory.mktemp("migrate")
    return {name: _run(store_dir, root / name, name) for name in ("mlm", "mae_lm")}


def _old(run: Path, where: Path) -> tuple[Path, Path, bytes]:
    """A copy of `run` whose checkpoint.json is as mlsm 0.1.0 wrote it (no facts): (run, its
    checkpoint, the checkpoint.json today's save wrote)."""
    copy = shutil.copytree(run, where)
    folder = copy / "checkpoints" / "step-0000002"
    written = (folder / COMPLETE).read_bytes()
    info = json.loads(written)
    assert all(k in info for k in FACTS)
    (folder / COMPLETE).write_text(json.dumps({k: v for k, v in info.items() if k not in FACTS},
                                              indent=2))
    return copy, folder, written


def _migrate_cli(*paths: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from mlsm.cli import main

    capsys.readouterr()
    rc = main(["migrate", *map(str, paths)])
    out, err = capsys.readouterr()
    return rc, out, err


_READER_ONLY = """
import json, sys
from mlsm.artifacts.checkpoint import Checkpoint
from mlsm.errors import UserError
try:
    Checkpoint.open(sys.argv[1]).require_pll()
    refused = None
except UserError as exc:
    refused = str(exc)
loaded = sorted(m for m in sys.modules if m.startswith("mlsm.objectives"))
print(json.dumps({"refused": refused, "objectives": loaded}))
"""


def _reader_only(folder: Path) -> dict:
    """Ask a fresh process that imports the reader alone whether PLL may score `folder` (the
    src of the mlsm under test: PYTHONPATH=/other/src pytest ... checks another tree)."""
    src = Path(mlsm.__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(src)}
    done = subprocess.run([sys.executable, "-c", _READER_ONLY, str(folder)], env=env, check=True,
                          capture_output=True, text=True)
    return json.loads(done.stdout)


def test_import_order_cannot_score_an_old_mae_checkpoint(runs: dict[str, Path],
                                                         tmp_path: Path) -> None:
    """(a) Before: no objectives imported, no callback, the defaults: scored. Now: refused."""
    run, folder, _ = _old(runs["mae_lm"], tmp_path / "mae")
    seen = _reader_only(folder)
    assert seen["objectives"] == []  # the reader alone, as an entry point may import it
    refused = seen["refused"]
    assert refused is not None, "an mlsm 0.1.0 MAE checkpoint was let through to PLL scoring"
    assert "\n" not in refused and refused.endswith(f"add them once with: mlsm migrate {run}")
    assert refused.startswith(f"{folder / COMPLETE} does not record the latent head")
    # the same answer in a process that did import the objectives: no import decides it
    import mlsm.objectives  # noqa: F401

    with pytest.raises(UserError, match=f"mlsm migrate {re.escape(str(run))}$"):
        Checkpoint.open(folder).require_pll()
    with pytest.raises(UserError, match="mlsm migrate"):
        _ = Checkpoint.open(folder).latent_head


def test_migrate_writes_the_facts_a_save_writes_and_pll_follows_them(
        runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """(b) After `mlsm migrate`, the MAE checkpoint is refused for its decoder, the MLM one is
    scored; each checkpoint.json is byte for byte the one today's save wrote."""
    from mlsm.evaluate.zeroshot.pll import load_masked_lm, score_pll
    from mlsm.objectives.mae_lm import MAELM

    mae_run, mae, mae_saved = _old(runs["mae_lm"], tmp_path / "mae")
    mlm_run, mlm, mlm_saved = _old(runs["mlm"], tmp_path / "mlm")
    with pytest.raises(UserError, match=f"mlsm migrate {re.escape(str(mlm_run))}$"):
        load_masked_lm(str(mlm))  # an old MLM checkpoint too: nothing stands in for its facts
    rc, out, err = _migrate_cli(mae_run, mlm, capsys=capsys)
    assert (rc, err) == (0, "")
    assert out.splitlines() == [
        f"migrated {mae / COMPLETE}: latent head 'latent', refused by PLL ({MAELM.pll_refusal})",
        f"migrated {mlm / COMPLETE}: latent head 'latent', scored by PLL",
        "2 migrated, 0 unchanged"]
    assert (mae / COMPLETE).read_bytes() == mae_saved
    assert (mlm / COMPLETE).read_bytes() == mlm_saved
    assert _reader_only(mae)["refused"] == (f"{mae} is a mae_lm checkpoint: {MAELM.pll_refusal}; "
                                            f"evaluate it by fine-tuning: mlsm finetune {mae} "
                                            "--tasks TASKS")
    with pytest.raises(UserError, match="is a mae_lm checkpoint: its vocabulary head reads the "
                                        "MAE decoder"):
        load_masked_lm(str(mae))
    model, tokenizer = load_masked_lm(str(mlm))
    scores = score_pll(model, tokenizer, ["the cat sat on the mat."])
    assert len(scores) == 1 and scores[0] < 0


def test_a_probe_is_migrated_after_the_checkpoint_it_probed(
        runs: dict[str, Path], tmp_path: Path) -> None:
    """A run's probe runs are migrated with it, after the run's own checkpoints (a probe's
    refusal is its probed checkpoint's), whatever order the paths come in."""
    from mlsm.migrate import migrate
    from mlsm.objectives.mae_lm import MAELM

    run, mae, _ = _old(runs["mae_lm"], tmp_path / "mae")
    probe = run / "probe-step-0000002" / "checkpoints" / "step-0000001"
    probe.mkdir(parents=True)
    (probe / COMPLETE).write_text(json.dumps({  # as mlsm 0.1.0's probe fit wrote it
        "step": 1, "readiness": 1.0, "objective": "probe", "run": str(probe.parent.parent),
        "config": {"train": {"steps": 1, "readiness": [1.0]},
                   "objective": {"name": "probe", "checkpoint": str(mae)}}}))
    with pytest.raises(UserError, match=f"{re.escape(str(mae / COMPLETE))} does not record"):
        migrate([probe])  # its probed checkpoint first: named in one line
    done = migrate([probe, run])
    assert [(d.folder, d.written) for d in done] == [(mae, True), (probe, True)]
    assert Checkpoint.open(probe).pll_refusal == MAELM.pll_refusal


def test_migrate_is_idempotent(runs: dict[str, Path], tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    """(c) A checkpoint that records its facts is left as it is, and the command says so; so
    is a checkpoint saved by today's mlsm."""
    run, folder, _ = _old(runs["mlm"], tmp_path / "mlm")
    assert _migrate_cli(run, capsys=capsys)[0] == 0
    before = (folder / COMPLETE).stat()
    rc, out, err = _migrate_cli(run, folder, runs["mae_lm"], capsys=capsys)
    assert (rc, err) == (0, "")
    today = runs["mae_lm"] / "checkpoints" / "step-0000002"
    assert out.splitlines() == [
        f"unchanged {folder / COMPLETE}: it records its facts already",
        f"unchanged {today / COMPLETE}: it records its facts already",
        "0 migrated, 2 unchanged"]
    after = (folder / COMPLETE).stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_a_write_that_fails_midway_leaves_the_old_file_whole(
        runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """(d) The disk fills halfway through the new checkpoint.json: the old one is still there,
    whole, and nothing else is left in the folder; the next try writes a valid file."""
    run, folder, saved = _old(runs["mlm"], tmp_path / "mlm")
    old, files = (folder / COMPLETE).read_bytes(), sorted(os.listdir(folder))
    write_text = Path.write_text

    def half_then_full(self: Path, text: str, *args: object, **kwargs: object) -> int:
        if "pll_refusal" in text:  # the migrated checkpoint.json
            write_text(self, text[:len(text) // 2], *args, **kwargs)
            raise OSError(28, "No space left on device")
        return write_text(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", half_then_full)
    rc, out, err = _migrate_cli(run, capsys=capsys)
    assert rc == 2 and err.startswith("mlsm migrate: error: No space left on device: ")
    assert (folder / COMPLETE).read_bytes() == old
    assert sorted(os.listdir(folder)) == files
    monkeypatch.undo()
    assert _migrate_cli(run, capsys=capsys)[0] == 0
    assert json.loads((folder / COMPLETE).read_bytes()) == json.loads(saved)
    assert sorted(os.listdir(folder)) == files and not list(tmp_path.glob(".*.lock"))


def test_an_export_of_mlsm_0_1_0_is_refused_then_migrated(
        runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An export's mlsm.json carries the facts too; one written without them is refused naming
    the export, and migrated to what `mlsm export` writes today."""
    from mlsm.integrations.export import export_checkpoint

    out = export_checkpoint(runs["mae_lm"], tmp_path / "export")
    written = (out / "mlsm.json").read_bytes()
    info = json.loads(written)
    (out / "mlsm.json").write_text(json.dumps({k: v for k, v in info.items() if k not in FACTS},
                                              indent=2))
    said = rf"mlsm\.json does not record .* mlsm migrate {re.escape(str(out))}$"
    with pytest.raises(UserError, match=said):
        Checkpoint.open(out).require_pll()
    assert _migrate_cli(out, capsys=capsys)[0] == 0
    assert (out / "mlsm.json").read_bytes() == written
    with pytest.raises(UserError, match="is a mae_lm checkpoint"):
        Checkpoint.open(out).require_pll()


@pytest.mark.parametrize(("make", "said"), [
    (lambda p: None, "does not exist"),
    (lambda p: p.mkdir(), "holds no checkpoint.json, mlsm.json or checkpoints/ folder"),
])
def test_a_path_that_is_no_checkpoint_is_one_line(make, said: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    make(tmp_path / "x")
    rc, out, err = _migrate_cli(tmp_path / "x", capsys=capsys)
    assert (rc, out) == (2, "") and said in err and err.count("\n") == 1


def test_an_unknown_objective_is_refused_not_defaulted(runs: dict[str, Path],
                                                       tmp_path: Path) -> None:
    from mlsm.migrate import migrate

    _, folder, _ = _old(runs["mlm"], tmp_path / "mlm")
    info = json.loads((folder / COMPLETE).read_text())
    (folder / COMPLETE).write_text(json.dumps({**info, "objective": "mlm_v9"}))
    with pytest.raises(UserError, match="names objective 'mlm_v9', which mlsm does not know"):
        migrate(folder)
    assert "latent_head" not in json.loads((folder / COMPLETE).read_text())
