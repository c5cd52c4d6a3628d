"""One output guard, one JSON-lines reader, one writer per output (issues #33, #34).

The guard's rules as a table over the verbs: each verb, run as a user runs it, refuses the same
situations the same way (a folder mlsm did not write, a file where a folder is wanted, a user's
file inside an output of its kind) and replaces or continues an output of its own kind (or, under
`Rule.NEW`, names the flag that continues it). Then the torn-line rule of the JSON-lines reader,
a dictionary whose two files come from two writes, and a second writer of one output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mlsm.artifacts.jsonl import append_jsonl, read_jsonl
from mlsm.artifacts.outputs import Rule, article, guard_output
from mlsm.cli import main
from mlsm.errors import UserError

SRC = Path(__file__).resolve().parents[1] / "src"
GUARD_PHRASES = ("exists and is not", "is an existing file", "not part of", "already holds")


def _cli(capsys: pytest.CaptureFixture, *args: object) -> str:
    """The one line `mlsm ARGS` printed on failure ('' when it succeeded)."""
    capsys.readouterr()
    rc = main([str(a) for a in args])
    err = capsys.readouterr().err.strip()
    if rc == 0:
        return ""
    assert len(err.splitlines()) == 1, err
    return err


def _lib(fn: Callable, *args: object, **kw: object) -> str:
    try:
        fn(*args, **kw)
    except UserError as exc:
        return str(exc)
    return ""


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _heading(name: str, text: str) -> Callable[[Path], None]:
    return lambda out: _write(out / name, text + "\n")


def _pretrain(out: Path, tmp: Path) -> str:
    from mlsm.run_config import config_from_dict
    from mlsm.train.loop import pretrain

    # a config naming a file as train.out is refused by the config check already
    return _lib(lambda: pretrain(config_from_dict({"train": {"out": str(out)},
                                                   "data": {"store": str(tmp / "none")}})))


def _kind_guard(module: str, name: str) -> Callable[[Path, Path], str]:
    def run(out: Path, tmp: Path) -> str:
        import importlib

        return _lib(guard_output, out, getattr(importlib.import_module(module), name))
    return run


# verb: (what it calls its output, how an output of its own is marked, how the verb is run,
#        whether it declares its file names, the rule it writes under)
def _verbs(capsys: pytest.CaptureFixture) -> dict[str, tuple]:
    def cli(*args: object) -> Callable[[Path, Path], str]:
        def run(out: Path, tmp: Path) -> str:
            text = tmp / "src.txt"
            for name in ("no-model", "no-store"):  # past the checks of `mlsm.cli.early`: the
                (tmp / name).mkdir(exist_ok=True)  # output guard is what is tested here
            if not text.exists():
                _write(text, "the cat sees a dog .\na bird sings .\n" * 20)
            return _cli(capsys, *[str(a).format(out=out, tmp=tmp, text=text) for a in args])
        return run

    return {
        "prepare": ("token store", _heading("meta.json", "{}"),
                    cli("prepare", "{text}", "--tokenizer", "{tmp}/no-tok", "--out", "{out}"),
                    True, Rule.SAME_KIND),
        "train-tokenizer": ("tokenizer", _heading("tokenizer_config.json", "{}"),
                            cli("train-tokenizer", "{text}", "--vocab-size", "60", "--out",
                                "{out}"), True, Rule.SAME_KIND),
        "targets": ("target store", _heading("build.json", "{}"),
                    cli("targets", "--store", "{tmp}/no-store", "--dictionary", "{tmp}/no-dict",
                        "--out", "{out}"), True, Rule.SAME_KIND),
        "blimp": ("BLiMP report", _heading("blimp.md", "# BLiMP (PLL)"),
                  cli("blimp", "{tmp}/no-model", "--data", "{tmp}/no-data", "--out", "{out}"),
                  True, Rule.SAME_KIND),
        "rank": ("rank report", _heading("rank.md", "# tau-effective rank per layer"),
                 cli("rank", "{tmp}/no-model", "--text", "{text}", "--out", "{out}"),
                 True, Rule.SAME_KIND),
        "compare": ("mlsm comparison", _heading("comparison.md", "# Fine-tuning comparison"),
                    cli("compare", "{tmp}/no.jsonl", "--out", "{out}"), True, Rule.SAME_KIND),
        "report": ("mlsm report", _heading("report.md", "# Fine-tuning report"),
                   cli("report", "{tmp}/no.jsonl", "--out", "{out}"), True, Rule.SAME_KIND),
        "export": ("mlsm export", _heading("mlsm.json", '{"format": "mlsm-export"}'),
                   _kind_guard("mlsm.integrations.export", "EXPORT_KIND"), False, Rule.SAME_KIND),
        "probe": ("mlsm probe run", _heading("probe.json", "{}"),
                  _kind_guard("mlsm.evaluate.probe.probe", "PROBE_KIND"), False, Rule.SAME_KIND),
        "pretrain": ("mlsm run", _heading("run.json", '{"started": "now"}'), _pretrain, False,
                     Rule.NEW),
    }


VERBS = ["prepare", "train-tokenizer", "targets", "blimp", "rank", "compare", "report", "export",
         "probe", "pretrain"]


@pytest.mark.parametrize("verb", VERBS)
def test_a_folder_mlsm_did_not_write_is_refused_alike(verb, tmp_path, capsys):
    what, _, run, _, _ = _verbs(capsys)[verb]
    out = tmp_path / "out"
    _write(out / "notes.txt", "mine\n")
    message = run(out, tmp_path)
    assert f"exists and is not {article(what)} {what} (it holds notes.txt)" in message
    assert (out / "notes.txt").read_text() == "mine\n" and os.listdir(out) == ["notes.txt"]


@pytest.mark.parametrize("verb", VERBS)
def test_a_file_where_a_folder_is_wanted_is_refused_alike(verb, tmp_path, capsys):
    _, _, run, _, _ = _verbs(capsys)[verb]
    out = tmp_path / "out"
    _write(out, "precious\n")
    message = run(out, tmp_path)
    assert "existing file" in message and "folder" in message
    assert out.read_text() == "precious\n"


@pytest.mark.parametrize("verb", [v for v in VERBS if v not in ("export", "probe", "pretrain")])
def test_a_users_file_inside_an_output_of_the_kind_is_refused_alike(verb, tmp_path, capsys):
    what, mark, run, declares_files, _ = _verbs(capsys)[verb]
    assert declares_files
    out = tmp_path / "out"
    mark(out)
    _write(out / "notes.txt", "mine\n")
    assert f"holds notes.txt, not part of {article(what)} {what}" in run(out, tmp_path)
    assert (out / "notes.txt").read_text() == "mine\n"


@pytest.mark.parametrize("verb", VERBS)
def test_an_output_of_the_kind_is_replaced_or_its_flag_named(verb, tmp_path, capsys):
    """SAME_KIND: the guard lets the verb go on (it fails later, on the missing model or data,
    or succeeds); NEW: one line naming the flag that continues it."""
    what, mark, run, _, rule = _verbs(capsys)[verb]
    out = tmp_path / "out"
    mark(out)
    message = run(out, tmp_path)
    if rule is Rule.NEW:
        assert f"already holds {article(what)} {what}; pass --resume auto" in message
    else:
        assert not any(p in message for p in GUARD_PHRASES), message


def test_the_replacing_verb_really_replaces(tmp_path, capsys):
    """train-tokenizer on a folder holding an earlier tokenizer: the folder now holds the new."""
    verbs = _verbs(capsys)
    out = tmp_path / "out"
    verbs["train-tokenizer"][1](out)
    assert verbs["train-tokenizer"][2](out, tmp_path) == ""
    assert json.loads((out / "tokenizer_config.json").read_text())  # not the "{}" marker


def test_a_name_with_a_line_break_stays_on_the_one_line(tmp_path):
    from mlsm.integrations.export import EXPORT_KIND

    _write(tmp_path / "out" / "a\nb.txt", "mine\n")
    message = _lib(guard_output, tmp_path / "out", EXPORT_KIND)
    assert "\n" not in message and "'a\\nb.txt'" in message


# --------------------------------------------------------------------------- dictionary files


def test_dictionary_output_files_are_guarded(tmp_path):
    from mlsm.teacher.dictionary import check_dictionary_out

    (tmp_path / "d.safetensors").mkdir()
    assert "is a folder; pass a file path" in _lib(check_dictionary_out, tmp_path / "d")
    _write(tmp_path / "e.json", "mine\n")
    assert "exists and is not an mlsm dictionary's meta" in _lib(check_dictionary_out,
                                                                   tmp_path / "e")


def test_a_dictionary_pair_from_two_writes_is_refused_even_with_equal_settings(tmp_path,
                                                                               monkeypatch):
    """A kill between the two renames leaves the new atoms beside the old meta. With the same
    settings every meta field agrees; the atoms' digest in both metas still tells them apart."""
    import mlsm.teacher.dictionary as dictionary

    meta = {"lam": 0.05, "layer": 12, "teacher": "t", "seconds": 1.0}
    first = dictionary.Dictionary(torch.eye(4, 6), dict(meta))
    second = dictionary.Dictionary(torch.eye(4, 6) * 2, dict(meta))
    path = tmp_path / "d.safetensors"
    dictionary.save_dictionary(first, path)
    assert torch.equal(dictionary.load_dictionary(path).atoms, first.atoms)
    real = dictionary.atomic_write

    def killed_before_the_meta(target, write):
        if str(target).endswith(".json"):
            raise KeyboardInterrupt  # the process dies between the two renames
        real(target, write)

    monkeypatch.setattr(dictionary, "atomic_write", killed_before_the_meta)
    with pytest.raises(KeyboardInterrupt):
        dictionary.save_dictionary(second, path)
    with pytest.raises(UserError, match="are of different dictionaries .*atoms_sha256"):
        dictionary.load_dictionary(path)


def test_a_meta_of_an_older_writer_beside_newer_atoms_is_refused(tmp_path, monkeypatch):
    """An older mlsm wrote the pair without a digest; a newer write killed before its meta
    leaves a header with one and a .json without: a key only one side has differs too."""
    from safetensors.torch import save_file

    import mlsm.teacher.dictionary as dictionary

    meta = {"format": dictionary.DICT_FORMAT, "lam": 0.05, "layer": 12, "d": 4, "k": 6}
    text = json.dumps(meta, sort_keys=True)
    path = tmp_path / "d.safetensors"
    save_file({"atoms": torch.eye(4, 6)}, str(path), metadata={"meta": text})
    path.with_suffix(".json").write_text(text)
    assert dictionary.load_dictionary(path).k == 6
    real = dictionary.atomic_write
    monkeypatch.setattr(dictionary, "atomic_write", lambda target, write: (
        _raise(KeyboardInterrupt()) if str(target).endswith(".json") else real(target, write)))
    with pytest.raises(KeyboardInterrupt):
        dictionary.save_dictionary(dictionary.Dictionary(torch.eye(4, 6), {"lam": 0.05,
                                                                          "layer": 12}), path)
    with pytest.raises(UserError, match="are of different dictionaries .*atoms_sha256"):
        dictionary.load_dictionary(path)


def _raise(exc: BaseException) -> None:
    raise exc


# --------------------------------------------------------------------------- JSON lines


def _lines(path: Path, *lines: str) -> Path:
    path.write_bytes("".join(line + "\n" for line in lines).encode())
    return path


def test_a_torn_last_line_is_skipped_and_named(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"a": 1}\n{"a": 2}\n{"a": 3, "b')  # killed mid-append
    told = []
    found = read_jsonl(path, "results file", "fix it", warn=told.append)
    assert [row for _, row in found.rows] == [{"a": 1}, {"a": 2}] and found.torn == [3]
    assert told == [f"{path}: skipped line 3, torn by a killed writer"]


def test_the_appender_closes_a_torn_tail_off_and_the_reader_skips_it_midfile(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"a": 1}\n{"a": 2, "b')
    append_jsonl(path, [{"a": 3}])
    assert path.read_text().splitlines() == ['{"a": 1}', '{"a": 2, "b', '{"a": 3}']
    found = read_jsonl(path, "results file", "fix it")
    assert [row["a"] for _, row in found.rows] == [1, 3] and found.torn == [2]


@pytest.mark.parametrize("bad", ["not json", '{"a": 1} trailing', "[1, 2", '"text"x'])
def test_a_malformed_middle_line_is_refused_with_file_and_line(tmp_path, bad):
    path = _lines(tmp_path / "r.jsonl", '{"a": 1}', bad, '{"a": 2}')
    with pytest.raises(UserError, match=rf"^{path}:2 is not JSON .*; fix it$"):
        read_jsonl(path, "results file", "fix it")


def test_a_file_with_no_row_is_not_the_kind(tmp_path):
    path = _lines(tmp_path / "notes.jsonl", "my notes", "more notes")
    with pytest.raises(UserError, match="is not a results file"):
        read_jsonl(path, "results file", "fix it")


def test_binary_line_is_refused_with_file_and_line(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_bytes(b'{"a": 1}\n\xff\xfe\n')
    with pytest.raises(UserError, match=rf"^{path}:2 is not UTF-8"):
        read_jsonl(path, "results file", "fix it")


@pytest.mark.parametrize("reader", ["results", "readouts"])
def test_every_jsonl_reader_keeps_the_rule(tmp_path, reader):
    """The results and readouts readers both skip a torn line and refuse a malformed one."""
    from mlsm.artifacts.results_file import read_results
    from mlsm.evaluate.readouts import plot_rows

    row = {"model": "m", "value": 0.5, "task": "rte", "metric": "acc", "seed": 0, "lr": 1e-4,
           "epochs": 1, "batch_size": 8, "max_len": 64, "n_train": 10, "kind": "probe"}
    read = read_results if reader == "results" else plot_rows
    path = _lines(tmp_path / "r.jsonl", json.dumps(row), '{"model": "m", "va')
    read(path)  # the torn line is skipped
    _lines(path, json.dumps(row), "garbage", json.dumps(row))
    with pytest.raises(UserError, match=rf"{path}:2 is not JSON"):
        read(path)


# --------------------------------------------------------------------------- one writer


@pytest.fixture
def hold_lock():
    """Hold the lock of a path in another process (as a running mlsm would)."""
    holders = []

    def hold(path: Path) -> None:
        code = ("import sys, time\nfrom mlsm.locking import hold\n"
                "with hold(sys.argv[1], 'output'):\n    print('held', flush=True)\n"
                "    time.sleep(120)\n")
        proc = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE,
                                env={**os.environ, "PYTHONPATH": str(SRC)}, text=True)
        holders.append(proc)
        assert proc.stdout.readline().strip() == "held"

    yield hold
    for proc in holders:
        proc.kill()
        proc.wait()


def _second_writer(capsys, args: list) -> str:
    message = _cli(capsys, *args)
    assert "is being written by pid" in message and "choose another output" in message
    return message


def test_a_second_readout_on_one_output_refuses_and_adds_no_row(tmp_path, capsys, hold_lock):
    out = tmp_path / "readouts"
    out.mkdir()
    _lines(out / "readouts.jsonl", '{"kind": "probe"}')
    before = (out / "readouts.jsonl").read_bytes()
    hold_lock(out / "readouts.jsonl")
    (tmp_path / "no-model").mkdir()  # past `mlsm.cli.early`: the lock is what is tested
    _second_writer(capsys, ["readout", tmp_path / "no-model", "--out", out, "--kinds", "masked"])
    assert (out / "readouts.jsonl").read_bytes() == before


@pytest.mark.parametrize("held", ["out", "results"])
def test_a_second_score_on_one_output_refuses(tmp_path, capsys, hold_lock, held):
    text = tmp_path / "s.txt"
    text.write_text("a cat .\n")
    paths = {"out": tmp_path / "scores.jsonl", "results": tmp_path / "results.jsonl"}
    paths["results"].write_text("")
    hold_lock(paths[held])
    (tmp_path / "no-model").mkdir()  # past `mlsm.cli.early`: the lock is what is tested
    _second_writer(capsys, ["score", tmp_path / "no-model", text, "--out", paths["out"],
                            "--results", paths["results"]])
    assert not paths["out"].exists() and paths["results"].read_text() == ""


@pytest.mark.parametrize("verb", ["blimp", "rank", "train-tokenizer", "compare", "report"])
def test_a_second_writer_of_a_folder_refuses(verb, tmp_path, capsys, hold_lock):
    _, _, run, _, _ = _verbs(capsys)[verb]
    out = tmp_path / "out"
    hold_lock(out)
    assert "is being written by pid" in run(out, tmp_path)
    assert not out.exists() or not os.listdir(out)
