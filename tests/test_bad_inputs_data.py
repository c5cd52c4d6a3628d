"""Nothing lost, nobody in: hostile inputs to the commands that write data (issue 15, data half).

Every table case runs the real CLI (`mlsm.cli.main`, in-process for speed; the lock and kill
cases run `python -m mlsm` in subprocesses) and asserts exit status 2, exactly one line on
stderr, no traceback, and that the user's files are byte-for-byte intact afterwards.
"""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from transformers.utils import logging as hf_logging

from mlsm import fileio, locking
from mlsm.artifacts.checkpoint import list_checkpoints, verify
from mlsm.cli import main
from mlsm.teacher.targets import TargetStore
from mlsm.train import checkpoint as ckpt

from .fix_hints import check_hint_is_tried
from .helpers import MLM_RUN, lock_held, make_text, tiny_overrides

SRC = Path(__file__).resolve().parents[1] / "src"
ENV = {**os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
RUN = {"train.steps": 3, "train.save_every": 1, "train.readiness": "[1.0]", "train.threads": 1}


def _tree(path: Path) -> dict[str, str]:
    """sha256 of every file under `path` (or of `path` itself), hidden files included."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p.relative_to(path.parent)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in files}


def _one_line_error(rc: int, err: str) -> str:
    assert rc == 2, err
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n") and lines[0].startswith("mlsm "), err
    return lines[0]


def _run_args(store: Path, out: Path, **extra: object) -> list[str]:
    return tiny_overrides(store, out, **{**RUN, **extra})


def _base_args(store: Path, out: Path, **extra: object) -> list[str]:
    """The settings of the session's MLM run (conftest `mlm_run`, checkpoints at steps 1, 2, 4,
    8), for a command on a copy of it: only `extra` differs."""
    return tiny_overrides(store, out, **{**MLM_RUN, **extra})


@pytest.fixture(scope="module")
def targets_cmd(store_dir: Path, teacher_dir: Path,
                dictionary_path: Path) -> Callable[[Path], list[str]]:
    def cmd(out: Path) -> list[str]:
        return ["targets", "--store", str(store_dir), "--dictionary", str(dictionary_path),
                "--teacher", str(teacher_dir),
                "--layer", "1", "--max-len", "32", "--batch-size", "16", "--out", str(out)]
    return cmd


@pytest.fixture(scope="module")
def fresh_targets(targets_cmd: Callable, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tgt") / "t"
    assert main(targets_cmd(out)) == 0
    return out


# --------------------------------------------------------------------------- the table
# Each case: (tmp, fixtures) -> (argv, paths that must stay intact, text the error must contain,
# text it must not contain or None).


def _user_folder(tmp: Path) -> Path:
    folder = tmp / "myproject"
    folder.mkdir()
    (folder / "notes.txt").write_text("my thesis\n")
    (folder / "data.csv").write_text("a,b\n1,2\n")
    return folder


def _corpus_copy(tmp: Path, fx: dict) -> Path:
    return Path(shutil.copytree(fx["corpus_dir"], tmp / "corpus"))


def _prepare(fx: dict, *sources: object, out: Path,
             extra: tuple[str, ...] = ("--overwrite",)) -> list[str]:
    return ["prepare", *map(str, sources), "--tokenizer", str(fx["tokenizer_dir"]), "--out",
            str(out), *extra]


def _store_copy(tmp: Path, fx: dict, damage: Callable[[Path], None]) -> Path:
    store = Path(shutil.copytree(fx["store_dir"], tmp / "store"))
    damage(store)
    return store


def _pretrain_on(fx: dict, store: Path, tmp: Path) -> list[str]:
    return ["pretrain", *_run_args(store, tmp / "run")]


def _run_copy(tmp: Path, fx: dict) -> Path:
    """A copy of the session's MLM run: a finished run, final checkpoint step-0000008."""
    return Path(shutil.copytree(fx["mlm_run"], tmp / "run"))


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _write_bad(tmp: Path, name: str, data: bytes) -> Path:
    path = tmp / "src" / name
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data)
    return path


def _evil_state(run: Path) -> Path:
    marker = run.parent / "PWNED"

    class Evil:
        def __reduce__(self):  # what a malicious pickle does on load: call anything
            return (Path.touch, (marker,))

    torch.save({"step": 8, "optimizer": Evil()},
               run / "checkpoints" / "step-0000008" / "training_state.pt")
    return marker


def _case_prepare_overwrite_user_folder(tmp, fx):
    folder = _user_folder(tmp)
    return (_prepare(fx, fx["corpus_dir"] / "a.txt", out=folder), [folder], "not a token store",
            "--overwrite")


def _case_prepare_out_is_source_dir(tmp, fx):
    corpus = _corpus_copy(tmp, fx)
    return _prepare(fx, corpus, out=corpus), [corpus], "overlaps the corpus source", None


def _case_prepare_out_inside_source(tmp, fx):
    corpus = _corpus_copy(tmp, fx)
    return _prepare(fx, corpus, out=corpus / "store"), [corpus], "overlaps the corpus source", None


def _case_prepare_out_holds_source_file(tmp, fx):
    corpus = _corpus_copy(tmp, fx)
    return _prepare(fx, corpus / "a.txt", out=corpus), [corpus], "overlaps the corpus source", None


def _case_prepare_out_holds_source_dir(tmp, fx):
    corpus = _corpus_copy(tmp, fx)
    return _prepare(fx, corpus, out=tmp), [corpus], "the corpus source", None


def _case_prepare_out_is_a_file(tmp, fx):
    path = tmp / "store"
    path.write_text("precious\n")
    return (_prepare(fx, fx["corpus_dir"] / "a.txt", out=path), [path], "existing file",
            "--overwrite")


def _case_prepare_store_with_user_files(tmp, fx):
    store = _store_copy(tmp, fx, lambda s: (s / "notes.txt").write_text("mine\n"))
    return _prepare(fx, fx["corpus_dir"] / "a.txt", out=store), [store], "notes.txt", "--overwrite"


def _case_prepare_foreign_meta(tmp, fx):
    folder = tmp / "other"
    folder.mkdir()
    (folder / "meta.json").write_text(json.dumps({"format": "someone-else"}))
    return (_prepare(fx, fx["corpus_dir"] / "a.txt", out=folder), [folder],
            "not an mlsm token store", "--overwrite")


def _case_prepare_other_inputs_no_overwrite(tmp, fx):
    store = _store_copy(tmp, fx, lambda s: None)
    return (_prepare(fx, fx["corpus_dir"] / "a.txt", out=store, extra=()), [store], "--overwrite",
            None)


def _case_prepare_torn_store_no_overwrite(tmp, fx):
    store = _store_copy(tmp, fx, lambda s: (s / "meta.json").write_text('{"format": "mlsm-tok'))
    return (_prepare(fx, fx["corpus_dir"] / "a.txt", out=store, extra=()), [store],
            "meta.json is unreadable", None)


def _case_prepare_locked(tmp, fx):
    out = tmp / "store"
    fx["hold"](out)
    return (_prepare(fx, fx["corpus_dir"] / "a.txt", out=out, extra=()), [],
            "is being written by", None)


def _case_source_corrupt_gz(tmp, fx):
    path = _write_bad(tmp, "bad.txt.gz", gzip.compress(b"hello world\n" * 200)[:10] + b"\xff" * 64)
    return _prepare(fx, path, out=tmp / "s", extra=()), [path], "bad.txt.gz", None


def _case_source_truncated_gz(tmp, fx):
    path = _write_bad(tmp, "cut.jsonl.gz", gzip.compress(b'{"text": "a b c"}\n' * 500)[:-40])
    return _prepare(fx, path, out=tmp / "s", extra=()), [path], "cut.jsonl.gz", None


def _case_source_not_utf8(tmp, fx):
    path = _write_bad(tmp, "latin.txt", "line one\n\nzweite Zeile\ncaf\u00e9\n".encode("latin-1"))
    return _prepare(fx, path, out=tmp / "s", extra=()), [path], "latin.txt:4", None


def _case_source_bad_jsonl(tmp, fx):
    path = _write_bad(tmp, "x.jsonl", b'{"text": "fine"}\n{"text": broken\n')
    return _prepare(fx, path, out=tmp / "s", extra=()), [path], "x.jsonl:2", None


def _case_source_binary(tmp, fx):
    path = _write_bad(tmp, "blob.txt", b"\x00\x01\x02" * 100)
    return _prepare(fx, path, out=tmp / "s", extra=()), [path], "blob.txt", None


def _case_store_truncated_tokens(tmp, fx):
    store = _store_copy(tmp, fx, lambda s: _truncate(s / "tokens.bin"))
    return _pretrain_on(fx, store, tmp), [store], "tokens.bin has", None


def _case_store_torn_meta(tmp, fx):
    store = _store_copy(tmp, fx, lambda s: _truncate(s / "meta.json"))
    return _pretrain_on(fx, store, tmp), [store], "meta.json is unreadable", None


def _case_store_missing_offsets(tmp, fx):
    store = _store_copy(tmp, fx, lambda s: (s / "offsets.bin").unlink())
    return _pretrain_on(fx, store, tmp), [store], "offsets.bin is missing", None


def _case_store_offsets_inconsistent(tmp, fx):
    def damage(s: Path) -> None:
        off = np.fromfile(s / "offsets.bin", dtype=np.int64)
        off[5] = off[-1] + 10  # same size, wrong contents
        off.tofile(s / "offsets.bin")
    store = _store_copy(tmp, fx, damage)
    return _pretrain_on(fx, store, tmp), [store], "offsets.bin does not match", None


def _case_run_out_holds_user_files(tmp, fx):
    folder = _user_folder(tmp)
    return (["pretrain", "--resume", "auto", *_run_args(fx["store_dir"], folder)], [folder],
            "not an mlsm run", None)


def _case_probe_out_user_folder(tmp, fx):
    folder = _user_folder(tmp)
    args = ["probe", str(fx["mlm_run"] / "checkpoints" / "step-0000008"), "--out", str(folder),
            "--resume"]
    return args, [folder, fx["mlm_run"]], "not an mlsm run", None


def _case_probe_torn_checkpoint_json(tmp, fx):
    run = _run_copy(tmp, fx)
    _truncate(run / "checkpoints" / "step-0000008" / "checkpoint.json")
    return (["probe", str(run / "checkpoints" / "step-0000008")], [run], "checkpoint.json is torn",
            None)


def _case_probe_corrupt_heads(tmp, fx):
    ckpt = Path(shutil.copytree(fx["mlsm_ckpt"], tmp / "ckpt"))
    heads = ckpt / "heads.safetensors"
    heads.write_bytes(b"\xff" * 8 + heads.read_bytes()[8:])  # a header length past the end
    args = ["probe", str(ckpt), "--out", str(tmp / "probe"), "--max-steps", "1"]
    return args, [ckpt], "heads.safetensors is missing or damaged", None


def _case_run_out_is_root(tmp, fx):
    return (["pretrain", *_run_args(fx["store_dir"], Path("/"))], [], "cannot be an output folder",
            None)


def _case_run_out_is_a_file(tmp, fx):
    path = tmp / "run"
    path.write_text("precious\n")
    return ["pretrain", *_run_args(fx["store_dir"], path)], [path], "existing file", None


def _case_run_killed_before_first_log(tmp, fx):
    run = _run_copy(tmp, fx)
    (run / "metrics.jsonl").unlink()  # checkpoints, config.yaml and run.json still count
    return (["pretrain", *_base_args(fx["store_dir"], run, **{"train.seed": 7})], [run],
            "already holds an mlsm run", None)


def _case_resume_other_seed(tmp, fx):
    run = _run_copy(tmp, fx)
    args = _base_args(fx["store_dir"], run, **{"train.seed": 7})
    return ["pretrain", "--resume", "auto", *args], [run], "train.seed", None


def _case_resume_no_checkpoint_other_config(tmp, fx):
    run = _run_copy(tmp, fx)
    shutil.rmtree(run / "checkpoints")  # only config.yaml tells what the run was
    args = _base_args(fx["store_dir"], run, **{"optim.lr": 0.5})
    return ["pretrain", "--resume", "auto", *args], [run], "optim.lr", None


def _case_resume_changed_model_size(tmp, fx):
    run = _run_copy(tmp, fx)
    bigger = ("{hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 2, "
              "intermediate_size: 64}")
    args = ["pretrain", "--resume", "auto",
            *_base_args(fx["store_dir"], run, **{"model.overrides": bigger})]
    return args, [run], "model.overrides", None


def _case_resume_unsafe_training_state(tmp, fx):
    run = _run_copy(tmp, fx)
    fx["marker"] = _evil_state(run)
    args = ["pretrain", "--resume", str(run / "checkpoints" / "step-0000008"),
            *_base_args(fx["store_dir"], run)]
    return args, [run], "not a safe checkpoint", "weights_only"


def _case_resume_named_torn_checkpoint(tmp, fx):
    run = _run_copy(tmp, fx)
    _truncate(run / "checkpoints" / "step-0000008" / "model.safetensors")
    args = ["pretrain", "--resume", str(run / "checkpoints" / "step-0000008"),
            *_base_args(fx["store_dir"], run)]
    return args, [run], "is damaged (model.safetensors is truncated", None


def _case_resume_all_checkpoints_torn(tmp, fx):
    run = _run_copy(tmp, fx)
    for _, folder in list_checkpoints(run):
        _truncate(folder / "training_state.pt")
    return (["pretrain", "--resume", "auto", *_base_args(fx["store_dir"], run)], [run],
            "no intact checkpoint", None)


def _case_run_locked(tmp, fx):
    run = _run_copy(tmp, fx)
    fx["hold"](run)
    return (["pretrain", "--resume", "auto", *_base_args(fx["store_dir"], run)], [run],
            "is being written by", None)


def _case_targets_out_user_folder(tmp, fx):
    folder = _user_folder(tmp)
    return fx["targets_cmd"](folder), [folder], "not a target store", None


def _case_targets_out_is_a_file(tmp, fx):
    path = tmp / "t"
    path.write_text("precious\n")
    return fx["targets_cmd"](path), [path], "existing file", None


def _case_targets_locked(tmp, fx):
    fx["hold"](tmp / "t")
    return fx["targets_cmd"](tmp / "t"), [], "is being written by", None


def _case_targets_damaged_in_training(tmp, fx):
    tgt = Path(shutil.copytree(fx["fresh_targets"], tmp / "t"))
    _truncate(tgt / "values.bin")
    args = ["pretrain",
            *_run_args(fx["store_dir"], tmp / "run",
                       **{"objective.name": "mlsm", "objective.targets": str(tgt)})]
    return args, [tgt], "is damaged", None


def _case_dictionary_out_foreign_safetensors(tmp, fx):
    path = tmp / "model.safetensors"
    save_file({"weight": torch.ones(3)}, path)
    args = ["dictionary", "--store", str(fx["store_dir"]), "--teacher", str(fx["teacher_dir"]),
            "--layer", "1", "--k", "16", "--n-vectors", "50", "--max-len", "32", "--out", str(path)]
    return args, [path], "not an mlsm dictionary", None


def _case_dictionary_out_foreign_json(tmp, fx):
    (tmp / "d.json").write_text('{"my": "settings"}\n')
    args = ["dictionary", "--store", str(fx["store_dir"]), "--teacher", str(fx["teacher_dir"]),
            "--layer", "1",
            "--k", "16", "--n-vectors", "50", "--max-len", "32", "--out", str(tmp / "d")]
    return args, [tmp / "d.json"], "not an mlsm dictionary", None


CASES = {name[len("_case_"):]: fn
         for name, fn in sorted(globals().items()) if name.startswith("_case_")}


class _Fixtures(dict):
    """Fixtures by name, set up only when a case asks (the teacher and dictionary cost seconds)."""

    def __init__(self, request: pytest.FixtureRequest) -> None:
        super().__init__()
        self.request = request

    def __missing__(self, name: str) -> object:
        self[name] = self.request.getfixturevalue(name)
        return self[name]


@pytest.fixture
def fx(request: pytest.FixtureRequest):
    held = []

    def hold(folder: Path) -> None:  # like another process: its own open file description
        path = locking.lock_path(folder)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.append((fd, path))

    found = _Fixtures(request)
    found["hold"] = hold
    yield found
    for fd, path in held:
        path.unlink()
        os.close(fd)


def test_case_count() -> None:
    assert len(CASES) >= 25


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_and_nothing_is_lost(name: str, fx: dict, tmp_path: Path,
                                                   capsys) -> None:
    args, protect, needle, forbidden = CASES[name](tmp_path, fx)
    before = {str(p): _tree(p) for p in protect}
    capsys.readouterr()
    line = _one_line_error(main(args), capsys.readouterr().err)
    check_hint_is_tried(name, line)
    assert needle in line, line
    assert forbidden is None or forbidden not in line, line
    assert {str(p): _tree(p) for p in protect} == before, "user files changed"
    assert "marker" not in fx or not fx["marker"].exists(), "foreign code ran"
    leftovers = [p.name for p in tmp_path.rglob("*")
                 if ".partial-" in p.name or p.name.endswith(".lock")]
    assert leftovers == [] or name.endswith("locked"), leftovers


# --------------------------------------------------------------------------- real processes


def test_prepare_overwrite_replaces_a_torn_store(corpus_dir: Path, tokenizer_dir: Path,
                                                 store_dir: Path, tmp_path: Path, capsys) -> None:
    store = Path(shutil.copytree(store_dir, tmp_path / "store"))
    (store / "meta.json").write_text("{")
    assert main(_prepare({"tokenizer_dir": tokenizer_dir}, corpus_dir / "a.txt", out=store)) == 0
    assert json.loads((store / "meta.json").read_text())["sources"] == [str(corpus_dir / "a.txt")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]  # no partial, old or lock left


def test_second_pretrain_on_a_locked_run_refuses(store_dir: Path, tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    args = _run_args(store_dir, run,
                     **{"train.steps": 2000, "train.save_every": 0, "train.log_every": 1})
    first = subprocess.Popen([sys.executable, "-m", "mlsm", "pretrain", *args], env=ENV,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    start = time.time()
    while not lock_held(run) and first.poll() is None and time.time() - start < 120:
        time.sleep(0.02)  # lock_held reads /proc/locks: looking never takes the lock
    assert lock_held(run), "the first run holds its lock from its start"
    capsys.readouterr()
    # a second one
    line = _one_line_error(main(["pretrain", "--resume", "auto", *args]), capsys.readouterr().err)
    assert f"is being written by pid {first.pid}" in line, line
    while (not (run / "metrics.jsonl").exists() and first.poll() is None
           and time.time() - start < 120):
        time.sleep(0.02)
    first.send_signal(signal.SIGTERM)  # the first one was undisturbed and ends cleanly
    out, err = first.communicate(timeout=300)
    assert first.returncode == 128 + signal.SIGTERM, err  # stopped with a checkpoint
    assert list_checkpoints(run) and not lock_held(run)
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1))


def _pretrain_until_logged(run: Path, args: list[str]) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "mlsm", "pretrain", *args], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    start = time.time()
    while not (run / "metrics.jsonl").exists() and proc.poll() is None:
        assert time.time() - start < 120, "no step logged in 120 s"
        time.sleep(0.02)
    assert proc.poll() is None, proc.communicate()[1]
    return proc


def test_ctrl_c_stops_pretraining_with_a_checkpoint_like_sigterm(store_dir: Path,
                                                                 tmp_path: Path) -> None:
    """SIGINT used to stop mid-step without a checkpoint (KeyboardInterrupt) while SIGTERM saved
    one; now both finish the step and save it (and exit 128 + the signal: 130)."""
    run = tmp_path / "run"
    args = _run_args(store_dir, run, **{"train.steps": 2000, "train.save_every": 0,
                                        "train.log_every": 1})
    first = _pretrain_until_logged(run, args)
    first.send_signal(signal.SIGINT)
    out, err = first.communicate(timeout=300)
    assert first.returncode == 128 + signal.SIGINT, err
    assert "Traceback" not in err and "stopped by signal" in out
    saved = list_checkpoints(run)
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert saved and saved[-1][0] == steps[-1] < 2000 and not lock_held(run)


def test_second_ctrl_c_aborts_at_once() -> None:
    """The first SIGINT asks for a stop after the step; the second raises KeyboardInterrupt at
    once. (In a subprocess: a regression must not interrupt the test session itself. Python keeps
    SIGINT ignored when its parent ignored it, as a shell does for a background job, so the child
    sets Python's usual handler first: the one the context must give back.)"""
    check = (
        "import os, signal, time\n"
        "from mlsm.train.signals import StopOnSignal\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "with StopOnSignal() as stopper:\n"
        "    os.kill(os.getpid(), signal.SIGINT); time.sleep(0.05)\n"
        "    assert stopper.flag\n"
        "    try:\n"
        "        os.kill(os.getpid(), signal.SIGINT); time.sleep(0.05)\n"
        "    except KeyboardInterrupt:\n"
        "        print('aborted')\n"
        "assert signal.getsignal(signal.SIGINT) is signal.default_int_handler\n"
    )
    proc = subprocess.run([sys.executable, "-c", check], env=ENV, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout == "aborted\n", proc.stderr


def test_kill_during_first_checkpoint_leaves_no_duplicate_metrics(store_dir: Path,
                                                                  tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = _run_args(store_dir, run, **{"train.log_every": 1})
    # SIGKILL this process once the first checkpoint is written but not yet renamed into place
    kill = ("import os, signal, sys; from mlsm import fileio as c; "
            "c.replace_dir = lambda tmp, target: os.kill(os.getpid(), signal.SIGKILL); "
            "from mlsm.cli import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", kill, "pretrain", *args], env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1]
    assert list_checkpoints(run) == []
    assert main(["pretrain", "--resume", "auto", *args]) == 0
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_torn_newest_checkpoint_falls_back_to_the_newest_intact(mlm_run: Path, store_dir: Path,
                                                                tmp_path: Path, capsys) -> None:
    run = Path(shutil.copytree(mlm_run, tmp_path / "run"))
    final = run / "checkpoints" / "step-0000008"
    reference = _tree(final / "model.safetensors")
    _truncate(final / "model.safetensors")
    capsys.readouterr()
    assert main(["pretrain", "--resume", "auto", *_base_args(store_dir, run)]) == 0
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("mlsm")]
    assert (len(err) == 1 and "resuming from step-0000004" in err[0]
            and "step-0000008" in err[0]), err
    assert _tree(final / "model.safetensors") == reference  # steps 5-8 redone bit-identically
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))


@pytest.mark.parametrize("error", [
    RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 0"),
    SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })"),
    OSError(28, "No space left on device")])
def test_disk_full_while_saving_is_one_line_and_keeps_checkpoints(error: Exception, store_dir: Path,
                                                                  tmp_path: Path, monkeypatch,
                                                                  capsys) -> None:
    real, calls = ckpt.save_model_folder, {"n": 0}

    def fail_second(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise error
        return real(*a, **k)

    monkeypatch.setattr(ckpt, "save_model_folder", fail_second)
    run = tmp_path / "run"
    capsys.readouterr()
    line = _one_line_error(main(["pretrain", *_run_args(store_dir, run)]), capsys.readouterr().err)
    assert ("could not write checkpoint step-0000002" in line
            and "older checkpoints are intact" in line)
    assert [s for s, _ in list_checkpoints(run)] == [1]
    verify(run / "checkpoints" / "step-0000001")  # whole
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]


def test_targets_resume_recomputes_deleted_or_truncated_data(fresh_targets: Path,
                                                             targets_cmd: Callable, tmp_path: Path,
                                                             capsys) -> None:
    ref = TargetStore.open(fresh_targets)
    # a complete store whose values.bin was deleted, and a killed build whose indices.bin was cut
    deleted = Path(shutil.copytree(fresh_targets, tmp_path / "deleted"))
    (deleted / "values.bin").unlink()
    cut = Path(shutil.copytree(fresh_targets, tmp_path / "cut"))
    (cut / "meta.json").unlink()
    with open(cut / "indices.bin", "r+b") as fh:
        fh.truncate(100)
    for out in (deleted, cut):
        assert main(targets_cmd(out)) == 0, capsys.readouterr().err
        got = TargetStore.open(out)
        for name in ("counts", "chunk_ptr", "indices", "values"):
            assert np.array_equal(getattr(got, name), getattr(ref, name)), name
        assert got.meta == ref.meta


# --------------------------------------------------------------------------- fileio


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_atomic_write_respects_the_umask(tmp_path: Path, mask: int) -> None:
    old = os.umask(mask)
    try:
        fileio.atomic_write_text(tmp_path / "a.txt", "x")
        fileio.atomic_write_json(tmp_path / "b.json", {"a": 1})
        folder = fileio.make_temp_dir(tmp_path / "store", "partial")
    finally:
        os.umask(old)
    assert (tmp_path / "a.txt").stat().st_mode & 0o777 == 0o666 & ~mask
    assert (tmp_path / "b.json").stat().st_mode & 0o777 == 0o666 & ~mask
    assert folder.stat().st_mode & 0o777 == 0o777 & ~mask


def test_checkpoint_files_get_the_umask_permissions(store_dir: Path, tmp_path: Path) -> None:
    """transformers' save_pretrained wrote model.safetensors 0600 inside the build folder, so a
    run's (or an export's) weights were private while every other file was shared (umask 022
    here, so 0600 cannot pass for it whatever the umask of the test process)."""
    old = os.umask(0o022)
    try:
        assert main(["pretrain", *_run_args(store_dir, tmp_path / "run",
                                            **{"train.steps": 1})]) == 0
    finally:
        os.umask(old)
    files = [p for p in (tmp_path / "run" / "checkpoints").rglob("*") if p.is_file()]
    assert "model.safetensors" in {p.name for p in files}
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in files}
    assert modes == dict.fromkeys(modes, "0o644")


def test_atomic_write_fsyncs_the_file_and_its_directory(tmp_path: Path, monkeypatch) -> None:
    synced, real = [], os.fsync

    def spy(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    fileio.atomic_write_text(tmp_path / "a.txt", "data")
    # the file, before the rename
    assert any(Path(p).name.startswith(".a.txt.") for p in synced), synced
    assert synced[-1] == str(tmp_path)  # the directory, after it
    assert (tmp_path / "a.txt").read_text() == "data"


def test_replace_dir_never_leaves_the_target_missing(tmp_path: Path) -> None:
    target, new = tmp_path / "store", tmp_path / ".store.partial"
    target.mkdir()
    (target / "old").write_text("old")
    new.mkdir()
    (new / "new").write_text("new")
    fileio.replace_dir(new, target)
    assert ([p.name for p in target.iterdir()] == ["new"]
            and sorted(p.name for p in tmp_path.iterdir()) == ["store"])


def test_text_sources_keep_their_documents(tmp_path: Path) -> None:
    from mlsm.data.corpus import iter_documents

    docs = make_text(3, seed=5)
    (tmp_path / "crlf.txt").write_bytes("\r\n\r\n".join(docs).encode())
    assert list(iter_documents([str(tmp_path / "crlf.txt")])) == docs


def test_targets_disk_full_is_one_line_and_the_rerun_completes(fresh_targets: Path,
                                                               targets_cmd: Callable,
                                                               tmp_path: Path, monkeypatch,
                                                               capsys) -> None:
    from mlsm.teacher import targets

    real, calls = targets.atomic_write_json, {"n": 0}

    def full_on_third(path, payload):  # build.json, progress 1, then the disk is full
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device")
        return real(path, payload)

    monkeypatch.setattr(targets, "atomic_write_json", full_on_third)
    out = tmp_path / "t"
    capsys.readouterr()
    hf_logging.disable_progress_bar()  # the teacher load's own bar is not this test's subject
    try:
        line = _one_line_error(main(targets_cmd(out)), capsys.readouterr().err)
    finally:
        hf_logging.enable_progress_bar()
    assert "No space left on device" in line and "re-run the same command" in line
    monkeypatch.setattr(targets, "atomic_write_json", real)
    assert main(targets_cmd(out)) == 0
    ref, got = TargetStore.open(fresh_targets), TargetStore.open(out)
    assert np.array_equal(got.indices, ref.indices) and np.array_equal(got.values, ref.values)


def test_sigterm_during_prepare_is_one_line_and_leaves_no_partial_build(
        tokenizer_dir: Path, tmp_path: Path) -> None:
    """SIGTERM (timeout, Slurm, kill) ended `prepare` silently with status 143 and left its
    hidden `.OUT.partial-*` build behind, which no later run removed. Now it unwinds like Ctrl-C:
    one line, nothing left; and a build folder a SIGKILL left is removed by the next prepare,
    which holds the store's lock."""
    corpus = tmp_path / "big.txt"
    corpus.write_text("\n\n".join(make_text(12000, seed=3)) + "\n")
    out = tmp_path / "st"
    proc = subprocess.Popen([sys.executable, "-m", "mlsm", "prepare", str(corpus), "--tokenizer",
                             str(tokenizer_dir), "--out", str(out), "--num-proc", "1"],
                            env=ENV, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not list(tmp_path.glob(".st.partial-*")) and proc.poll() is None:
        assert time.time() < deadline, "prepare never started its build"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=120)[1]
    if proc.returncode == 0:
        pytest.skip("prepare finished before the signal arrived")
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines() == [
        "mlsm prepare: stopped by SIGTERM; nothing was left half-written (a folder being built "
        "was removed): re-run the same command"], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.txt"]
    stale = tmp_path / ".st.partial-killed"
    stale.mkdir()
    (stale / "tokens.bin").write_bytes(b"\0" * 64)
    assert main(["prepare", str(corpus), "--tokenizer", str(tokenizer_dir), "--out", str(out),
                 "--num-proc", "1"]) == 0
    assert not stale.exists() and (out / "meta.json").is_file()
