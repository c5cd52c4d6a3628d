"""Bad input at the edges: one line on stderr (exit 2), never a traceback; foreign code never runs.

Table-driven. Pure argument and config cases call `mlsm.cli.main` in process (fast); the
foreign-code cases and a representative subset run the real CLI in a subprocess with "y" on
stdin (what a user answering transformers' "run custom code? [y/N]" prompt would type).
docs/reliability.md maps each guarantee to its test here.
"""

from __future__ import annotations

import ast
import gzip
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mlsm import cli

SRC = Path(__file__).resolve().parents[1] / "src"
TINY = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
        "intermediate_size": 32}


def run_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", "mlsm", *args], cwd=cwd, env=env,
                          input="y\ny\ny\n", capture_output=True, text=True, timeout=300)


def assert_one_line(code: int, err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2, (code, err)
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    assert lines[0].startswith("mlsm "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def main_err(capsys: pytest.CaptureFixture, args: list[str]) -> tuple[int, str]:
    """Run the CLI in process; argparse's own exits are turned into their exit code."""
    capsys.readouterr()  # drop what fixtures printed
    try:
        code = cli.main(args)
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


# --------------------------------------------------------------------------- fixtures


def model_folder(path: Path, tokenizer_dir: Path, mlm: bool = True) -> Path:
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM, BertModel

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.save_pretrained(path)
    cls = BertForMaskedLM if mlm else BertModel
    torch.manual_seed(0)
    cls(BertConfig(vocab_size=len(tok), **TINY)).save_pretrained(path)
    return path


def make_evil(folder: Path, marker: Path, where: str) -> Path:
    """A model folder whose config (or tokenizer config) points at a .py that writes `marker`."""
    (folder / "evil.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('foreign code ran')\n"
        "from transformers import BertConfig, BertModel, BertForMaskedLM, BertTokenizerFast\n"
        "class EvilConfig(BertConfig):\n    model_type = 'evilbert'\n"
        "class EvilModel(BertModel):\n    config_class = EvilConfig\n"
        "class EvilMLM(BertForMaskedLM):\n    config_class = EvilConfig\n"
        "class EvilTokenizer(BertTokenizerFast):\n    pass\n")
    name = "tokenizer_config.json" if where == "tokenizer" else "config.json"
    data = json.loads((folder / name).read_text())
    if where == "tokenizer":
        data["auto_map"] = {"AutoTokenizer": [None, "evil.EvilTokenizer"]}
        data["tokenizer_class"] = "EvilTokenizer"
    else:
        data["model_type"] = "evilbert"
        data["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModel": "evil.EvilModel",
                            "AutoModelForMaskedLM": "evil.EvilMLM"}
    (folder / name).write_text(json.dumps(data))
    return folder


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path,
        store_dir: Path) -> dict[str, Path]:
    """Model folders, good and hostile, plus inputs for the verbs that read them."""
    root = tmp_path_factory.mktemp("zoo")
    z = {"root": root, "store": store_dir, "marker": root / "MARKER"}
    z["good"] = model_folder(root / "good", tokenizer_dir)
    for where in ("config", "tokenizer"):
        z[f"evil_{where}"] = make_evil(model_folder(root / f"evil_{where}", tokenizer_dir),
                                       z["marker"], where)
    z["foreign_type"] = model_folder(root / "foreign_type", tokenizer_dir)
    cfg = json.loads((z["foreign_type"] / "config.json").read_text())
    (z["foreign_type"] / "config.json").write_text(json.dumps({**cfg, "model_type": "evilbert"}))
    z["no_weights"] = model_folder(root / "no_weights", tokenizer_dir)
    (z["no_weights"] / "model.safetensors").unlink()
    z["torn"] = model_folder(root / "torn", tokenizer_dir)
    (z["torn"] / "config.json").write_text((z["torn"] / "config.json").read_text()[:40])
    z["pickle"] = model_folder(root / "pickle", tokenizer_dir)
    (z["pickle"] / "model.safetensors").unlink()
    torch.save({"x": _Pwn(str(z["marker"]))}, z["pickle"] / "pytorch_model.bin")
    (root / "text.txt").write_text("the cat sees a dog .\nthe dog sees a cat .\n")
    blimp = root / "blimp"
    blimp.mkdir()
    (blimp / "toy.jsonl").write_text(json.dumps({"sentence_good": "the cat sees .",
                                                 "sentence_bad": "the cat see ."}) + "\n")
    bad_gz = root / "blimp_gz"
    bad_gz.mkdir()
    raw = gzip.compress(b'{"sentence_good": "a b", "sentence_bad": "b a"}\n' * 50)
    # zlib.error: invalid distance code
    (bad_gz / "toy.jsonl.gz").write_bytes(raw[:12] + b"\xff" * 40 + raw[52:])
    z["blimp"], z["blimp_gz"] = blimp, bad_gz
    (root / "afile").write_text("precious\n")
    z["afile"] = root / "afile"
    (root / "glue" / "RTE").mkdir(parents=True)
    for split in ("train", "dev"):
        rows = ["index\tsentence1\tsentence2\tlabel"]
        rows += [f"{i}\tthe cat sees .\ta cat .\tentailment" for i in range(4)]
        (root / "glue" / "RTE" / f"{split}.tsv").write_text("\n".join(rows) + "\n")
    z["glue"] = root / "glue"
    return z


class _Pwn:
    """A pickle that runs code when loaded (writes the marker)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "pickle ran"))


# --------------------------------------------------------------------------- nobody in


FOREIGN = {  # verb -> command line loading the hostile folder `{m}`
    "prepare --tokenizer": ["prepare", "{text}", "--tokenizer", "{m}", "--out", "{out}"],
    "blimp": ["blimp", "{m}", "--data", "{blimp}", "--out", "{out}"],
    "pretrain objective.teacher (kd)": ["pretrain", "data.store={store}", "train.out={out}",
                                        "train.steps=2",
                                        "objective.name=kd", "objective.teacher={m}"],
    "pretrain model.init_from": ["pretrain", "data.store={store}", "train.out={out}",
                                 "train.steps=2", "model.init_from={m}"],
    "pretrain model.config": ["pretrain", "data.store={store}", "train.out={out}", "train.steps=2",
                              "model.config={m}"],
    "dictionary --teacher": ["dictionary", "--store", "{store}", "--teacher", "{m}", "--out",
                             "{out}/d.safetensors"],
    "targets --teacher": ["targets", "--store", "{store}", "--dictionary", "{m}/nosuch",
                          "--teacher", "{m}", "--out", "{out}"],
    "rank": ["rank", "{m}", "--text", "{text}", "--out", "{out}"],
    "flops --teacher": ["flops", "--teacher", "{m}"],
    "finetune": ["finetune", "{m}", "--tasks", "rte", "--data-dir", "{glue}", "--results",
                 "{out}/r.jsonl"],
}
FOREIGN_SUBPROCESS = [("prepare --tokenizer", "tokenizer"), ("blimp", "config"),
                      ("pretrain objective.teacher (kd)", "config")]


def _foreign_args(zoo: dict, case: str, m: Path, out: Path) -> list[str]:
    return [a.format(m=m, text=zoo["root"] / "text.txt", out=out, blimp=zoo["blimp"],
                     store=zoo["store"], glue=zoo["glue"]) for a in FOREIGN[case]]


@pytest.mark.parametrize("case, where", FOREIGN_SUBPROCESS)
def test_foreign_code_never_runs_cli(zoo, tmp_path, case, where):
    """The real CLI, "y" on stdin: refused in one line, no prompt, the folder's Python never
    runs."""
    proc = run_cli(_foreign_args(zoo, case, zoo[f"evil_{where}"], tmp_path / "out"), tmp_path)
    assert_one_line(proc.returncode, proc.stderr, "auto_map")
    assert not zoo["marker"].exists(), "the folder's Python ran"
    assert "[y/N]" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("where", ["config", "tokenizer"])
@pytest.mark.parametrize("case", list(FOREIGN))
def test_foreign_code_never_runs_any_verb(zoo, tmp_path, case, where, capsys, monkeypatch):
    """Every verb that reads a model folder, in process (same code path, no interpreter
    start-up)."""
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n" * 10))
    (tmp_path / "out").mkdir()
    code, err = main_err(capsys, _foreign_args(zoo, case, zoo[f"evil_{where}"], tmp_path / "out"))
    # the dictionary is read first: refused for lack of it, before the teacher
    if case == "targets --teacher":
        assert code == 2 and "Traceback" not in err, err
    else:
        assert_one_line(code, err, "auto_map")
    assert not zoo["marker"].exists(), "the folder's Python ran"


def _loaders(good: Path) -> dict:
    """Every function of mlsm that loads an HF folder, as path -> result."""
    from transformers import AutoModelForMaskedLM

    from mlsm.config import ModelConfig
    from mlsm.data.corpus import load_tokenizer as corpus_tokenizer
    from mlsm.evaluate.finetune.finetune import _load_backbone
    from mlsm.evaluate.finetune.task_cell import load_tokenizer as finetune_tokenizer
    from mlsm.evaluate.finetune.tasks import get_task
    from mlsm.evaluate.probe.probe import load_scorer
    from mlsm.evaluate.zeroshot.pll import load_masked_lm
    from mlsm.evaluate.zeroshot.rank import load_encoder
    from mlsm.hf import load_config, load_model, load_tokenizer
    from mlsm.models.backbone import _from_scratch_config, build_student
    from mlsm.objectives.kd import has_mlm_head
    from mlsm.objectives.mlsm_naive import load_full_teacher
    from mlsm.teacher.teacher import load_teacher
    from mlsm.train.flops import teacher_shape_config

    tok = corpus_tokenizer(str(good))
    return {
        "corpus.load_tokenizer": corpus_tokenizer,
        "finetune.load_tokenizer": lambda p: finetune_tokenizer(str(p), get_task("rte")),
        "finetune._load_backbone": lambda p: _load_backbone(str(p)),
        "flops.teacher_shape_config": lambda p: teacher_shape_config(str(p)),
        "pll.load_masked_lm": lambda p: load_masked_lm(str(p)),
        "probe.load_scorer": load_scorer,
        "rank.load_encoder": lambda p: load_encoder(str(p)),
        "backbone.build_student(init_from)":
            lambda p: build_student(ModelConfig(init_from=str(p)), tok, 16, 0),
        "backbone model.config":
            lambda p: _from_scratch_config(ModelConfig(config=str(p)), tok, 16),
        "kd.has_mlm_head": lambda p: has_mlm_head(str(p)),
        "mlsm_naive.load_full_teacher": lambda p: load_full_teacher(str(p)),
        "teacher.load_teacher": lambda p: load_teacher(p, 1),
        "hf.load_config": load_config,
        "hf.load_tokenizer": load_tokenizer,
        "hf.load_model": lambda p: load_model(AutoModelForMaskedLM, p),
    }


LOADERS = ["corpus.load_tokenizer", "finetune.load_tokenizer", "finetune._load_backbone",
           "flops.teacher_shape_config", "pll.load_masked_lm", "probe.load_scorer",
           "rank.load_encoder", "backbone.build_student(init_from)", "backbone model.config",
           "kd.has_mlm_head", "mlsm_naive.load_full_teacher", "teacher.load_teacher",
           "hf.load_config", "hf.load_tokenizer", "hf.load_model"]
# loaders that read only config.json / the tokenizer: a folder with bad or no weights is fine
# for them
CONFIG_ONLY = {"corpus.load_tokenizer", "finetune.load_tokenizer", "flops.teacher_shape_config",
               "backbone model.config", "kd.has_mlm_head", "hf.load_config", "hf.load_tokenizer"}
HOSTILE = {"evil_config": "auto_map", "evil_tokenizer": "auto_map", "foreign_type": "evilbert",
           "torn": "config.json", "no_weights": "no weights", "pickle": "not a safe checkpoint"}


def test_loader_table_is_complete(zoo):
    assert sorted(_loaders(zoo["good"])) == sorted(LOADERS)


@pytest.mark.parametrize("folder", list(HOSTILE))
@pytest.mark.parametrize("loader", LOADERS)
def test_every_loader_refuses_hostile_folders(zoo, loader, folder, monkeypatch):
    from mlsm.errors import UserError

    monkeypatch.setattr("sys.stdin", io.StringIO("y\n" * 10))  # a prompt would read "y"
    load = _loaders(zoo["good"])[loader]
    if folder in ("no_weights", "pickle") and loader in CONFIG_ONLY:
        load(zoo[folder])
    else:
        with pytest.raises(UserError) as info:
            load(zoo[folder])
        text = str(info.value)
        assert "\n" not in text and "weights_only=False" not in text, text
        assert HOSTILE[folder] in text, text
    assert not zoo["marker"].exists(), "the folder's code or pickle ran"


@pytest.mark.parametrize("loader", LOADERS)
def test_good_folder_still_loads(zoo, loader):
    assert _loaders(zoo["good"])[loader](zoo["good"]) is not None or loader == "kd.has_mlm_head"


def _unsafe_calls(tree: ast.AST) -> list[ast.Call]:
    """Calls of `*.from_pretrained`, `torch.load` without weights_only=True, `pickle.load(s)`."""
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        name, owner = node.func.attr, node.func.value
        owner_name = owner.id if isinstance(owner, ast.Name) else ""
        safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant)
                   and k.value.value is True for k in node.keywords)
        if name == "from_pretrained" or (owner_name == "torch" and name == "load" and not safe) or \
                (owner_name == "pickle" and name in ("load", "loads")):
            found.append(node)
    return found


def test_no_from_pretrained_outside_the_one_door():
    """Every HF load in src/ goes through mlsm.hf (so trust_remote_code=False holds everywhere).
    Calls are found in the syntax tree, so example code inside strings (model cards) is fine."""
    offenders = []
    for path in SRC.rglob("*.py"):
        if path.name == "hf.py":
            continue
        calls = _unsafe_calls(ast.parse(path.read_text()))
        offenders += [f"{path.relative_to(SRC)}:{c.lineno}" for c in calls]
    assert not offenders, offenders
    # the scan itself sees a call, and not a string
    tree = ast.parse("AutoModel.from_pretrained(p)\ntorch.load(f)\nx = 'm.from_pretrained(p)'")
    assert len(_unsafe_calls(tree)) == 2


def test_unsafe_checkpoint_cli(zoo, tmp_path):
    proc = run_cli(["blimp", str(zoo["pickle"]), "--data", str(zoo["blimp"]), "--out",
                    str(tmp_path / "o")], tmp_path)
    assert_one_line(proc.returncode, proc.stderr, "not a safe checkpoint")
    assert "weights_only=False" not in proc.stderr
    assert not zoo["marker"].exists()


@pytest.mark.parametrize("folder, needle", [("no_weights", "no weights"), ("torn", "config.json"),
                                            ("foreign_type", "evilbert"),
                                            ("pickle", "not a safe checkpoint")])
def test_broken_model_folder_is_one_line(zoo, tmp_path, folder, needle, capsys):
    code, err = main_err(capsys, ["rank", str(zoo[folder]), "--text", str(zoo["root"] / "text.txt"),
                                  "--out", str(tmp_path / "o")])
    assert_one_line(code, err, needle)


# --------------------------------------------------------------------------- one line: arguments


ARG_CASES = {
    "finetune --lrs abc": (["finetune", "m", "--tasks", "rte", "--lrs", "abc"], "--lrs"),
    "finetune --lrs empty": (["finetune", "m", "--tasks", "rte", "--lrs", ","], "--lrs"),
    "finetune --lrs negative": (["finetune", "m", "--tasks", "rte", "--lrs", "1e-5,-2e-5"],
                                "--lrs"),
    "finetune --epochs 0": (["finetune", "m", "--tasks", "rte", "--epochs", "0"], "--epochs"),
    "finetune --max-train-examples 0": (["finetune", "m", "--tasks", "rte", "--max-train-examples",
                                         "0"], "--max-train-examples"),
    "finetune --batch-size 0": (["finetune", "m", "--tasks", "rte", "--batch-size", "0"],
                                "--batch-size"),
    "finetune --seeds 0": (["finetune", "m", "--tasks", "rte", "--seeds", "0"], "--seeds"),
    "finetune --warmup-ratio 2": (["finetune", "m", "--tasks", "rte", "--warmup-ratio", "2"],
                                  "--warmup-ratio"),
    "finetune --device gpu": (["finetune", "m", "--tasks", "rte", "--device", "gpu"], "--device"),
    "finetune --results DIR": (["finetune", "m", "--tasks", "rte", "--results", "{dir}"],
                               "--results"),
    "finetune --report-to unknown": (
        ["finetune", "m", "--tasks", "rte", "--report-to", "neptune"], "--report-to"),
    "dictionary --batch-size 0": (["dictionary", "--store", "s", "--out", "d", "--batch-size", "0"],
                                  "--batch-size"),
    "dictionary --k -3": (["dictionary", "--store", "s", "--out", "d", "--k", "-3"], "--k"),
    "dictionary --lam nan": (["dictionary", "--store", "s", "--out", "d", "--lam", "nan"], "--lam"),
    "dictionary --out DIR": (["dictionary", "--store", "s", "--out", "{dir}"], "--out"),
    "prepare --out FILE": (["prepare", "x.txt", "--tokenizer", "t", "--out", "{file}"], "--out"),
    "prepare --num-proc 0": (["prepare", "x.txt", "--tokenizer", "t", "--out", "o", "--num-proc",
                              "0"], "--num-proc"),
    "prepare --num-proc two": (["prepare", "x.txt", "--tokenizer", "t", "--out", "o",
                                "--num-proc", "two"], "--num-proc"),
    "train-tokenizer --vocab-size 0": (["train-tokenizer", "x.txt", "--out", "t", "--vocab-size",
                                        "0"], "--vocab-size"),
    "blimp --out FILE": (["blimp", "m", "--out", "{file}"], "--out"),
    "blimp --limit -1": (["blimp", "m", "--out", "o", "--limit", "-1"], "--limit"),
    "blimp --variant unknown": (["blimp", "m", "--out", "o", "--variant", "l2r"], "--variant"),
    "readout --kinds unknown": (["readout", "m", "--out", "o", "--kinds", "probe,bogus"],
                                "--kinds"),
    "readout --pppl-batches -1": (["readout", "m", "--out", "o", "--pppl-batches", "-1"],
                                  "--pppl-batches"),
    "readout --max-len 4": (["readout", "m", "--out", "o", "--max-len", "4"], "--max-len"),
    "probe --steps -1": (["probe", "ckpt", "--steps", "-1"], "--steps"),
    "rank --tau 0": (["rank", "m", "--text", "t", "--out", "o", "--tau", "0"], "--tau"),
    "rank --mask-rate 1": (["rank", "m", "--text", "t", "--out", "o", "--mask-rate", "1"],
                           "--mask-rate"),
    "targets --nnz 0": (["targets", "--store", "s", "--dictionary", "d", "--out", "o", "--nnz",
                         "0"], "--nnz"),
    "targets --out FILE": (["targets", "--store", "s", "--dictionary", "d", "--out", "{file}"],
                           "--out"),
    "compare --out FILE": (["compare", "r.jsonl", "--out", "{file}"], "--out"),
    "report --out FILE": (["report", "r.jsonl", "--out", "{file}"], "--out"),
    "demo --steps 0": (["demo", "--steps", "0"], "--steps"),
    "probe --out FILE": (["probe", "ckpt", "--out", "{file}"], "--out"),
    "flops --k 0": (["flops", "--k", "0"], "--k"),
    "probe --max-steps 0": (["probe", "ckpt", "--max-steps", "0"], "--max-steps"),
    "export --out FILE": (["export", "ckpt", "--out", "{file}"], "--out"),
    "export not a checkpoint": (["export", "{dir}", "--out", "{dir}/x"], "checkpoint"),
    "study missing file": (["study", "{dir}/nosuch.yaml"], "nosuch.yaml"),
    "study file is a folder": (["study", "{dir}"], "is a folder"),
    "unknown flag": (["compare", "r.jsonl", "--nosuch"], "--nosuch"),
}


@pytest.mark.parametrize("case", list(ARG_CASES))
def test_bad_argument_is_one_line(case, capsys, tmp_path):
    args, needle = ARG_CASES[case]
    (tmp_path / "afile").write_text("precious\n")
    args = [a.format(dir=tmp_path, file=tmp_path / "afile") for a in args]
    code, err = main_err(capsys, args)
    assert_one_line(code, err, needle)
    assert (tmp_path / "afile").read_text() == "precious\n"


# The study's own evaluation subprocess (`python -m mlsm.study.job FILE STAGE ARM [POINT [HEAD]]`):
# a user who copies its command line from a log gets the same one line as from any verb.
JOB_CASES = {
    "no arguments": ([], "usage: python -m mlsm.study.job"),
    "unknown stage": (["{record}", "pretrain", "m"], "unknown stage 'pretrain'"),
    "missing file": (["{dir}/nope.json", "blimp", "m"], "nope.json"),
    "torn JSON": (["{torn}", "blimp", "m"], "torn or not JSON"),
    "a JSON list": (["{listed}", "blimp", "m"], "must hold a JSON"),
    "not a study record": (["{file}", "blimp", "m"], "is not a study record"),
    "unknown arm": (["{record}", "blimp", "zz"], "unknown arm 'zz'"),
    "unknown point": (["{record}", "blimp", "m", "30%"], "readiness point '30%' is not one"),
    "a point for fine-tuning": (["{record}", "finetune", "m", "100%"], "drop '100%'"),
    "six arguments": (["{record}", "probe", "m", "100%", "vocab", "x"],
                      "[POINT [HEAD]] (got 6 arguments)"),
    "a head for BLiMP": (["{record}", "blimp", "m", "100%", "latent"], "(stage 'blimp')"),
    "unknown head": (["{record}", "probe", "m", "100%", "x"], "HEAD 'x' names one probe"),
}


@pytest.mark.parametrize("case", list(JOB_CASES))
def test_bad_study_job_argument_is_one_line(case, capsys, tmp_path):
    from mlsm.study import job
    from mlsm.study.spec import spec_record, study_from_dict

    spec = study_from_dict({"name": "j", "out": str(tmp_path / "study"),
                            "arms": {"m": {"objective": {"name": "mlm"}}}})
    files = {"record": json.dumps(spec_record(spec)), "torn": '{"name": "j", "ou',
             "listed": "[1, 2]", "file": '{"precious": true}\n'}
    for name, text in files.items():
        (tmp_path / f"{name}.json").write_text(text)
    args = [a.format(dir=tmp_path, **{n: tmp_path / f"{n}.json" for n in files})
            for a in JOB_CASES[case][0]]
    capsys.readouterr()
    code = job.main(args)
    assert_one_line(code, capsys.readouterr().err, JOB_CASES[case][1])
    for name, text in files.items():  # nothing written over or deleted
        assert (tmp_path / f"{name}.json").read_text() == text


# --------------------------------------------------------------------------- one line: configs


CONFIG_CASES = {  # overrides (or YAML text under "yaml") -> a phrase of the message
    "YAML syntax error": ({"yaml": "train:\n  steps: [1\n"}, "line 3"),
    "YAML not a mapping (list)": ({"yaml": "- train\n- steps\n"}, "mapping"),
    "YAML not a mapping (scalar)": ({"yaml": "mlm\n"}, "mapping"),
    "YAML not UTF-8": ({"yaml": b"train:\n  out: \xff\xfe\n"}, "UTF-8"),
    "YAML group is a scalar": ({"yaml": "train: 5\n"}, "train must be a mapping"),
    "scalar for a group": (["objective=mlm"], "objective.name=mlm"),
    "scalar for a group (data)": (["data=5"], "data must be a mapping"),
    "unknown group": (["trian.steps=5"], "unknown config group"),
    "unknown key": (["train.stepz=5"], "train.stepz"),
    "wrong type": (["train.steps=abc"], "train.steps"),
    "wrong list element type": (["data.mask_split=[a,b,c]"], "data.mask_split[0]"),
    "train.steps=0": (["train.steps=0"], "train.steps must be positive"),
    "train.steps negative": (["train.steps=-5"], "train.steps must be positive"),
    "train.batch_size=0": (["train.batch_size=0"], "train.batch_size"),
    "micro batch > batch": (["train.batch_size=4", "train.micro_batch_size=8"], "micro_batch_size"),
    "heads do not divide hidden": (["model.overrides.hidden_size=100",
                                    "model.overrides.num_attention_heads=3"], "divisible"),
    "hidden_size=0": (["model.overrides.hidden_size=0"], "hidden_size"),
    "train.out is a file": (["train.out={file}"], "train.out"),
    "optim.lr negative": (["optim.lr=-1e-4"], "optim.lr"),
    "optim.schedule unknown": (["optim.schedule=cosine"], "linear or wsd"),
    "data.mask_rate > 1": (["data.mask_rate=1.5"], "data.mask_rate"),
    "data.mask_split sum": (["data.mask_split=[0.5,0.4]"], "data.mask_split"),
    "train.precision": (["train.precision=fp8"], "train.precision"),
    "train.device": (["train.device=gpu"], "train.device"),
    "train.report_to unknown": (["train.report_to=[neptune]"], "train.report_to"),
    "train.peak_flops negative": (["train.peak_flops=-1"], "train.peak_flops"),
    "objective.name unknown": (["objective.name=nosuch"], "objective.name"),
    "objective unknown key": (["objective.name=kd", "objective.temprature=2"],
                              "objective.temprature"),
    "objective option range": (["objective.name=kd", "objective.temperature=0"],
                               "objective.temperature"),
    "override not key=value": (["steps"], "group.key=value"),
    "override conflicts": (["train.steps=5", "train.steps.x=1"], "conflicts"),
    "override value not YAML": (["optim.lr=:"], "not valid YAML"),
    "config file missing": ({"path": "nosuch.yaml"}, "nosuch.yaml"),
}


@pytest.mark.parametrize("case, verb", [(c, "pretrain") for c in CONFIG_CASES] + [
    (c, "flops")
    for c in ("YAML syntax error", "scalar for a group", "train.steps=0", "unknown key")])
def test_bad_config_is_one_line(case, verb, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec, needle = CONFIG_CASES[case]
    (tmp_path / "afile").write_text("precious\n")
    args = [verb]
    if isinstance(spec, dict):
        path = tmp_path / spec.get("path", "recipe.yaml")
        if "yaml" in spec:
            text = spec["yaml"]
            path.write_bytes(text if isinstance(text, bytes) else text.encode())
        args += ["--config", str(path)]
        if case == "YAML syntax error":
            needle = f"{path}"  # the file is named too
    else:
        args += [a.format(file=tmp_path / "afile") for a in spec]
    code, err = main_err(capsys, args)
    assert_one_line(code, err, needle)
    assert (tmp_path / "afile").read_text() == "precious\n"


def test_yaml_error_names_file_and_line(capsys, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  steps: 5\n  out: [x\n")
    code, err = main_err(capsys, ["pretrain", "--config", str(recipe)])
    assert_one_line(code, err, str(recipe), "line 4")


# --------------------------------------------------------------------------- results files


def _rows(values: dict[tuple[str, int], object]) -> str:
    return "".join(json.dumps({"model": m, "task": "rte", "metric": "accuracy", "seed": s,
                               "lr": 2e-5, "epochs": 3,
                               "batch_size": 32, "max_len": 128, "n_train": 100, "value": v}) + "\n"
                   for (m, s), v in values.items())


def test_compare_skips_non_numeric_values_and_warns_once(capsys, tmp_path):
    import math

    values = {("a", 0): 0.7, ("a", 1): 0.8, ("b", 0): 0.6, ("b", 1): 0.65, ("a", 2): float("nan"),
              ("b", 2): None, ("a", 3): "0.9x", ("b", 3): True,
              ("a", 4): 1e308, ("b", 4): -1e300}  # finite, but a mean overflows to inf
    results = tmp_path / "r.jsonl"
    results.write_text(_rows(values).replace("NaN", "NaN"))
    code, err = main_err(capsys, ["compare", str(results), "--out", str(tmp_path / "cmp")])
    assert code == 0, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "skipped 6 of 10" in lines[0], err
    from mlsm.evaluate.compare.stats import compare_runs

    cmp = compare_runs(results)
    assert all(math.isfinite(v) for v in cmp.mean.ravel())
    assert cmp.mean[cmp.models.index("a"), 0] == pytest.approx(0.75)


def test_results_not_utf8_names_file_and_line(capsys, tmp_path):
    results = tmp_path / "r.jsonl"
    results.write_bytes(_rows({("a", 0): 0.7}).encode() + b'{"model": "\xff\xfe"}\n')
    for verb in (["compare", str(results)],
                 ["report", str(results), "--out", str(tmp_path / "rep")]):
        code, err = main_err(capsys, verb)
        assert_one_line(code, err, f"{results}:2")


def test_report_unknown_baseline_lists_models(capsys, tmp_path):
    results = tmp_path / "r.jsonl"
    results.write_text(_rows({("mlm", 0): 0.7, ("mlsm", 0): 0.8, ("mlm", 1): 0.6,
                              ("mlsm", 1): 0.9}))
    code, err = main_err(capsys,
                         ["report", str(results), "--out", str(tmp_path / "rep"), "--baseline",
                          "NOSUCH"])
    assert_one_line(code, err, "NOSUCH", "mlm, mlsm")
    assert not (tmp_path / "rep").exists()


# --------------------------------------------------------------------------- verbs with inputs


def test_dictionary_more_atoms_than_vectors(zoo, tmp_path, capsys):
    teacher = model_folder(tmp_path / "teacher", zoo["store"] / "tokenizer", mlm=False)
    out = tmp_path / "d.safetensors"
    code, err = main_err(capsys,
                         ["dictionary", "--store", str(zoo["store"]), "--teacher", str(teacher),
                          "--layer", "1",
                                  "--k", "64", "--n-vectors", "3", "--out", str(out)])
    assert_one_line(code, err, "--n-vectors 3", "64 atoms")
    assert not out.exists()


def test_blimp_corrupt_gz_names_the_file(zoo, tmp_path, capsys):
    code, err = main_err(capsys,
                         ["blimp", str(zoo["good"]), "--data", str(zoo["blimp_gz"]), "--out",
                          str(tmp_path / "o")])
    assert_one_line(code, err, "toy.jsonl.gz")


def test_blimp_out_file_refused_before_loading(zoo, tmp_path):
    (tmp_path / "afile").write_text("precious\n")
    proc = run_cli(["blimp", str(zoo["good"]), "--data", str(zoo["blimp"]), "--out",
                    str(tmp_path / "afile")], tmp_path)
    assert_one_line(proc.returncode, proc.stderr, "--out")
    assert (tmp_path / "afile").read_text() == "precious\n"


def test_bad_arguments_cli(tmp_path):
    """The real CLI: argument errors are one line before anything heavy is imported."""
    for args, needle in (ARG_CASES["finetune --lrs abc"], ARG_CASES["finetune --epochs 0"],
                         ARG_CASES["unknown flag"]):
        proc = run_cli(args, tmp_path)
        assert_one_line(proc.returncode, proc.stderr, needle)


# ------------------------------------------------------------- overrides anywhere, bugs stay loud


@pytest.mark.parametrize("argv", [
    ["probe", "ckpt", "optim.lr=1e-3", "--steps", "5", "train.seed=3"],
    ["probe", "--steps", "5", "optim.lr=1e-3", "ckpt", "train.seed=3"],
    ["probe", "ckpt", "--resume", "optim.lr=1e-3", "--steps", "5", "train.seed=3"],
])
def test_probe_overrides_anywhere(argv, monkeypatch):
    seen = {}

    def fake_probe_run(checkpoint, **kw):
        seen.update(kw, checkpoint=checkpoint)
        return Path("run"), None

    monkeypatch.setattr("mlsm.evaluate.probe.probe.probe_run", fake_probe_run)
    monkeypatch.setattr("mlsm.cli.early.mlsm_checkpoint", lambda *a: None)  # "ckpt" is a name
    assert cli.main(argv) == 0
    assert seen["checkpoint"] == "ckpt" and seen["steps"] == 5
    assert seen["overrides"] == ["optim.lr=1e-3", "train.seed=3"]


def test_probe_help_says_where_overrides_go(capsys):
    assert cli.main(["probe", "--help"]) == 0
    assert "anywhere on the command line" in capsys.readouterr().out


def test_unexpected_bug_keeps_its_traceback(capsys, tmp_path, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("an invariant broke")

    monkeypatch.setattr("mlsm.evaluate.compare.stats.compare_runs", broken)
    code, err = main_err(capsys, ["compare", str(tmp_path / "r.jsonl")])
    assert code == 1
    assert "Traceback" in err and "an invariant broke" in err
    assert "please report it" in err.strip().splitlines()[-1]
