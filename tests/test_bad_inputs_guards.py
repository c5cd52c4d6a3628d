"""Guards by class (issue 34): one writer per output, artifacts that are one unit, exit statuses
that tell the truth, bounded inputs, the model loader's last gaps, and the smaller cases.

The table cases assert what the other hostile-input tables assert: exit 2, one line on stderr
naming the problem, no traceback, the user's files byte-for-byte intact. The lock tests run real
`python -m mlsm` subprocesses; a study whose arm fails is run through the real CLI (exit 1).
"""

from __future__ import annotations

import gzip
import json
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlsm.cli import build_parser, main
from mlsm.errors import UserError

from .helpers import lock_held
from .test_bad_inputs_classes import (
    GOOD_PAIR,
    ROW,
    _blimp_dir,
    _copy,
    _dictionary,
    _edit_json,
    _finetune,
    _glue,
    _model_with,
    _study,
    _targets,
    _write,
)
from .test_bad_inputs_data import (  # noqa: F401  (fixtures, shared with the data table)
    ENV,
    _one_line_error,
    _run_args,
    _tree,
    fx,
)

# --------------------------------------------------------------------------- the table
# (class, verb) -> case(tmp, fix) -> (argv, paths that must stay intact, text of the error line)


def _locks_study_folder_being_written(tmp, fix):
    """Two `mlsm study` on one folder both ran: stages done twice, result rows duplicated."""
    study = _study(tmp, fix, "arms: {a: {objective: {name: mlm}}}\n")
    fix["hold"](tmp / "study")
    return ["study", str(study)], [study], f"study folder {tmp / 'study'} is being written by"


def _locks_finetune_results_being_written(tmp, fix):
    """The same grid twice at once appended every cell twice."""
    results = _write(tmp / "res.jsonl", json.dumps({**ROW, "model": "m", "seed": 0,
                                                    "value": 0.5}) + "\n")
    fix["hold"](results)
    return (_finetune(fix, tmp, _glue(tmp), results=results), [results],
            f"results file {results} is being written by")


def _locks_dictionary_out_being_written(tmp, fix):
    """Two `mlsm dictionary --out D` at once: atoms of one beside the meta of the other."""
    fix["hold"](tmp / "d.safetensors")
    return (_dictionary(fix, tmp / "d.safetensors"), [fix["store_dir"]],
            f"dictionary {tmp / 'd.safetensors'} is being written by")


def _ran_study(tmp: Path, fix: dict) -> Path:
    """A study file whose folder a study has written (its record; nothing evaluated yet)."""
    study = _study(tmp, fix, "arms: {a: {objective: {name: mlm}}}\n")
    _write(tmp / "study" / "study.json", "{}\n")
    return study


def _report_to(study: Path, dest: Path) -> list[str]:
    return ["study", "report", str(study), "--to", str(dest)]


def _locks_study_report_to_being_written(tmp, fix):
    """Two publications into one folder at once would mix their reports and rows."""
    study = _ran_study(tmp, fix)
    fix["hold"](tmp / "pub")
    return (_report_to(study, tmp / "pub"), [tmp / "study"],
            f"published study report {tmp / 'pub'} is being written by")


def _unit_targets_dictionary_meta_of_another_write(tmp, fix):
    """A kill between the two writes (or two writers) left the .json of another learning run
    beside the weights; `targets` built codes from the pair, exit 0."""
    weights = Path(shutil.copy(fix["dictionary_path"], tmp / "d.safetensors"))
    meta = _edit_json(Path(shutil.copy(fix["dictionary_path"].with_suffix(".json"),
                                       tmp / "d.json")), seconds=12.5, seed=7)
    return (_targets(fix, tmp / "t", **{"--dictionary": str(weights)}), [weights, meta],
            "are of different dictionaries (seconds, seed differ")


def _huge_line_gz(path: Path, mib: int) -> Path:
    """A .jsonl.gz whose second line is one `mib` MiB document (a few hundred KB compressed),
    written in 1 MiB pieces so the test never holds it whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    piece = b"a" * (1 << 20)
    with gzip.open(path, "wb", compresslevel=1) as fh:
        fh.write(b'{"text": "a short first document ."}\n{"text": "')
        for _ in range(mib):
            fh.write(piece)
        fh.write(b'"}\n')
    return path


def _bounded_prepare_gzip_of_one_huge_line(tmp, fix):
    """A 285 KB gzip holding one 200 MB line took 8.5 GB and aborted in the tokenizer."""
    source = _huge_line_gz(tmp / "src" / "big.jsonl.gz", 50)
    return (["prepare", str(source), "--tokenizer", str(fix["tokenizer_dir"]), "--out",
             str(tmp / "store"), "--max-doc-bytes", "1000000"], [source],
            "big.jsonl.gz:2: a line is longer than 1,000,000 bytes (--max-doc-bytes)")


def _bounded_train_tokenizer_text_without_blank_line(tmp, fix):
    """A text document of many short lines and no blank line is one document to tokenise."""
    source = _write(tmp / "src" / "one.txt", "the cat sees a dog .\n" * 200_000)  # 4.2 MB
    return (["train-tokenizer", str(source), "--out", str(tmp / "tok"), "--max-doc-bytes",
             "100000"], [source], "a document (no blank line) is longer than 100,000 bytes")


def _bounded_blimp_sentence_too_long(tmp, fix):
    """A 100 MB "sentence" took gigabytes in the tokenizer before its length was checked."""
    data = _blimp_dir(tmp, json.dumps({"sentence_good": "the cat sees . " * 40,
                                       "sentence_bad": "cat the sees ."}))
    return (["blimp", str(fix["teacher_dir"]), "--data", str(data), "--out", str(tmp / "b"),
             "--max-sentence-chars", "100"], [data],
            "has 600 characters, more than the limit of 100 (--max-sentence-chars)")


def _bounded_pretrain_model_size_from_overrides(tmp, fix):
    """20,000 layers of 4096 were built (minutes, then out of memory) before any check."""
    return (["pretrain", *_run_args(fix["store_dir"], tmp / "run"),
             "model.overrides={hidden_size: 4096, num_hidden_layers: 20000, "
             "num_attention_heads: 2, intermediate_size: 16384}"], [],
            "more than model.max_params = 20,000,000,000")


def _bounded_pretrain_model_size_lowered_limit(tmp, fix):
    return (["pretrain", *_run_args(fix["store_dir"], tmp / "run"), "model.max_params=1000"], [],
            "more than model.max_params = 1,000; check its sizes, or raise model.max_params")


def _bounded_dictionary_n_vectors_beyond_memory(tmp, fix):
    """--n-vectors 2000000000 collected teacher states for minutes before any check."""
    args = _dictionary(fix, tmp / "d.safetensors")
    args[args.index("--n-vectors") + 1] = "2000000000"
    return args, [fix["store_dir"]], "--n-vectors 2,000,000,000 needs about"


def _loader_finetune_max_len_beyond_positions(tmp, fix):
    """Inputs longer than the model's positions were found only after training (at evaluation);
    now once tokenised, before any training."""
    long = " ".join(["the cat sees a dog ."] * 150)  # 900 words
    glue = _glue(tmp, train="index\tsentence1\tsentence2\tlabel\n"
                 f"0\t{long}\ta cat .\tentailment\n1\tthe cat .\ta cat .\tentailment\n")
    args = _finetune(fix, tmp, glue)
    args[args.index("--max-len") + 1] = "600"
    return (args, [fix["teacher_dir"], glue],
            "--max-len 600 lets inputs of 600 tokens through, which is longer than the 512 "
            "positions")


def _loader_pretrain_init_from_max_len_beyond_positions(tmp, fix):
    return (["pretrain", *_run_args(fix["store_dir"], tmp / "run", **{
        "model.init_from": str(fix["teacher_dir"]), "data.max_len": 1000})],
            [fix["teacher_dir"]], "data.max_len 1000 is longer than the 512 positions")


def _loader_blimp_model_safetensors_truncated(tmp, fix):
    """SafetensorError was not among the errors the loader turned into one line."""
    model = _copy(fix["teacher_dir"], tmp / "model")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    data = _blimp_dir(tmp, GOOD_PAIR)
    return (["blimp", str(model), "--data", str(data), "--out", str(tmp / "b")], [model],
            "model.safetensors is damaged or not a safetensors file")


def _loader_rank_model_safetensors_header_lies(tmp, fix):
    """A header whose shapes claim more bytes than the file holds."""
    model = _copy(fix["teacher_dir"], tmp / "model")
    weights = model / "model.safetensors"
    raw = weights.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [s * 1000 for s in header[name]["shape"]]
    text = json.dumps(header).encode()
    weights.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    sentences = _write(tmp / "x.txt", "the cat sees a dog .\n")
    return (["rank", str(model), "--text", str(sentences), "--out", str(tmp / "r")], [model],
            "model.safetensors is damaged or not a safetensors file")


def _loader_finetune_config_claims_20000_layers(tmp, fix):
    """A config.json claiming 20,000 layers built for a minute before it was refused."""
    model = _model_with(tmp, fix, num_hidden_layers=20000)
    return (_finetune(fix, tmp, _glue(tmp), model=model), [model],
            "its config.json describes a model of about")


def _loader_blimp_tokenizer_with_more_ids_than_embeddings(tmp, fix):
    """A tokenizer with more ids than the model has embeddings: an index error mid-scoring."""
    model = _copy(fix["teacher_dir"], tmp / "model")
    tok = json.loads((model / "tokenizer.json").read_text())
    tok["added_tokens"].append({"id": 5000, "content": "[NEW]", "single_word": False,
                                "lstrip": False, "rstrip": False, "normalized": False,
                                "special": True})
    _write(model / "tokenizer.json", json.dumps(tok))
    data = _blimp_dir(tmp, GOOD_PAIR)
    return (["blimp", str(model), "--data", str(data), "--out", str(tmp / "b")], [model],
            "its tokenizer has 5,001 ids but the model only")


def _smaller_blimp_jsonl_and_gz_of_one_phenomenon(tmp, fix):
    """Both were read: every pair of the phenomenon counted twice."""
    data = _blimp_dir(tmp, GOOD_PAIR)
    with gzip.open(data / "toy.jsonl.gz", "wt") as fh:
        fh.write(GOOD_PAIR + "\n")
    return (["blimp", str(fix["teacher_dir"]), "--data", str(data), "--out", str(tmp / "b")],
            [data], "holds both toy.jsonl and toy.jsonl.gz")


def _smaller_finetune_model_name_with_a_bar(tmp, fix):
    """finetune wrote the name; compare then refused the whole results file."""
    return (_finetune(fix, tmp, _glue(tmp), model=f"a|b={fix['teacher_dir']}"), [],
            "model name 'a|b' holds a line break, a control character or '|'")


def _smaller_targets_missing_dictionary_names_a_command_that_runs(tmp, fix):
    """The fix suggested `mlsm dictionary --out D`, which fails: --store is required."""
    return (_targets(fix, tmp / "t", **{"--dictionary": str(tmp / "none.safetensors")}), [],
            f"learn one with `mlsm dictionary --store STORE --out {tmp / 'none.safetensors'}`")


def _smaller_study_report_to_an_existing_file(tmp, fix):
    study, dest = _ran_study(tmp, fix), _write(tmp / "notes.md", "precious\n")
    return _report_to(study, dest), [dest, tmp / "study"], f"--to {dest} is an existing file"


def _smaller_study_report_to_a_folder_of_the_users(tmp, fix):
    """A folder holding only names the publication writes (metrics/), but not written by it:
    clearing the publication's names there would delete the user's files."""
    study = _ran_study(tmp, fix)
    dest = _write(tmp / "mine" / "metrics" / "run.jsonl", '{"step": 1}\n').parent.parent
    return (_report_to(study, dest), [dest, tmp / "study"],
            f"--to {dest} exists and is not a published study report")


def _smaller_study_report_to_inside_the_study_folder(tmp, fix):
    study = _ran_study(tmp, fix)
    return (_report_to(study, tmp / "study" / "pub"), [tmp / "study"],
            f"--to {tmp / 'study' / 'pub'} is inside the study folder")


def _smaller_study_report_to_above_the_study_folder(tmp, fix):
    study = _ran_study(tmp, fix)
    return (_report_to(study, tmp), [tmp / "study", study],
            f"--to {tmp} is a folder above the study folder")


def _smaller_study_report_to_before_the_study_ran(tmp, fix):
    study = _study(tmp, fix, "arms: {a: {objective: {name: mlm}}}\n")
    return _report_to(study, tmp / "pub"), [study], "holds no study yet (no study.json)"


def _smaller_study_to_without_report(tmp, fix):
    study = _ran_study(tmp, fix)
    return (["study", str(study), "--to", str(tmp / "pub")], [tmp / "study"],
            "--to writes a report only")


CASES = {name[1:]: fn for name, fn in sorted(globals().items())
         if name.startswith(("_locks_", "_unit_", "_bounded_", "_loader_", "_smaller_"))}


@pytest.mark.parametrize("name", list(CASES))
def test_guarded_input_is_one_line_and_nothing_is_lost(name: str, fx: dict,  # noqa: F811
                                                       tmp_path: Path, capsys) -> None:
    args, protect, needle = CASES[name](tmp_path, fx)
    before = {str(p): _tree(p) for p in protect}
    capsys.readouterr()
    line = _one_line_error(main(args), capsys.readouterr().err)
    assert needle in line, line
    assert {str(p): _tree(p) for p in protect} == before, "user files changed"


def test_every_class_has_cases_on_several_verbs() -> None:
    for kind in ("locks", "bounded", "loader", "smaller"):
        verbs = {name.split("_")[1] for name in CASES if name.startswith(kind)}
        assert len(verbs) >= 3, (kind, verbs)


# --------------------------------------------------------------------------- suggested commands


def _suggestions(tmp: Path, fix: dict) -> list[str]:
    """The error lines of mlsm's readers that suggest a command, each made to happen."""
    from mlsm.data.corpus import TokenStore
    from mlsm.teacher.dictionary import load_dictionary
    from mlsm.teacher.targets import TargetStore

    torn = _write(tmp / "torn.safetensors", b"not a safetensors file")
    (tmp / "no_meta").mkdir()
    made = []
    for call in (lambda: load_dictionary(tmp / "none.safetensors"), lambda: load_dictionary(torn),
                 lambda: TargetStore.open(tmp / "no_meta"), lambda: TokenStore.open(tmp / "nope"),
                 lambda: TokenStore.open(tmp / "no_meta")):
        with pytest.raises(UserError) as info:
            call()
        made.append(str(info.value))
    return made


def test_every_suggested_command_parses(fx: dict, tmp_path: Path) -> None:  # noqa: F811
    """Each command an error suggests, its placeholders filled in, is one the CLI accepts (the
    dictionary and target-store ones lacked a required flag)."""
    parser, _ = build_parser()
    fill = {"STORE": str(fx["store_dir"]), "DICT": str(fx["dictionary_path"]),
            "SOURCES": str(fx["corpus_dir"]), "TOK": str(fx["tokenizer_dir"])}
    for message in _suggestions(tmp_path, fx):
        command = message.split("`")[1]
        words = [fill.get(w, w) for w in command.split()]
        assert words[0] == "mlsm", message
        try:
            parser.parse_args(words[1:])
        except SystemExit:
            pytest.fail(f"the suggested command does not parse: {command}")


# --------------------------------------------------------------------------- one writer, real


def _tiny_study(tmp: Path, fix: dict, steps: int, arms: str) -> Path:
    from .helpers import TINY_MODEL

    model = ", ".join(f"{k}: {v}" for k, v in TINY_MODEL.items())
    return _write(tmp / "s.yaml", (
        f"out: {tmp / 'study'}\n"
        f"corpus: {{sources: [{fix['corpus_dir']}], tokenizer: {fix['tokenizer_dir']}}}\n"
        f"base: {{data: {{max_len: 32}}, model: {{overrides: {{{model}}}}}, "
        f"train: {{steps: {steps}, batch_size: 4, log_every: 1, device: cpu}}}}\n"
        f"readiness: [1.0]\nexecutor: {{kind: local, threads: 1}}\narms: {arms}\n"))


def _wait_for_lock(proc: subprocess.Popen, path: Path) -> None:
    start = time.time()
    while not lock_held(path) and proc.poll() is None and time.time() - start < 180:
        time.sleep(0.02)  # lock_held reads /proc/locks: looking never takes the lock
    assert lock_held(path), f"the first command holds the lock of {path} from its start"


def test_second_study_on_one_folder_refuses_naming_the_first(fx: dict, tmp_path: Path,  # noqa: F811
                                                             capsys) -> None:
    """Two `mlsm study` on one study folder both ran (stages twice, duplicated rows): the second
    now refuses at once, naming the first's pid, and the first goes on undisturbed."""
    study = _tiny_study(tmp_path, fx, 3000, "{a: {objective: {name: mlm}}}")
    first = subprocess.Popen([sys.executable, "-m", "mlsm", "study", str(study), "--stages",
                              "store", "pretrain"], env=ENV, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_lock(first, tmp_path / "study")
        capsys.readouterr()
        line = _one_line_error(main(["study", str(study)]), capsys.readouterr().err)
        assert f"study folder {tmp_path / 'study'} is being written by pid {first.pid}" in line
        assert "run the arms of both in one command (--arms" in line  # the fix for a piece
        assert first.poll() is None, "the first study was disturbed"
        # undisturbed: it goes on to pre-train
        metrics = tmp_path / "study" / "runs" / "a" / "metrics.jsonl"
        start = time.time()
        while not metrics.is_file() and first.poll() is None and time.time() - start < 240:
            time.sleep(0.1)
        assert metrics.is_file(), "the first study did not go on to pre-train"
    finally:
        first.terminate()
        first.communicate(timeout=300)


def test_second_finetune_grid_on_one_results_file_refuses(fx: dict, tmp_path: Path,  # noqa: F811
                                                          capsys) -> None:
    """The same grid run twice at once on one results file appended every cell twice: the
    second refuses while the first holds the file, and the file ends with each cell once."""
    results = tmp_path / "res.jsonl"
    args = [*_finetune(fx, tmp_path, _glue(tmp_path), results=results)]
    args[args.index("--seeds") + 1] = "4"
    args[args.index("--epochs") + 1] = "4"
    first = subprocess.Popen([sys.executable, "-m", "mlsm", *args], env=ENV,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_lock(first, results)
    capsys.readouterr()
    line = _one_line_error(main(args), capsys.readouterr().err)
    assert f"results file {results} is being written by pid {first.pid}" in line
    _, err = first.communicate(timeout=600)
    assert first.returncode == 0, err
    cells = [(r["model"], r["task"], r["seed"], r["metric"])
             for r in map(json.loads, results.read_text().splitlines())]
    assert len(cells) == len(set(cells)) == 4 * len({c[3] for c in cells})


# --------------------------------------------------------------------------- one unit


def test_dictionary_killed_between_its_two_writes_is_refused(tmp_path: Path,
                                                             monkeypatch) -> None:
    """A new dictionary's weights written, then a kill before its .json: the old meta beside
    the new atoms loaded as one dictionary (same k), and `targets` built codes from it."""
    import torch

    from mlsm.teacher import dictionary as dm

    def learned(seed: int) -> dm.Dictionary:
        atoms = torch.nn.functional.normalize(torch.randn(8, 16, generator=torch.Generator()
                                                          .manual_seed(seed)), dim=0)
        return dm.Dictionary(atoms, {"lam": 0.05, "layer": 1, "seed": seed, "seconds": seed})

    path = tmp_path / "d.safetensors"
    dm.save_dictionary(learned(0), path)
    real = dm.atomic_write

    def killed(target, write):  # noqa: ANN001
        if str(target).endswith(".json"):
            raise KeyboardInterrupt  # the process dies between the two files
        return real(target, write)

    monkeypatch.setattr(dm, "atomic_write", killed)
    with pytest.raises(KeyboardInterrupt):
        dm.save_dictionary(learned(1), path)
    with pytest.raises(UserError, match="are of different dictionaries"):
        dm.load_dictionary(path)
    monkeypatch.setattr(dm, "atomic_write", real)
    dm.save_dictionary(learned(1), path)  # re-running the command repairs it
    assert dm.load_dictionary(path).meta["seed"] == 1
    (tmp_path / "d.json").unlink()  # the weights alone carry their meta
    assert dm.load_dictionary(path).meta["seed"] == 1


# --------------------------------------------------------------------------- exit status


def test_study_with_a_failed_arm_exits_1_naming_it(fx: dict, tmp_path: Path,  # noqa: F811
                                                   capsys) -> None:
    """A study whose arm failed printed FAILED on stdout and exited 0: no script or scheduler
    could see it. The other arm still finishes; the last stderr line names the failed stage."""
    study = _tiny_study(tmp_path, fx, 2, "{good: {objective: {name: mlm}}, "
                                         "bad: {objective: {name: mlsm}}}")
    capsys.readouterr()
    rc = main(["study", str(study), "--stages", "store", "pretrain"])
    out, err = capsys.readouterr()
    assert rc == 1, err
    assert "pretrain:bad: FAILED" in out and "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("mlsm study: error: 1 stage of study") and "pretrain:bad" in line
    assert "status.json" in line and "errors.log" in line
    assert (tmp_path / "study" / "runs" / "good" / "checkpoints" / "step-0000002").is_dir()


# --------------------------------------------------------------------------- export, compare


def test_export_ships_only_the_files_it_knows(fx: dict, tmp_path: Path,  # noqa: F811
                                              capsys) -> None:
    """A pickle and a .py found in a checkpoint were copied into the folder for publication."""
    ckpt = _copy(fx["mlsm_ckpt"], tmp_path / "ckpt")
    _write(ckpt / "evil.py", "import os\n")
    _write(ckpt / "notes.pkl", b"\x80\x04K\x01.")
    capsys.readouterr()
    assert main(["export", str(ckpt), "--out", str(tmp_path / "e")]) == 0
    err = capsys.readouterr().err
    shipped = {p.name for p in (tmp_path / "e").iterdir()}
    assert not shipped & {"evil.py", "notes.pkl", "training_state.pt", "checkpoint.json"}
    assert {"config.json", "model.safetensors", "tokenizer.json", "heads.json"} <= shipped
    assert "left out of the export: evil.py, notes.pkl" in err


def test_compare_averages_only_the_tasks_every_model_has(tmp_path: Path, capsys) -> None:
    """Model b lacks CoLA: its "avg" was over RTE alone, a's over RTE and CoLA, without a word."""
    rows = [{**ROW, "model": m, "task": t, "metric": "accuracy", "seed": s,
             "value": {"rte": 0.6, "cola": 0.2}[t] + 0.01 * s}
            for m, tasks in (("a", ("rte", "cola")), ("b", ("rte",)))
            for t in tasks for s in range(3)]
    results = _write(tmp_path / "r.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    assert main(["compare", str(results)]) == 0
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "b lacks cola accuracy" in err
    table = out.split("\n\n")[1].splitlines()
    assert "avg (1 common)" in table[0]
    a_avg = next(r for r in table if r.startswith("| a ")).split("|")[-2].strip()
    assert a_avg == "61.00"  # a's RTE mean alone, like b's
