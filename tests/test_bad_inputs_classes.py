"""Hostile inputs by class x entry point: the table of `test_bad_inputs_data.py`, extended.

Each case is one class of hostile input (file content, values, consistency between inputs,
paths and state) tried on one verb; every one ran into a traceback, a silent acceptance or a
lost file before the input helpers of `mlsm.inputs` were used at the edges. The fifth class,
reuse, is a finished output met again after one of its inputs or settings changed under the
same name (a finetune cell, a resumed run, a dictionary pair, a target store): a stale result
returned with exit 0 before fingerprints were compared. The CLI cases assert what the data table
asserts: exit 2, one line on stderr naming the problem (a needle, or a tuple of needles that
must all be there), no traceback, and the user's files byte-for-byte intact. The API cases
assert a one-line `UserError`.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mlsm.artifacts.checkpoint import list_checkpoints
from mlsm.cli import main
from mlsm.errors import UserError

from .fix_hints import check_hint_is_tried
from .test_bad_inputs_data import (  # noqa: F401  (fixtures, shared with the data table)
    ENV,
    _one_line_error,
    _prepare,
    _run_args,
    _tree,
    _user_folder,
    fresh_targets,
    fx,
    targets_cmd,
)

ROW = {"task": "rte", "metric": "accuracy", "lr": 2e-5, "epochs": 3, "batch_size": 32,
       "max_len": 128, "n_train": 100}


def _rows(extra: str = "") -> str:
    rows = [json.dumps({**ROW, "model": m, "seed": s, "value": 0.5 + 0.1 * s})
            for m in ("a", "b") for s in range(3)]
    return "\n".join(rows) + "\n" + extra


def _write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


def _glue(tmp: Path, train: str | bytes | None = None) -> Path:
    good = "index\tsentence1\tsentence2\tlabel\n" + "".join(
        f"{i}\tthe cat .\ta cat .\tentailment\n" for i in range(4))
    _write(tmp / "glue" / "RTE" / "train.tsv", good if train is None else train)
    _write(tmp / "glue" / "RTE" / "dev.tsv", good)
    return tmp / "glue"


def _finetune(fix: dict, tmp: Path, data: Path, model: Path | None = None,
              results: Path | None = None, tasks: str = "rte") -> list[str]:
    return ["finetune", str(model or fix["teacher_dir"]), "--tasks", tasks, "--data-dir", str(data),
            "--results", str(results or tmp / "res.jsonl"), "--seeds", "1", "--epochs", "1",
            "--max-len", "16"]


def _copy(src: Path, dst: Path) -> Path:
    return Path(shutil.copytree(src, dst))


def _store_with_id(tmp: Path, fix: dict, token_id: int) -> Path:
    """A copy of the fixture store holding `token_id` (beyond every model's vocabulary)."""
    store = _copy(fix["store_dir"], tmp / "store")
    meta = json.loads((store / "meta.json").read_text())
    tokens = np.memmap(store / "tokens.bin", dtype=meta["dtype"], mode="r+")
    tokens[3] = token_id
    tokens.flush()
    del tokens
    return store


def _targets(fix: dict, out: Path, **flags: str) -> list[str]:
    args = {"--store": str(fix["store_dir"]), "--dictionary": str(fix["dictionary_path"]),
            "--teacher": str(fix["teacher_dir"]), "--max-len": "32", "--batch-size": "16",
            "--out": str(out), **flags}
    return ["targets", *[x for kv in args.items() for x in kv]]


def _dictionary(fix: dict, out: Path, store: Path | None = None) -> list[str]:
    return ["dictionary", "--store", str(store or fix["store_dir"]), "--teacher",
            str(fix["teacher_dir"]), "--layer", "1", "--k", "16", "--n-vectors", "50",
            "--max-len", "32", "--out", str(out)]


def _study(tmp: Path, fix: dict, tail: str) -> Path:
    head = (f"corpus: {{sources: [{fix['corpus_dir'] / 'a.txt'}]}}\n"
            "base: {data: {max_len: 32}, train: {steps: 1, batch_size: 4}}\n"
            f"readiness: [1.0]\nout: {tmp / 'study'}\n")
    return _write(tmp / "s.yaml", head + tail)


def _blimp_dir(tmp: Path, line: str) -> Path:
    return _write(tmp / "blimp" / "toy.jsonl", line + "\n").parent


GOOD_PAIR = '{"sentence_good": "the cat sees .", "sentence_bad": "cat the sees ."}'

# --------------------------------------------------------------------------- the table
# (class, verb) -> case(tmp, fix) -> (argv, paths that must stay intact, text of the error line)


def _content_targets_dictionary_truncated(tmp, fix):
    weights = _write(tmp / "d.safetensors", fix["dictionary_path"].read_bytes()[:200])
    shutil.copy(fix["dictionary_path"].with_suffix(".json"), tmp / "d.json")
    return _targets(fix, tmp / "t", **{"--dictionary": str(weights)}), [weights], "is damaged"


def _content_targets_dictionary_meta_is_a_list(tmp, fix):
    weights = Path(shutil.copy(fix["dictionary_path"], tmp / "d.safetensors"))
    _write(tmp / "d.json", "[1, 2]")
    return (_targets(fix, tmp / "t", **{"--dictionary": str(weights)}), [tmp / "d.json"],
            "must hold a JSON object")


def _content_finetune_tsv_binary(tmp, fix):
    glue = _glue(tmp, train=b"\xff\xfe\x00\x01")
    return _finetune(fix, tmp, glue), [glue], "train.tsv is not UTF-8"


def _content_finetune_results_not_a_results_file(tmp, fix):
    notes = _write(tmp / "notes.txt", "my thesis, chapter 1\nchapter 2\n")
    return (_finetune(fix, tmp, _glue(tmp), results=notes), [notes],
            "notes.txt is not a results file")


def _content_compare_line_is_a_list(tmp, fix):
    results = _write(tmp / "r.jsonl", _rows("[1, 2]\n"))
    return ["compare", str(results)], [results], "r.jsonl:7 is a JSON list"


def _content_export_checkpoint_json_torn(tmp, fix):
    ckpt = _copy(fix["teacher_dir"], tmp / "ckpt")
    _write(ckpt / "checkpoint.json", '{"step": ')
    return ["export", str(ckpt), "--out", str(tmp / "e")], [ckpt], "checkpoint.json is torn"


def _hf_folder(tmp, fix):
    """An HF model folder with no checkpoint.json, as the plain Trainer leaves one."""
    folder = _copy(fix["teacher_dir"], tmp / "hf")
    (folder / "checkpoint.json").unlink()
    return folder


def _content_export_trainer_state_torn(tmp, fix):
    """`mlsm export` of any HF folder reads the Trainer's trainer_state.json for the card."""
    folder = _hf_folder(tmp, fix)
    _write(folder / "trainer_state.json", '{"global_step": ')
    return ["export", str(folder), "--out", str(tmp / "e")], [folder], "trainer_state.json is torn"


def _content_export_hf_folder_without_safetensors(tmp, fix):
    folder = _hf_folder(tmp, fix)
    (folder / "model.safetensors").rename(folder / "weights.bak")
    return (["export", str(folder), "--out", str(tmp / "e")], [folder],
            ("no model.safetensors", "save_pretrained"))


def _content_export_run_json_torn(tmp, fix):
    """run.json (the git revision of each training segment) is read for the card."""
    run = _copy(fix["mlsm_ckpt"].parent.parent, tmp / "run")
    ckpt = run / "checkpoints" / fix["mlsm_ckpt"].name
    info = json.loads((ckpt / "checkpoint.json").read_text())
    _write(ckpt / "checkpoint.json", json.dumps({**info, "run": str(run)}))
    _write(run / "run.json", '{"format": "mlsm-run", "git_rev')
    return ["export", str(ckpt), "--out", str(tmp / "e")], [run], "run.json is torn"


def _content_study_file_binary(tmp, fix):
    study = _write(tmp / "s.yaml", b"name: \xff\xfe\n")
    return ["study", str(study)], [study], "s.yaml is not UTF-8"


def _content_blimp_sentence_not_text(tmp, fix):
    data = _blimp_dir(tmp, '{"sentence_good": 5, "sentence_bad": null}')
    return (["blimp", str(fix["teacher_dir"]), "--data", str(data), "--out", str(tmp / "o")],
            [data], "toy.jsonl:1 is not a BLiMP row")


def _content_pretrain_yaml_duplicate_key(tmp, fix):
    recipe = _write(tmp / "r.yaml", "train:\n  steps: 1\n  steps: 2\n")
    return (["pretrain", "--config", str(recipe), *_run_args(fix["store_dir"], tmp / "run")],
            [recipe], "duplicate key 'steps'")


def _tracked_run(tmp: Path, fix: dict, state: str) -> tuple[list[str], Path]:
    """A finished 3-step run with a TensorBoard tracker whose RUN/tracking.json is then replaced
    by `state`; (the argv that resumes it, the run)."""
    args = _run_args(fix["store_dir"], tmp / "run", **{"train.report_to": "[tensorboard]"})
    assert main(["pretrain", *args]) == 0
    _write(tmp / "run" / "tracking.json", state)
    return ["pretrain", "--resume", "auto", *args], tmp / "run"


def _content_pretrain_tracking_state_torn(tmp, fix):
    args, run = _tracked_run(tmp, fix, '{"run": {"tensorboard": ')
    return args, [run], "tracking.json is torn or not JSON"


def _content_pretrain_tracking_state_is_a_list(tmp, fix):
    args, run = _tracked_run(tmp, fix, '["run", "tensorboard"]')
    return args, [run], "tracking.json must hold a JSON object"


def _content_probe_checkpoint_config_not_a_mapping(tmp, fix):
    ckpt = _copy(fix["mlsm_ckpt"], tmp / "ckpt")
    info = json.loads((ckpt / "checkpoint.json").read_text())
    _write(ckpt / "checkpoint.json", json.dumps({**info, "config": {**info["config"], "model": 3}}))
    return (["probe", str(ckpt), "--max-steps", "1"], [ckpt],
            "'config.model' must be an object, not an integer (3)")


def _content_finetune_tracking_state_torn(tmp, fix):
    state = _write(tmp / "tracking" / "tracking.json", '{"cell": {"tensorboard": ')
    return ([*_finetune(fix, tmp, _glue(tmp)), "--report-to", "tensorboard"], [state],
            "tracking.json is torn or not JSON")


def _values_pretrain_lr_inf(tmp, fix):
    return (["pretrain", *_run_args(fix["store_dir"], tmp / "run", **{"optim.lr": ".inf"})], [],
            "optim.lr must be a finite number")


def _values_pretrain_override_wrong_type(tmp, fix):
    return (["pretrain", *_run_args(fix["store_dir"], tmp / "run"),
             "model.overrides.hidden_dropout_prob=high"], [], "model.overrides")


def _values_pretrain_vocab_size_ignored(tmp, fix):
    return (["pretrain", *_run_args(fix["store_dir"], tmp / "run"),
             "model.overrides.vocab_size=0"], [], "model.overrides.vocab_size=0 is not used")


def _values_pretrain_unknown_key_suggests(tmp, fix):
    return (["pretrain", *_run_args(fix["store_dir"], tmp / "run"), "train.step=5"], [],
            "train.step (did you mean steps?)")


def _values_pretrain_text_objective_unknown(tmp, fix):
    """--text takes any objective now (decided by its declarations): a misspelt one is one line
    listing them, before the text is read or a store written."""
    text = _write(tmp / "mine.txt", "a few words of text.\n")
    return (["pretrain", "--text", str(text), "--objective", "mlsmm", f"train.out={tmp / 'run'}"],
            [text], ("--objective mlsmm: unknown objective; choose from", "mlsm"))


_HUGE = "99999999999999999999"  # past C's long long: an OverflowError deep inside torch/numpy


def _values_pretrain_seed_negative(tmp, fix):
    """torch.Generator.manual_seed raised "expected non-negative integer" at the first step."""
    return (["pretrain", *_run_args(fix["store_dir"], tmp / "run", **{"train.seed": -1})], [],
            "train.seed must be 0 or more, got -1")


def _values_pretrain_out_with_a_line_break(tmp, fix):
    """train.out=RUN<newline>b was YAML-folded into the folder "RUN b": a run written where the
    user never said."""
    (tmp / "work").mkdir()
    return (["pretrain", *_run_args(fix["store_dir"], Path(f"{tmp / 'work' / 'run'}\nb"))],
            [tmp / "work"], "the value holds a line break")


def _values_pretrain_config_out_with_a_line_break(tmp, fix):
    config = _write(tmp / "work" / "run.yaml", 'train: {out: "' + str(tmp / "work" / "r") +
                    '\\nb"}\n')
    args = [a for a in _run_args(fix["store_dir"], tmp / "unused") if not a.startswith("train.out")]
    return (["pretrain", "--config", str(config), *args], [tmp / "work"],
            "no line break or other control character")


def _values_pretrain_batch_size_huge(tmp, fix):
    return (["pretrain", *_run_args(fix["store_dir"], tmp / "run",
                                    **{"train.batch_size": _HUGE})], [],
            f"train.batch_size must be at most 2147483647 in size, got {_HUGE}")


def _values_pretrain_threads_huge(tmp, fix):
    """torch.set_num_threads(100000) was a MemoryError."""
    return (["pretrain", *_run_args(fix["store_dir"], tmp / "run",
                                    **{"train.threads": 100000})], [],
            "train.threads must be 0 (all cores) to 1024")


def _values_rank_seed_huge(tmp, fix):
    text = _write(tmp / "x.txt", "the cat sees a dog .\n")
    return (["rank", str(fix["teacher_dir"]), "--text", str(text), "--out", str(tmp / "r"),
             "--seed", _HUGE], [text], "argument --seed: 99999999999999999999 is out of range")


_LONG_SENTENCE = " ".join(["the cat sees a dog ."] * 120)  # 720 words: past 512 positions


def _values_rank_max_length_beyond_the_positions(tmp, fix):
    """Cut at --max-length 1000, a 720-word sentence indexed past the 512 position embeddings:
    IndexError, a traceback. (Without the flag it is cut at the model's positions, exit 0.)"""
    text = _write(tmp / "x.txt", _LONG_SENTENCE + "\n")
    return (["rank", str(fix["teacher_dir"]), "--text", str(text), "--out", str(tmp / "r"),
             "--max-length", "1000"], [text], ("--max-length 1000 is more than the model's",
                                               "positions"))


def _values_dictionary_max_len_huge(tmp, fix):
    args = _dictionary(fix, tmp / "d.safetensors")
    args[args.index("--max-len") + 1] = _HUGE
    return args, [fix["store_dir"]], "argument --max-len: 99999999999999999999 is out of range"


def _values_dictionary_lam_one_or_more(tmp, fix):
    """--lam 1e308 wrote a dictionary of NaN objective whose every code is zero (exit 0), and
    `targets` then built a "complete" store of empty codes."""
    return ([*_dictionary(fix, tmp / "d.safetensors"), "--lam", "1e308"], [fix["store_dir"]],
            "makes every sparse code zero")


def _values_pretrain_objective_lam_one_or_more(tmp, fix):
    return (["pretrain", *_run_args(fix["store_dir"], tmp / "run", **{
        "objective.name": "mlsm", "objective.dictionary": str(fix["dictionary_path"]),
        "objective.lam": 1.5})], [fix["dictionary_path"]], "objective.lam must be in [0, 1)")


def _values_study_duplicate_arm(tmp, fix):
    study = _study(tmp, fix, "arms:\n  a: {objective: {name: mlm}}\n  a: {objective: {name: kd}}\n")
    return ["study", str(study)], [study], "duplicate key 'a'"


def _values_study_duplicate_task(tmp, fix):
    study = _study(tmp, fix, "arms: {a: {objective: {name: mlm}}}\nfinetune: {tasks: [rte, rte]}\n")
    return ["study", str(study)], [study], "rte twice"


def _values_study_unknown_task(tmp, fix):
    study = _study(tmp, fix, "arms: {a: {objective: {name: mlm}}}\nfinetune: {tasks: [rtee]}\n")
    return ["study", str(study)], [study], "unknown task 'rtee'"


def _values_study_negative_seeds(tmp, fix):
    study = _study(tmp, fix, "arms: {a: {objective: {name: mlm}}}\n"
                            "finetune: {tasks: [rte], seeds: -1}\n")
    return ["study", str(study)], [study], "finetune.seeds must be positive"


def _values_study_unknown_probe_input(tmp, fix):
    study = _study(tmp, fix, "arms: {a: {objective: {name: mlm}}}\nprobe: {inputs: [nosuch]}\n")
    return ["study", str(study)], [study], "probe.inputs"


def _values_study_unknown_readout_control(tmp, fix):
    study = _study(tmp, fix, "arms: {a: {objective: {name: mlm}}}\nprobe: {controls: [words]}\n")
    return ["study", str(study)], [study], "probe.controls"


def _values_study_probe_head_not_latent(tmp, fix):
    study = _study(tmp, fix, "arms: {a: {objective: {name: mlm}}}\nprobe: {head: vocab}\n")
    return ["study", str(study)], [study], "probe.head must be latent in a study"


def _values_study_negative_probe_rank(tmp, fix):
    study = _study(tmp, fix, "arms: {a: {objective: {name: mlm}}}\nprobe: {rank: -3}\n")
    return ["study", str(study)], [study], "probe.rank"


def _values_probe_unknown_head(tmp, fix):
    return (["probe", str(fix["mlsm_ckpt"]), "--head", "words"], [fix["mlsm_ckpt"]],
            "--head")


def _values_probe_negative_rank(tmp, fix):
    return (["probe", str(fix["mlsm_ckpt"]), "--head", "factored", "--rank", "-1"],
            [fix["mlsm_ckpt"]], "--rank")


def _values_probe_control_with_the_loop(tmp, fix):
    return (["probe", str(fix["mlsm_ckpt"]), "--head", "vocab", "--steps", "2"],
            [fix["mlsm_ckpt"]], "--head")


def _values_study_unknown_arm_flag(tmp, fix):
    study = _study(tmp, fix, "arms: {a: {objective: {name: mlm}}}\n")
    return ["study", str(study), "--arms", "nosuch"], [study], "unknown arm 'nosuch'"


def _values_study_print_with_report(tmp, fix):
    study = _study(tmp, fix, "arms: {a: {objective: {name: mlm}}}\n")
    return ["study", "report", str(study), "--print"], [study], "--print shows what a study"


def _values_study_negative_eval_jobs(tmp, fix):
    study = _study(tmp, fix, "arms: {a: {objective: {name: mlm}}}\nexecutor: {eval_jobs: -1}\n")
    return ["study", str(study)], [study], "executor.eval_jobs"


def _values_study_unknown_slurm_cluster(tmp, fix):
    pytest.importorskip("submitit")
    study = _study(tmp, fix, "arms: {a: {objective: {name: mlm}}}\n"
                            "executor: {kind: slurm, slurm: {timeout_min: 5, cluster: nosuch}}\n")
    return ["study", str(study)], [study], "executor.slurm.cluster is 'nosuch'"


def _values_finetune_duplicate_task(tmp, fix):
    return _finetune(fix, tmp, _glue(tmp), tasks="rte,RTE"), [], "rte twice"


def _values_compare_seed_is_a_list(tmp, fix):
    results = _write(tmp / "r.jsonl", _rows().replace('"seed": 0', '"seed": [0]'))
    return ["compare", str(results)], [results], "seed must be a single value"


def _values_probe_max_steps_zero(tmp, fix):
    return ["probe", str(fix["mlsm_ckpt"]), "--max-steps", "0"], [fix["mlsm_ckpt"]], "--max-steps"


def _values_dictionary_k_beyond_the_distinct_states(tmp, fix):
    """k = 64 on a store of one 3-word document: 50 draws of its few states, the 64 atoms
    resampled duplicates, exit 0."""
    assert main(_prepare(fix, _write(tmp / "tiny.txt", "the cat sees\n"), out=tmp / "tiny")) == 0
    args = [*_dictionary(fix, tmp / "d", store=tmp / "tiny"), "--k", "32", "--n-vectors", "64"]
    return args, [tmp / "tiny"], ("distinct vectors, fewer than the 32 atoms", "lower --k")


def _values_dictionary_sampling_unknown(tmp, fix):
    return ([*_dictionary(fix, tmp / "d.safetensors"), "--sampling", "lines"],
            [fix["store_dir"]], "windows or documents")


def _values_dictionary_forget_negative(tmp, fix):
    return ([*_dictionary(fix, tmp / "d.safetensors"), "--forget", "-1"], [fix["store_dir"]],
            "--forget")


def _values_probe_unknown_input(tmp, fix):
    return (["probe", str(fix["mlsm_ckpt"]), "--inputs", "embeddings"], [fix["mlsm_ckpt"]],
            "--inputs")


def _consistency_probe_plateau_flag_with_paper_recipe(tmp, fix):
    return (["probe", str(fix["mlsm_ckpt"]), "--recipe", "paper", "--patience", "2"],
            [fix["mlsm_ckpt"]], "--patience")


def _values_demo_steps_zero(tmp, fix):
    return ["demo", "--out", str(tmp / "demo"), "--steps", "0"], [tmp / "demo"], "--steps"


def _values_train_tokenizer_vocab_huge(tmp, fix):
    return (["train-tokenizer", str(fix["corpus_dir"] / "a.txt"), "--out", str(tmp / "tok"),
             "--vocab-size", "99999999999999999999"], [], "--vocab-size")


def _values_train_tokenizer_no_text(tmp, fix):
    empty = _write(tmp / "empty.txt", "")
    return ["train-tokenizer", str(empty), "--out", str(tmp / "tok")], [empty], "no text in"


def _consistency_pretrain_token_id_beyond_vocab(tmp, fix):
    store = _store_with_id(tmp, fix, 60000)
    return ["pretrain", *_run_args(store, tmp / "run")], [store], "holds token id 60000"


def _consistency_dictionary_token_id_beyond_vocab(tmp, fix):
    store = _store_with_id(tmp, fix, 60000)
    return _dictionary(fix, tmp / "d", store), [store], "holds token id 60000"


def _consistency_probe_store_of_another_tokenizer(tmp, fix):
    """Its vocabulary size differs too: the error named model.init_from, no flag of `probe`."""
    from mlsm.data.corpus import prepare_corpus
    from mlsm.data.tokenizer import train_tokenizer

    train_tokenizer(str(fix["corpus_dir"]), tmp / "tok", kind="wordpiece", vocab_size=120)
    store = prepare_corpus(str(fix["corpus_dir"]), str(tmp / "tok"), tmp / "store").path
    return (["probe", str(fix["mlsm_ckpt"]), "--store", str(store), "--steps", "2", "--out",
             str(tmp / "p")], [store, fix["mlsm_ckpt"], tmp / "p"],
            f"--store {store} was prepared with another tokenizer")


def _consistency_probe_heads_json_disagrees_with_weights(tmp, fix):
    ckpt = _copy(fix["mlsm_ckpt"], tmp / "ckpt")
    heads = json.loads((ckpt / "heads.json").read_text())
    _write(ckpt / "heads.json", json.dumps({**heads, "latent": {**heads["latent"], "k": 65}}))
    return (["probe", str(ckpt), "--max-steps", "1", "--out", str(tmp / "p")], [ckpt],
            "does not match its heads.json entry")


def _consistency_flops_layer_beyond_teacher(tmp, fix):
    return (["flops", "--teacher", str(fix["teacher_dir"]), "--layer", "9"], [],
            "teacher layer 9 does not exist")


def _consistency_export_probe_of_another_kind(tmp, fix):
    return (["export", str(fix["mlsm_ckpt"]), "--out", str(tmp / "e"), "--probe",
             str(fix["teacher_dir"])], [], "has no heads.safetensors")


@pytest.fixture(scope="module")
def unscored_ckpts(store_dir: Path, teacher_dir: Path, dictionary_path: Path,
                   tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Checkpoints PLL cannot score: the last of a 1-step MAE-LM, MAE-MLSM and CLM run, the
    export of the MAE-LM one (mlsm.json names its objective), and a probe trained on the MAE-MLSM
    checkpoint as one was before `mlsm probe` refused it (the check switched off for that). Their
    own trainings: objectives that neither of conftest's shared runs (MLM, MLSM) has."""
    root = tmp_path_factory.mktemp("unscored")
    found = {}
    for name, extra in [("mae_lm", {}), ("mae_mlsm", {"objective.dictionary": dictionary_path,
                                                      "objective.teacher": teacher_dir}),
                        ("clm", {})]:
        extra = {"objective.name": name, "train.steps": 1, **extra}
        assert main(["pretrain", *_run_args(store_dir, root / name, **extra)]) == 0
        found[name] = list_checkpoints(root / name)[-1][1]
    assert main(["export", str(found["mae_lm"]), "--out", str(root / "export")]) == 0
    with pytest.MonkeyPatch.context() as legacy:
        legacy.setattr("mlsm.evaluate.probe.probe_fit.check_scored_by_pll", lambda folder: None)
        assert main(["probe", str(found["mae_mlsm"]), "--max-steps", "1", "--out",
                     str(root / "probe")]) == 0
    probe = list_checkpoints(root / "probe")[-1][1]
    return {**found, "mae_lm export": root / "export", "probe of mae_mlsm": probe}


def _by_finetuning(tmp: Path, fix: dict, verb: str, model: str) -> tuple:
    folder = fix["unscored_ckpts"][model]
    if verb == "probe":
        return ["probe", str(folder), "--out", str(tmp / "p")], [folder, tmp / "p"], \
            "evaluate it by fine-tuning: mlsm finetune"
    data = _blimp_dir(tmp, GOOD_PAIR)
    return (["blimp", str(folder), "--data", str(data), "--out", str(tmp / "b")],
            [folder, data, tmp / "b"], "evaluate it by fine-tuning: mlsm finetune")


def _consistency_probe_mae_lm_checkpoint(tmp, fix):
    return _by_finetuning(tmp, fix, "probe", "mae_lm")


def _consistency_probe_mae_mlsm_checkpoint(tmp, fix):
    return _by_finetuning(tmp, fix, "probe", "mae_mlsm")


def _consistency_blimp_mae_lm_checkpoint(tmp, fix):
    return _by_finetuning(tmp, fix, "blimp", "mae_lm")


def _consistency_blimp_mae_lm_export(tmp, fix):
    return _by_finetuning(tmp, fix, "blimp", "mae_lm export")


def _consistency_blimp_mae_mlsm_checkpoint(tmp, fix):
    return _by_finetuning(tmp, fix, "blimp", "mae_mlsm")


def _consistency_blimp_clm_checkpoint(tmp, fix):
    return _by_finetuning(tmp, fix, "blimp", "clm")


def _consistency_blimp_probe_of_a_mae_mlsm_checkpoint(tmp, fix):
    return _by_finetuning(tmp, fix, "blimp", "probe of mae_mlsm")


def _consistency_blimp_mae_lm_export_with_a_hand_edited_step(tmp, fix):
    """mlsm.json's step of the wrong type: the objective's class decides alone (MAE-LM: never)."""
    export = _copy(fix["unscored_ckpts"]["mae_lm export"], tmp / "export")
    card = json.loads((export / "mlsm.json").read_text())
    _write(export / "mlsm.json", json.dumps({**card, "step": "last", "readiness": "all"}))
    data = _blimp_dir(tmp, GOOD_PAIR)
    return (["blimp", str(export), "--data", str(data), "--out", str(tmp / "b")],
            [export, data], "evaluate it by fine-tuning: mlsm finetune")


def test_a_probe_naming_itself_as_its_probed_checkpoint_does_not_recurse(
        unscored_ckpts: dict[str, Path], tmp_path: Path) -> None:
    """A hand-edited probe checkpoint.json whose objective.checkpoint is its own folder: the PLL
    check answers (mlsm never probes a probe) instead of recursing until Python gives up; the
    untouched probe of the MAE-MLSM checkpoint is still refused, and so is the edited one while
    it carries the refusal written at save time. Without it, the reader names `mlsm migrate`,
    which computes it from the probe's objective, again without recursing."""
    from mlsm.migrate import migrate
    from mlsm.models.heads import pll_refusal

    probe = _copy(unscored_ckpts["probe of mae_mlsm"], tmp_path / "probe")
    assert "MAE decoder" in pll_refusal(probe)
    info = json.loads((probe / "checkpoint.json").read_text())
    info["config"]["objective"]["checkpoint"] = str(probe)
    _write(probe / "checkpoint.json", json.dumps(info))
    assert "MAE decoder" in pll_refusal(probe)  # the refusal written at save time stands
    for key in ("latent_head", "pll_refusal"):  # as a checkpoint older than those facts
        del info[key]
    _write(probe / "checkpoint.json", json.dumps(info))
    with pytest.raises(UserError, match="mlsm migrate"):
        pll_refusal(probe)
    assert migrate(probe)[0].facts == {"latent_head": "latent", "pll_refusal": None}
    assert pll_refusal(probe) is None


def _paths_finetune_results_inside_model(tmp, fix):
    model = _copy(fix["teacher_dir"], tmp / "model")
    return (_finetune(fix, tmp, _glue(tmp), model=model, results=model / "config.json"), [model],
            "lies inside the input model")


def _paths_finetune_results_is_task_data(tmp, fix):
    glue = _glue(tmp)
    return (_finetune(fix, tmp, glue, results=glue / "RTE" / "train.tsv"), [glue],
            "lies inside the input --data-dir")


def _paths_dictionary_out_inside_store(tmp, fix):
    store = _copy(fix["store_dir"], tmp / "store")
    return (_dictionary(fix, store / "tokens.bin", store), [store],
            "lies inside the input --store")


def _paths_targets_out_inside_store(tmp, fix):
    store = _copy(fix["store_dir"], tmp / "store")
    return (_targets(fix, store / "t", **{"--store": str(store)}), [store],
            "lies inside the input --store")


def _paths_pretrain_out_inside_store(tmp, fix):
    store = _copy(fix["store_dir"], tmp / "store")
    return (["pretrain", *_run_args(store, store / "run")], [store],
            "train.out")


def _loop(tmp: Path) -> Path:
    """A symbolic link that points at itself: resolving it was Python 3.11's RuntimeError."""
    link = tmp / "loop"
    link.symlink_to("loop")
    return link


def _paths_prepare_out_symlink_loop(tmp, fix):
    return (["prepare", str(fix["corpus_dir"] / "a.txt"), "--tokenizer", str(fix["tokenizer_dir"]),
             "--out", str(_loop(tmp))], [fix["corpus_dir"]], "remove the symbolic-link loop")


def _paths_prepare_source_symlink_loop(tmp, fix):
    return (["prepare", str(_loop(tmp)), "--tokenizer", str(fix["tokenizer_dir"]), "--out",
             str(tmp / "store")], [fix["tokenizer_dir"]], "remove the symbolic-link loop")


def _paths_pretrain_out_symlink_loop(tmp, fix):
    return (["pretrain", *_run_args(fix["store_dir"], _loop(tmp))], [fix["store_dir"]],
            "Too many levels of symbolic links")


def _paths_targets_out_symlink_loop(tmp, fix):
    return _targets(fix, _loop(tmp)), [fix["store_dir"]], "remove the symbolic-link loop"


def _paths_finetune_results_symlink_loop(tmp, fix):
    glue = _glue(tmp)
    return (_finetune(fix, tmp, glue, results=_loop(tmp)), [glue], "remove the symbolic-link loop")


_LONG = "n" * 300  # one path component over the 255 bytes Linux allows


def _paths_prepare_out_name_too_long(tmp, fix):
    return (["prepare", str(fix["corpus_dir"] / "a.txt"), "--tokenizer", str(fix["tokenizer_dir"]),
             "--out", str(tmp / _LONG)], [fix["corpus_dir"]], "argument --out: File name too long")


def _paths_compare_out_name_too_long(tmp, fix):
    return (["compare", str(tmp / "r.jsonl"), "--out", str(tmp / _LONG)], [],
            "shorten the path (each name at most 255 bytes)")


def _paths_finetune_results_name_too_long(tmp, fix):
    glue = _glue(tmp)
    return (_finetune(fix, tmp, glue, results=tmp / _LONG / "r.jsonl"), [glue],
            "argument --results: File name too long")


def _paths_blimp_out_holds_user_blimp_md(tmp, fix):
    """The user's own blimp.md in --out was replaced without a word."""
    notes = _write(tmp / "out" / "blimp.md", "my notes\n")
    data = _blimp_dir(tmp, GOOD_PAIR)
    return (["blimp", str(fix["teacher_dir"]), "--data", str(data), "--out", str(notes.parent)],
            [notes.parent, data], "exists and is not a BLiMP report")


def _paths_rank_out_holds_user_rank_csv(tmp, fix):
    mine = _write(tmp / "out" / "rank.csv", "mine\n")
    text = _write(tmp / "x.txt", "the cat sees a dog .\n")
    return (["rank", str(fix["teacher_dir"]), "--text", str(text), "--out", str(mine.parent)],
            [mine.parent], "exists and is not a rank report")


def _paths_compare_out_holds_user_means_csv(tmp, fix):
    """Only comparison.md's provenance was checked: a user's means.csv was overwritten."""
    rows = "".join(json.dumps({"model": m, "task": "rte", "metric": "acc", "seed": s, "lr": 1e-4,
                               "value": 0.5 + s / 10}) + "\n" for m in "ab" for s in range(3))
    results = _write(tmp / "r.jsonl", rows)
    mine = _write(tmp / "out" / "means.csv", "mine\n")
    return (["compare", str(results), "--out", str(mine.parent)], [mine.parent, results],
            "exists and is not an mlsm comparison")


def _results(tmp: Path, **row: object) -> Path:
    """A results file of two models x 3 seeds whose rows all carry `row`'s fields."""
    base = {"task": "rte", "metric": "acc", "lr": 1e-4, "epochs": 3, "batch_size": 32,
            "max_len": 128, "n_train": 100}
    return _write(tmp / "r.jsonl", "".join(
        json.dumps({**base, "model": m, "seed": s, "value": 0.5 + s / 10, **row}) + "\n"
        for m in "ab" for s in range(3)))


def _content_compare_results_lr_not_a_number(tmp, fix):
    """float('fast') was a ValueError: an internal error."""
    results = _results(tmp, lr="fast")
    return ["compare", str(results)], [results], f"{results}:1: lr must be a number, got 'fast'"


def _content_report_results_model_with_line_break(tmp, fix):
    """A model name holding a line break split every Markdown table mid-row (exit 0)."""
    results = _results(tmp, model="a\nb")
    return (["report", str(results), "--out", str(tmp / "rep")], [results],
            "holds a line break, a control character or '|'")


def _content_compare_results_no_value_is_a_score(tmp, fix):
    """Two lines: the "skipped 6 of 6" warning, then the error."""
    results = _results(tmp, value=float("inf"))
    return (["compare", str(results)], [results],
            "the value of every result row is not a score")


def _content_finetune_stsb_score_nan(tmp, fix):
    """float('nan') is a float: it trained on a NaN loss and appended NaN rows (exit 0)."""
    head = "index\tsentence1\tsentence2\tscore\n"
    _write(tmp / "glue" / "STS-B" / "train.tsv", head + "0\tthe cat .\ta cat .\tnan\n")
    _write(tmp / "glue" / "STS-B" / "dev.tsv", head + "0\tthe cat .\ta cat .\t3.0\n")
    return (_finetune(fix, tmp, tmp / "glue", tasks="stsb"), [tmp / "glue"],
            "score 'nan' is not a number from 0 to 5")


def _content_prepare_tokenizer_cannot_encode(tmp, fix):
    """A WordPiece vocabulary without [UNK] loads, then fails on the first line (an internal
    error in a tokenising worker)."""
    tok = _copy(fix["tokenizer_dir"], tmp / "tok")
    spec = json.loads((tok / "tokenizer.json").read_text())
    spec["model"]["vocab"] = {}
    _write(tok / "tokenizer.json", json.dumps(spec))
    return (["prepare", str(fix["corpus_dir"] / "a.txt"), "--tokenizer", str(tok), "--out",
             str(tmp / "store")], [tok], "cannot encode text (WordPiece error")


def _content_pretrain_target_store_values_nan(tmp, fix):
    """Sizes intact, codes NaN: every code was dropped as "no target", loss 0.0, exit 0."""
    import numpy as np

    targets = _copy(fix["fresh_targets"], tmp / "t")
    values = np.memmap(targets / "values.bin", dtype=np.float16, mode="r+")
    values[:] = np.nan
    values.flush()
    del values
    return (["pretrain", *_run_args(fix["store_dir"], tmp / "run", **{
        "objective.name": "mlsm", "objective.targets": str(targets)})], [targets],
            "values.bin holds NaN, inf or negative code values")


def _paths_dictionary_out_is_a_device(tmp, fix):
    """--out /dev/null wrote /dev/null.safetensors and /dev/null.json (exit 0)."""
    return _dictionary(fix, Path("/dev/null")), [fix["store_dir"]], "is a device or special file"


def _paths_study_out_is_a_user_folder(tmp, fix):
    """`study report` replaced the user's report.md and summary.json in a folder that is no
    study's."""
    mine = _write(tmp / "study" / "report.md", "my report\n")
    _write(tmp / "study" / "summary.json", "{}\n")
    study = _study(tmp, fix, "arms: {a: {objective: {name: mlm}}}\n")
    return (["study", "report", str(study)], [mine.parent, study],
            "is not a study folder (no study.json) and holds report.md, summary.json")


def _paths_probe_out_is_the_checkpoint(tmp, fix):
    ckpt = _copy(fix["mlsm_ckpt"], tmp / "ckpt")
    return (["probe", str(ckpt), "--out", str(ckpt), "--max-steps", "1"], [ckpt],
            "is the input CHECKPOINT")


def _paths_probe_out_user_folder(tmp, fix):
    folder = _user_folder(tmp)
    return (["probe", str(fix["mlsm_ckpt"]), "--out", str(folder), "--max-steps", "1"], [folder],
            "not an mlsm probe run")


def _paths_probe_out_inside_store(tmp, fix):
    store = _copy(fix["store_dir"], tmp / "store")
    return (["probe", str(fix["mlsm_ckpt"]), "--store", str(store), "--out", str(store / "p")],
            [store], f"--out {store / 'p'} lies inside the input --store")


def _paths_probe_plateau_out_inside_store(tmp, fix):
    """The plateau probe (no --store: the pre-training store) wrote into the store."""
    ckpt = _copy(fix["mlsm_ckpt"], tmp / "ckpt")
    store = _copy(fix["store_dir"], tmp / "store")
    info = json.loads((ckpt / "checkpoint.json").read_text())
    info["config"]["data"]["store"] = str(store)
    _write(ckpt / "checkpoint.json", json.dumps(info))
    return (["probe", str(ckpt), "--max-steps", "1", "--out", str(store / "p")], [store, ckpt],
            "lies inside the input --store")


def _paths_probe_steps_out_inside_checkpoint(tmp, fix):
    """The fixed-steps probe named train.out and model.init_from, keys `probe` has no flag for."""
    ckpt = _copy(fix["mlsm_ckpt"], tmp / "ckpt")
    return (["probe", str(ckpt), "--steps", "1", "--out", str(ckpt / "p")], [ckpt],
            f"--out {ckpt / 'p'} lies inside the input CHECKPOINT")


def _paths_probe_store_missing(tmp, fix):
    # a copy: the printed fix (tests/test_fix_hints.py) trains a probe run beside the checkpoint
    run = _copy(fix["mlsm_ckpt"].parent.parent, tmp / "run")
    ckpt = run / "checkpoints" / fix["mlsm_ckpt"].name
    return (["probe", str(ckpt), "--store", str(tmp / "nostore")], [ckpt], "--store")


def _paths_demo_data_missing(tmp, fix):
    return (["demo", "--out", str(tmp / "demo"), "--data", str(tmp / "nodata")], [tmp / "demo"],
            "--data")


def _paths_demo_corpus_missing(tmp, fix):
    return (["demo", "--out", str(tmp / "demo"), "--corpus", str(tmp / "none.txt")],
            [tmp / "demo"], "--corpus")


def _paths_blimp_out_is_the_data(tmp, fix):
    data = _blimp_dir(tmp, GOOD_PAIR)
    return (["blimp", str(fix["teacher_dir"]), "--data", str(data), "--out", str(data)], [data],
            "is the input --data")


def _paths_rank_out_is_the_model(tmp, fix):
    model = _copy(fix["teacher_dir"], tmp / "model")
    text = _write(tmp / "x.txt", "the cat sees a dog .\n")
    return (["rank", str(model), "--text", str(text), "--out", str(model)], [model],
            "is the input MODEL")


def _paths_export_out_inside_checkpoint(tmp, fix):
    ckpt = _copy(fix["teacher_dir"], tmp / "ckpt")
    return (["export", str(ckpt), "--out", str(ckpt / "export")], [ckpt],
            "lies inside the input checkpoint")


def _paths_export_tokenizer_links_outside_the_checkpoint(tmp, fix):
    """A tokenizer file that is a link to a file elsewhere (a user's private vocabulary) was
    copied into the folder meant for publication."""
    ckpt = _copy(fix["teacher_dir"], tmp / "ckpt")
    secret = _write(tmp / "private" / "tokenizer.json", (ckpt / "tokenizer.json").read_text())
    (ckpt / "tokenizer.json").unlink()
    (ckpt / "tokenizer.json").symlink_to(secret)
    return (["export", str(ckpt), "--out", str(tmp / "export")], [ckpt, secret.parent],
            ("tokenizer.json is a link to", "outside the checkpoint folder"))


def _paths_report_out_holds_users_report(tmp, fix):
    results = _write(tmp / "r.jsonl", _rows())
    mine = _write(tmp / "rep" / "report.md", "# My own report\n")
    return (["report", str(results), "--out", str(tmp / "rep")], [mine],
            "exists and is not an mlsm report")


def _paths_compare_out_user_folder(tmp, fix):
    results = _write(tmp / "r.jsonl", _rows())
    folder = _user_folder(tmp)
    return (["compare", str(results), "--out", str(folder)], [folder],
            "exists and is not an mlsm comparison")


def _paths_train_tokenizer_out_user_folder(tmp, fix):
    folder = _user_folder(tmp)
    return (["train-tokenizer", str(fix["corpus_dir"] / "a.txt"), "--out", str(folder)], [folder],
            "exists and is not a tokenizer")


def _paths_study_corrupt_status(tmp, fix):
    study = _study(tmp, fix, "arms: {a: {objective: {name: mlm}}}\n")
    status = _write(tmp / "study" / "status.json", b"\xff\x00{")
    return ["study", str(study), "--stages", "store"], [status], "study status"


def _content_study_report_results_line_not_json(tmp, fix):
    study = _study(tmp, fix, "arms: {a: {objective: {name: mlm}}}\n")
    results = _write(tmp / "study" / "results.jsonl", _rows("mine, not a row\n") + _rows())
    return ["study", "report", str(study)], [results], "results.jsonl:7 is not JSON"


def _content_study_report_torn_blimp_result(tmp, fix):
    study = _study(tmp, fix, "arms: {a: {objective: {name: mlm}}}\n")
    torn = _write(tmp / "study" / "blimp" / "a@100pct.json", '{"arm": "a", "readiness": 1.0, "ov')
    return ["study", "report", str(study)], [torn], "a@100pct.json is torn or not JSON (line 1"


def _content_study_report_blimp_result_missing_field(tmp, fix):
    study = _study(tmp, fix, "arms: {a: {objective: {name: mlm}}}\n")
    row = _write(tmp / "study" / "blimp" / "a@100pct.json", '{"arm": "a", "readiness": 1.0}')
    return ["study", "report", str(study)], [row], "a@100pct.json is not one the study wrote"


def _content_study_report_blimp_phenomena_a_list(tmp, fix):
    study = _study(tmp, fix, "arms: {a: {objective: {name: mlm}}}\n")
    row = _write(tmp / "study" / "blimp" / "a@100pct.json",
                 '{"arm": "a", "readiness": 1.0, "overall": 0.5, "n_pairs": 2, '
                 '"sets": {"blimp": {"phenomena": [0.5, 0.5]}}}')
    return ["study", "report", str(study)], [row], "sets.blimp.phenomena must map"


def _content_study_report_stage_row_without_seconds(tmp, fix):
    study = _study(tmp, fix, "arms: {a: {objective: {name: mlm}}}\n")
    _write(tmp / "study" / "stages.jsonl", '{"stage": "store", "arm": null}\n')
    # the failed report stage appends its own time row to stages.jsonl: protect the rest
    return ["study", "report", str(study)], [study], "stages.jsonl:1 is not a row the study wrote"


def _content_study_report_metrics_row_not_an_object(tmp, fix):
    study = _study(tmp, fix, "arms: {a: {objective: {name: mlm}}}\n")
    rows = _write(tmp / "study" / "runs" / "a" / "metrics.jsonl",
                  '{"step": 1, "loss": 7.5}\n[1, 7.4]\n')
    return ["study", "report", str(study)], [rows], "metrics.jsonl:2 is not a row mlsm logged"


def _content_study_status_entry_not_an_object(tmp, fix):
    study = _study(tmp, fix, "arms: {a: {objective: {name: mlm}}}\n")
    status = _write(tmp / "study" / "status.json", '{"store": "done"}')
    return ["study", str(study), "--stages", "store"], [status], "entry 'store' must be an object"


# valid JSON of the wrong shape in the files mlsm wrote itself and reads back: each reader checks
# the fields it uses where it reads the file (`mlsm.inputs.read_json(fields=...)`)


def _model_with(tmp: Path, fix: dict, weights=None, **config: object) -> Path:
    """A copy of the tiny teacher folder whose weights are `weights(tensors)` and whose config.json
    has `config` changed: an HF folder whose files do not belong together."""
    from safetensors.torch import load_file, save_file

    model = _copy(fix["teacher_dir"], tmp / "model")
    if weights is not None:
        tensors = load_file(model / "model.safetensors")
        save_file(weights(tensors), model / "model.safetensors", metadata={"format": "pt"})
    if config:
        _edit_json(model / "config.json", **config)
    return model


def _content_blimp_model_weights_file_empty(tmp, fix):
    """An empty weights file loaded as a randomly initialised model, and BLiMP scored it."""
    model = _model_with(tmp, fix, weights=lambda t: {})
    data = _blimp_dir(tmp, GOOD_PAIR)
    return (["blimp", str(model), "--data", str(data), "--out", str(tmp / "b")], [model, data],
            "its weights lack 37 of the 37 encoder tensors")


def _content_finetune_model_config_more_layers_than_weights(tmp, fix):
    """Layers the weights do not hold were initialised at random, and a row was appended."""
    model = _model_with(tmp, fix, num_hidden_layers=5)
    return (_finetune(fix, tmp, _glue(tmp), model=model), [model],
            "which would be random; restore the weights file or the config.json")


def _content_rank_model_weights_nan(tmp, fix):
    """NaN weights: linalg.eigh's internal error in rank (BLiMP scored 0.0 without a word)."""
    model = _model_with(tmp, fix, weights=lambda t: {k: v * float("nan") for k, v in t.items()})
    text = _write(tmp / "x.txt", "the cat sees a dog .\n")
    return (["rank", str(model), "--text", str(text), "--out", str(tmp / "r")], [model],
            "its weights hold NaN or inf")


def _content_blimp_model_config_vocab_differs_from_weights(tmp, fix):
    """transformers' size-mismatch table (many lines) and a message pointing at it."""
    model = _model_with(tmp, fix, vocab_size=50)
    data = _blimp_dir(tmp, GOOD_PAIR)
    return (["blimp", str(model), "--data", str(data), "--out", str(tmp / "b")], [model, data],
            "a tensor of its weights has another size than its config.json says")


def _edit_json(path: Path, **fields: object) -> Path:
    """Rewrite one of mlsm's JSON files with `fields` changed (None: removed), as a hand edit."""
    data = json.loads(path.read_text())
    data.update(fields)
    return _write(path, json.dumps({k: v for k, v in data.items() if v is not None}))


def _content_blimp_run_checkpoint_step_not_a_number(tmp, fix):
    """A run given by its folder: every checkpoint.json of the run is read to find the final one."""
    run = _copy(fix["teacher_dir"].parent.parent, tmp / "run")
    _edit_json(run / "checkpoints" / fix["teacher_dir"].name / "checkpoint.json", step="last")
    data = _blimp_dir(tmp, GOOD_PAIR)
    return (["blimp", str(run), "--data", str(data), "--out", str(tmp / "b")], [run, data],
            "'step' must be an integer, not text (\"last\")")


def _content_finetune_checkpoint_readiness_not_a_number(tmp, fix):
    model = _copy(fix["teacher_dir"], tmp / "model")
    _edit_json(model / "checkpoint.json", readiness="all")
    return (_finetune(fix, tmp, _glue(tmp), model=model), [model],
            "'readiness' must be a number, not text")


def _content_export_checkpoint_objective_not_an_object(tmp, fix):
    ckpt = _copy(fix["mlsm_ckpt"], tmp / "ckpt")
    info = json.loads((ckpt / "checkpoint.json").read_text())
    _edit_json(ckpt / "checkpoint.json", config={**info["config"], "objective": "mlsm"})
    return (["export", str(ckpt), "--out", str(tmp / "e")], [ckpt],
            "'config.objective' must be an object, not text")


def _content_export_checkpoint_run_not_text(tmp, fix):
    ckpt = _copy(fix["teacher_dir"], tmp / "ckpt")
    _edit_json(ckpt / "checkpoint.json", run=["runs", "a"])
    return (["export", str(ckpt), "--out", str(tmp / "e")], [ckpt],
            "'run' must be text, not a list")


def _content_blimp_heads_json_probe_sizes_not_numbers(tmp, fix):
    ckpt = _copy(fix["mlsm_ckpt"], tmp / "ckpt")
    _edit_json(ckpt / "heads.json", probe={"in": "k", "out": "vocab"})
    data = _blimp_dir(tmp, GOOD_PAIR)
    return (["blimp", str(ckpt), "--data", str(data), "--out", str(tmp / "b")], [ckpt, data],
            "'probe.in' must be an integer, not text")


def _content_probe_store_meta_without_tokenizer_hash(tmp, fix):
    store = _copy(fix["store_dir"], tmp / "store")
    _edit_json(store / "meta.json", tokenizer_hash=None)
    return (["probe", str(fix["mlsm_ckpt"]), "--store", str(store), "--steps", "1", "--out",
             str(tmp / "p")], [store, fix["mlsm_ckpt"]],
            "'tokenizer_hash' is missing; it must be text")


def _content_targets_dictionary_meta_k_differs_from_atoms(tmp, fix):
    """A meta of another dictionary beside the weights was accepted (its lambda then used)."""
    weights = Path(shutil.copy(fix["dictionary_path"], tmp / "d.safetensors"))
    meta = _edit_json(Path(shutil.copy(fix["dictionary_path"].with_suffix(".json"),
                                       tmp / "d.json")), k=999)
    return (_targets(fix, tmp / "t", **{"--dictionary": str(weights)}), [meta, weights],
            "atoms but its meta d.json says k = 999")


def _content_pretrain_dictionary_atoms_all_zero(tmp, fix):
    """Zero atoms: every code zero, every position "no target", a run that learns nothing."""
    from safetensors.torch import load_file, save_file

    weights = Path(shutil.copy(fix["dictionary_path"], tmp / "d.safetensors"))
    shutil.copy(fix["dictionary_path"].with_suffix(".json"), tmp / "d.json")
    tensors = load_file(weights)
    save_file({"atoms": tensors["atoms"] * 0}, weights, metadata={"meta": "{}"})
    return (["pretrain", *_run_args(fix["store_dir"], tmp / "run", **{
        "objective.name": "mlsm", "objective.dictionary": str(weights),
        "objective.teacher": str(fix["teacher_dir"])})], [weights], "has only zero atoms")


def _content_targets_dictionary_meta_lam_not_a_number(tmp, fix):
    weights = Path(shutil.copy(fix["dictionary_path"], tmp / "d.safetensors"))
    meta = _edit_json(Path(shutil.copy(fix["dictionary_path"].with_suffix(".json"),
                                       tmp / "d.json")), lam="high")
    return (_targets(fix, tmp / "t", **{"--dictionary": str(weights)}), [meta],
            "'lam' must be a number, not text")


def _content_targets_dictionary_meta_without_lam(tmp, fix):
    weights = Path(shutil.copy(fix["dictionary_path"], tmp / "d.safetensors"))
    meta = _edit_json(Path(shutil.copy(fix["dictionary_path"].with_suffix(".json"),
                                       tmp / "d.json")), lam=None)
    return (_targets(fix, tmp / "t", **{"--dictionary": str(weights)}), [meta],
            'does not say the lambda it was learned with; add "lam": VALUE to its .json meta')


def _content_flops_dictionary_meta_layer_not_a_number(tmp, fix):
    weights = Path(shutil.copy(fix["dictionary_path"], tmp / "d.safetensors"))
    meta = _edit_json(Path(shutil.copy(fix["dictionary_path"].with_suffix(".json"),
                                       tmp / "d.json")), layer="last")
    return (["flops", "--teacher", str(fix["teacher_dir"]), "objective.name=mlsm",
             f"objective.dictionary={weights}"],
            [meta], "'layer' must be an integer, not text")


def _content_pretrain_resume_metrics_row_step_not_a_number(tmp, fix):
    """A resume keeps the logged rows up to its step: it dropped a hand-edited row for good."""
    args = _run_args(fix["store_dir"], tmp / "run")
    assert main(["pretrain", *args]) == 0
    rows = (tmp / "run" / "metrics.jsonl").read_text().splitlines()
    _write(tmp / "run" / "metrics.jsonl",
           "\n".join([json.dumps({**json.loads(rows[0]), "step": "1"}), *rows[1:]]) + "\n")
    return (["pretrain", "--resume", "auto", *args], [tmp / "run"],
            "metrics.jsonl:1 is not a row mlsm logged ('step' must be an integer, not text")


def _content_pretrain_target_store_meta_k_not_a_number(tmp, fix):
    targets = _copy(fix["fresh_targets"], tmp / "t")
    _edit_json(targets / "meta.json", k="many")
    return (["pretrain", *_run_args(fix["store_dir"], tmp / "run", **{
        "objective.name": "mlsm", "objective.targets": str(targets)})], [targets],
            "'k' must be an integer, not text")


def _study_in(tmp: Path, fix: dict, out: Path) -> Path:
    corpus = _copy(fix["corpus_dir"], tmp / "corpus")
    return _write(tmp / "s.yaml", f"corpus: {{sources: [{corpus}]}}\nout: {out}\n"
                  "arms: {a: {objective: {name: mlm}}}\n")


def _paths_study_out_is_the_corpus_folder(tmp, fix):
    study = _study_in(tmp, fix, tmp / "corpus")
    return ["study", str(study)], [tmp / "corpus"], "out " + str(tmp / "corpus") + " overlaps"


def _paths_study_out_is_a_corpus_file(tmp, fix):
    text = _write(tmp / "corpus.txt", "some text\n")
    study = _write(tmp / "s.yaml", f"corpus: {{sources: [{text}]}}\nout: {text}\n"
                   "arms: {a: {objective: {name: mlm}}}\n")
    return ["study", str(study)], [text], "out " + str(text) + " overlaps the corpus source"


def _paths_study_out_inside_the_corpus_folder(tmp, fix):
    study = _study_in(tmp, fix, tmp / "corpus" / "study")
    return ["study", str(study)], [tmp / "corpus"], "overlaps the corpus source"


@pytest.mark.parametrize(("record", "field"), [
    ('{"checkpoint": "x", "heldout_loss": 1.0, "unigram_loss": 2.0}', "'better_than_unigram'"),
    ('{"checkpoint": "x", "heldout_loss": "low", "unigram_loss": 2.0, '
     '"better_than_unigram": false}', "'heldout_loss'")])
def test_study_blimp_stage_names_a_probe_record_of_the_wrong_shape(
        record: str, field: str, corpus_dir: Path, tmp_path: Path) -> None:
    """The blimp stage of a latent arm reads its probe's probe.json: a hand-edited one was a bare
    KeyError / format error in status.json (the stage fails alone, so this is no CLI case)."""
    from mlsm.study.runner import Study
    from mlsm.study.spec import load_study
    from mlsm.study.stages import _blimp

    data = _blimp_dir(tmp_path, GOOD_PAIR)
    spec = _study(tmp_path, {"corpus_dir": corpus_dir},
                  f"arms: {{a: {{objective: {{name: mlsm}}}}}}\nblimp: {{data: [{data}]}}\n")
    study = Study(load_study(spec), log=lambda s: None)
    probe = _write(study.probe_dir("a", 1.0) / "probe.json", record)
    with pytest.raises(UserError) as info:
        _blimp(study, "a", 1.0)
    assert f"{probe} is not one mlsm wrote ({field}" in str(info.value), str(info.value)
    assert "--stages probe blimp" in str(info.value) and probe.read_text() == record


@pytest.mark.parametrize("saved", ["[1, 2]\n", "train: [steps]\n", "train: {steps: 1\n"])
def test_study_pretrain_stage_leaves_a_run_config_yaml_of_the_wrong_shape_to_pretrain(
        saved: str, corpus_dir: Path, tmp_path: Path) -> None:
    """A run's config.yaml the study compares with its arm's config: a list or a group that is no
    mapping was an AttributeError failing the arm; now, as a torn one, it is left to `pretrain`,
    which checks the checkpoint's config and rewrites config.yaml. A real difference still stops."""
    from mlsm.study.runner import Study, check_same_config
    from mlsm.study.spec import load_study

    spec = _study(tmp_path, {"corpus_dir": corpus_dir}, "arms: {a: {objective: {name: mlm}}}\n")
    study = Study(load_study(spec), log=lambda s: None)
    _write(study.run_dir("a") / "config.yaml", saved)
    check_same_config(study.run_dir("a"), "a", study.arm_config("a"))
    _write(study.run_dir("a") / "config.yaml", "train: {steps: 7}\n")
    with pytest.raises(UserError, match="train.steps is 1 in the study file but 7"):
        check_same_config(study.run_dir("a"), "a", study.arm_config("a"))


def test_rank_looks_for_its_text_before_loading_the_model(teacher_dir: Path,
                                                          tmp_path: Path) -> None:
    """In a real process (transformers' load report goes to the real stderr, which capsys does
    not see): the model was loaded, and its 14-line weight report printed, before `rank` found
    that --text does not exist."""
    from tests.test_bad_inputs import assert_one_line, run_cli

    done = run_cli(["rank", str(teacher_dir), "--text", str(tmp_path / "none.txt"), "--out",
                    str(tmp_path / "r")], cwd=tmp_path)
    assert_one_line(done.returncode, done.stderr, "text file", "none.txt")
    assert not (tmp_path / "r").exists()



# ------------------------------------------------------- the verbs and formats added 2026-11-26


def _paths_score_out_is_the_input(tmp, fix):
    text = _write(tmp / "in.txt", "the cat sat .\n")
    return (["score", str(fix["teacher_dir"]), str(text), "--out", str(text)], [text],
            "is the input INPUT")


def _content_score_jsonl_line_not_json(tmp, fix):
    text = _write(tmp / "in.jsonl", '{"text": "a b"}\nnot json\n')
    return (["score", str(fix["teacher_dir"]), str(text), "--out", str(tmp / "o.jsonl")], [text],
            "in.jsonl:2 is not JSON")


def _consistency_finetune_qrels_name_a_missing_document(tmp, fix):
    folder = tmp / "beir" / "scifact"
    _write(folder / "corpus.jsonl", '{"_id": "d1", "title": "", "text": "cells"}\n')
    _write(folder / "queries.jsonl", '{"_id": "q1", "text": "what cells"}\n')
    _write(folder / "qrels" / "test.tsv", "query-id\tcorpus-id\tscore\nq1\td9\t1\n")
    results = _write(tmp / "results.jsonl", "")
    return (["finetune", str(fix["teacher_dir"]), "--tasks", "scifact_zeroshot", "--data-dir",
             str(tmp / "beir"), "--results", str(results)], [folder, results],
            "test.tsv:2: corpus-id 'd9' is not in corpus.jsonl")


def _consistency_finetune_squad_answer_not_at_its_offset(tmp, fix):
    article = {"title": "T", "paragraphs": [{"context": "The cat sat on the mat.", "qas": [
        {"id": "q1", "question": "Where?", "answers": [{"text": "mat", "answer_start": 3}]}]}]}
    folder = tmp / "data" / "squad_v1.1"
    _write(folder / "dev-v1.1.json", json.dumps({"data": [article]}))
    _write(folder / "train-v1.1.json", json.dumps({"data": [article]}))
    results = _write(tmp / "results.jsonl", "")
    return (["finetune", str(fix["teacher_dir"]), "--tasks", "squad", "--data-dir",
             str(tmp / "data"), "--results", str(results)], [folder, results], "question q1")

# --------------------------------------------------------------------------- reuse
# A reuse that would return a stale result, as a user meets it: a finished output, then one of
# its inputs or settings changed under the same name. Each is refused in one line naming what
# differs, before anything is trained, and the finished output is left as it was.


def _finished(tmp: Path, fix: dict, model: Path | None = None) -> tuple[list[str], Path]:
    """A finished 1-seed, 2-step `finetune` cell on the toy RTE; (its argv, its results file)."""
    args = [*_finetune(fix, tmp, _glue(tmp), model=model), "--max-steps", "2"]
    assert main(args) == 0
    return args, tmp / "res.jsonl"


def _reuse_finetune_other_weight_decay(tmp, fix):
    args, results = _finished(tmp, fix)
    return ([*args, "--weight-decay", "0.1"], [results, tmp / "glue"],
            "(weight_decay: 0.01 -> 0.1); pass --recompute")


def _reuse_finetune_other_warmup_ratio(tmp, fix):
    args, results = _finished(tmp, fix)
    return ([*args, "--warmup-ratio", "0.5"], [results],
            "(warmup_ratio: 0.0 -> 0.5); pass --recompute")


def _reuse_finetune_other_clip(tmp, fix):
    args, results = _finished(tmp, fix)
    return [*args, "--clip", "0"], [results], "(clip: 1.0 -> 0.0); pass --recompute"


def _reuse_finetune_model_retrained_in_place(tmp, fix):
    """`rm -rf run` and pre-train again with another seed: same folder name, other weights."""
    run = [*_run_args(fix["store_dir"], tmp / "run", **{"train.steps": 1})]
    assert main(["pretrain", *run]) == 0
    model = list_checkpoints(tmp / "run")[-1][1]
    args, results = _finished(tmp, fix, model=model)
    shutil.rmtree(tmp / "run")
    assert main(["pretrain", *run, "train.seed=1"]) == 0
    return args, [results], ("(model files: '", "pass --recompute")


def _reuse_finetune_task_data_label_flipped(tmp, fix):
    args, results = _finished(tmp, fix)
    train = tmp / "glue" / "RTE" / "train.tsv"
    train.write_text(train.read_text().replace("entailment\n", "not_entailment\n", 1))
    return args, [results], ("(task data: '", "pass --recompute")


def _reuse_pretrain_resume_after_store_rebuilt(tmp, fix):
    """`mlsm prepare OTHER --out STORE --overwrite` under a run, then `pretrain --resume auto`."""
    corpus = fix["corpus_dir"]
    assert main(_prepare(fix, corpus / "a.txt", out=tmp / "store")) == 0
    args = _run_args(tmp / "store", tmp / "run", **{"train.steps": 2})
    assert main(["pretrain", *args]) == 0
    assert main(_prepare(fix, corpus / "b.jsonl.gz", out=tmp / "store")) == 0
    return (["pretrain", "--resume", "auto", *args], [tmp / "run"],
            ("(data.store: '", "rebuilt in place"))


def _reuse_pretrain_resume_after_dictionary_relearned(tmp, fix):
    """An MLSM run, then `mlsm dictionary --out D` again (another seed) under it, then
    `pretrain --resume auto`: the path is the same, the atoms are not."""
    assert main(_dictionary(fix, tmp / "d")) == 0
    extra = {"objective.name": "mlsm", "objective.dictionary": str(tmp / "d.safetensors"),
             "objective.teacher": str(fix["teacher_dir"]), "train.steps": 1}
    args = _run_args(fix["store_dir"], tmp / "run", **extra)
    assert main(["pretrain", *args]) == 0
    assert main([*_dictionary(fix, tmp / "d"), "--seed", "1"]) == 0
    return (["pretrain", "--resume", "auto", *args], [tmp / "run"],
            ("(objective.dictionary: '", "rebuilt in place"))


def _reuse_targets_teacher_retrained_in_place(tmp, fix):
    """A finished target store of a dictionary learned on its teacher, then the teacher folder
    re-trained in place (`rm -rf`, pre-train again with another seed, copy to the same path),
    then the same `mlsm targets`: the teacher's name, tokenizer and layer are the same, its
    weights and so its codes are not. The dictionary's recorded weights fingerprint refuses it
    (the store's build record, `teacher_weights`, would too, for a dictionary of an older mlsm)."""
    run = _run_args(fix["store_dir"], tmp / "run", **{"train.steps": 1})

    def train_teacher(*extra: str) -> None:
        shutil.rmtree(tmp / "run", ignore_errors=True)
        shutil.rmtree(tmp / "teacher", ignore_errors=True)
        assert main(["pretrain", *run, *extra]) == 0
        _copy(list_checkpoints(tmp / "run")[-1][1], tmp / "teacher")

    train_teacher()
    assert main(_dictionary({**fix, "teacher_dir": tmp / "teacher"}, tmp / "d.safetensors")) == 0
    args = _targets(fix, tmp / "t", **{"--teacher": str(tmp / "teacher"),
                                        "--dictionary": str(tmp / "d.safetensors")})
    assert main(args) == 0
    train_teacher("train.seed=1")
    return args, [tmp / "t"], ("learned on another teacher of this shape",
                               "learn a dictionary with this one")


def _pair_of_two_learnings(tmp: Path, fix: dict) -> Path:
    """D.safetensors of one `mlsm dictionary` and D.json of another with the same settings but
    another seed (two writers on one --out, or a kill between the two renames)."""
    assert main(_dictionary(fix, tmp / "d")) == 0
    assert main([*_dictionary(fix, tmp / "other"), "--seed", "1"]) == 0
    shutil.copy(tmp / "other.json", tmp / "d.json")
    return tmp / "d.safetensors"


def _reuse_targets_dictionary_pair_of_two_learnings(tmp, fix):
    weights = _pair_of_two_learnings(tmp, fix)
    return (_targets(fix, tmp / "t", **{"--dictionary": str(weights)}), [weights, tmp / "d.json"],
            "are of different dictionaries")


def _reuse_pretrain_dictionary_pair_of_two_learnings(tmp, fix):
    weights = _pair_of_two_learnings(tmp, fix)
    extra = {"objective.name": "mlsm", "objective.dictionary": str(weights),
             "objective.teacher": str(fix["teacher_dir"]), "train.steps": 1}
    return (["pretrain", *_run_args(fix["store_dir"], tmp / "run", **extra)],
            [weights, tmp / "d.json"], "are of different dictionaries")


# ------------------------------------------- reuse that read less than it depends on (#52)
# A reuse decision reads what it depends on: every byte of a file (never a sample), the target
# of a link, the teacher's weights for a dictionary. Each was fooled by a name or a part.


def _beir(folder: Path, qrels: Path) -> Path:
    """A BEIR scifact folder whose qrels/ is a link to `qrels` (a folder kept elsewhere)."""
    _write(folder / "corpus.jsonl", '{"_id": "d1", "title": "", "text": "cells grow"}\n'
           '{"_id": "d2", "title": "", "text": "rivers run"}\n')
    _write(folder / "queries.jsonl", '{"_id": "q1", "text": "what cells"}\n')
    folder.joinpath("qrels").symlink_to(qrels, target_is_directory=True)
    return folder


def _reuse_finetune_task_data_subfolder_link_swapped(tmp, fix):
    """The task folder's qrels/ is a link; pointed at other judgements, the finished zero-shot
    cell must not be reused (the walk did not follow links: the qrels were never hashed)."""
    for name, doc in (("qa", "d1"), ("qb", "d2")):
        _write(tmp / name / "test.tsv", f"query-id\tcorpus-id\tscore\nq1\t{doc}\t1\n")
    folder = _beir(tmp / "beir" / "scifact", tmp / "qa")
    args = ["finetune", str(fix["teacher_dir"]), "--tasks", "scifact_zeroshot", "--data-dir",
            str(tmp / "beir"), "--results", str(tmp / "res.jsonl"), "--max-len", "16"]
    assert main(args) == 0
    (folder / "qrels").unlink()
    (folder / "qrels").symlink_to(tmp / "qb", target_is_directory=True)
    return args, [tmp / "res.jsonl"], ("(task data: '", "pass --recompute")


def _reuse_targets_dictionary_json_stripped_of_its_teacher(tmp, fix):
    """The .json beside the atoms with the teacher's weights fingerprint deleted: the check
    against the teacher then passed any teacher of the shape, though the atoms' own header
    records it."""
    weights = Path(shutil.copy(fix["dictionary_path"], tmp / "d.safetensors"))
    meta = json.loads(fix["dictionary_path"].with_suffix(".json").read_text())
    del meta["teacher_weights"]
    _write(tmp / "d.json", json.dumps(meta))
    return (_targets(fix, tmp / "t", **{"--dictionary": str(weights)}), [weights, tmp / "d.json"],
            ("are of different dictionaries", "teacher_weights"))


def _other_teacher_of_this_shape(tmp: Path, fix: dict) -> Path:
    """A copy of the fixture teacher with every weight nudged: same shape, another teacher."""
    from safetensors.torch import load_file, save_file

    teacher = _copy(fix["teacher_dir"], tmp / "teacher_b")
    weights = load_file(teacher / "model.safetensors")
    save_file({k: v + 0.01 if v.is_floating_point() else v for k, v in weights.items()},
              teacher / "model.safetensors", metadata={"format": "pt"})
    return teacher


def _reuse_pretrain_naive_dictionary_of_another_teacher(tmp, fix):
    """`mlsm_naive` (the official code's recipe) checked d and layer only: a dictionary learned
    on another teacher of the same shape trained on, where `mlsm` refuses in one line."""
    extra = {"objective.name": "mlsm_naive", "objective.dictionary": str(fix["dictionary_path"]),
             "objective.teacher": str(_other_teacher_of_this_shape(tmp, fix)), "train.steps": 1}
    return (["pretrain", *_run_args(fix["store_dir"], tmp / "run", **extra)], [tmp / "teacher_b"],
            "learned on another teacher of this shape")


# --------------------------------------------------------------------------- bounds (#52)
# Every reader of a user file bounds what it holds before any work: a document, a whole JSON
# file, a nesting depth, a grade. Each ran out of memory, hit Python's recursion limit or a C
# extension's int before; now one line names the limit (`mlsm.limits`).


def _squad(tmp: Path, dev: str) -> list[str]:
    folder = tmp / "data" / "squad_v1.1"
    _write(folder / "dev-v1.1.json", dev)
    _write(folder / "train-v1.1.json", dev)
    return ["finetune", "--tasks", "squad", "--data-dir", str(tmp / "data"), "--results",
            str(tmp / "results.jsonl"), "--max-len", "32"]


def _squad_article(context: str) -> str:
    return json.dumps({"data": [{"title": "T", "paragraphs": [{"context": context, "qas": [
        {"id": "q1", "question": "Where?", "answers": [{"text": "cat", "answer_start": 4}]}]}]}]})


def _bounds_finetune_squad_context_beyond_the_document_bound(tmp, fix):
    from mlsm.limits import MAX_DOC_BYTES

    args = _squad(tmp, _squad_article("The cat " + "sat " * (MAX_DOC_BYTES // 4)))
    return ([args[0], str(fix["teacher_dir"]), *args[1:]], [tmp / "data"],
            ("a context of 'T' is", f"{MAX_DOC_BYTES:,}"))


def _bounds_finetune_squad_file_nested_too_deep(tmp, fix):
    args = _squad(tmp, '{"data": ' + "[" * 100_000)
    return ([args[0], str(fix["teacher_dir"]), *args[1:]], [tmp / "data"],
            "v1.1.json:1 is not JSON (nested deeper than the parser follows")


def _beir_args(tmp: Path, fix: dict) -> list[str]:
    return ["finetune", str(fix["teacher_dir"]), "--tasks", "scifact_zeroshot", "--data-dir",
            str(tmp / "beir"), "--results", str(tmp / "results.jsonl"), "--max-len", "16"]


def _bounds_finetune_beir_document_beyond_the_document_bound(tmp, fix):
    from mlsm.limits import MAX_DOC_BYTES

    folder = tmp / "beir" / "scifact"
    long = json.dumps({"_id": "d2", "title": "", "text": "cells " * (MAX_DOC_BYTES // 6 + 1)})
    _write(folder / "corpus.jsonl", '{"_id": "d1", "title": "", "text": "cells"}\n' + long + "\n")
    _write(folder / "queries.jsonl", '{"_id": "q1", "text": "what cells"}\n')
    _write(folder / "qrels" / "test.tsv", "query-id\tcorpus-id\tscore\nq1\td1\t1\n")
    return _beir_args(tmp, fix), [folder], ("corpus.jsonl:2 is longer than", f"{MAX_DOC_BYTES:,}")


def _bounds_finetune_qrels_grade_absurd(tmp, fix):
    folder = tmp / "beir" / "scifact"
    _write(folder / "corpus.jsonl", '{"_id": "d1", "title": "", "text": "cells"}\n')
    _write(folder / "queries.jsonl", '{"_id": "q1", "text": "what cells"}\n')
    _write(folder / "qrels" / "test.tsv", "query-id\tcorpus-id\tscore\nq1\td1\t1e30\n")
    return _beir_args(tmp, fix), [folder], ("test.tsv:2: grade 1e+30 is beyond", "1,000")


def _bounds_score_jsonl_line_nested_too_deep(tmp, fix):
    # deep enough for the parser's recursion limit, short enough for the line's read bound
    text = _write(tmp / "in.jsonl", '{"text": "a b"}\n{"text": ' + "[" * 1000 + "\n")
    return (["score", str(fix["teacher_dir"]), str(text), "--out", str(tmp / "o.jsonl")], [text],
            "in.jsonl:2 is not JSON (nested deeper")


def _bounds_blimp_line_nested_too_deep(tmp, fix):
    data = _blimp_dir(tmp, "[" * 100_000)
    return (["blimp", str(fix["teacher_dir"]), "--data", str(data), "--out", str(tmp / "b")],
            [data], "nested deeper than the parser follows")


# ---- fixes printed as commands (#52 item 7): tests/test_fix_hints.py runs each as printed


def _mlsm_run_copy(tmp: Path, fix: dict) -> Path:
    """A copy of the 2-step MLSM run, without any probe run an earlier case left in it."""
    run = _copy(fix["mlsm_ckpt"].parent.parent, tmp / "mlsm-run")
    for probe in run.glob("probe-*"):
        shutil.rmtree(probe)
    return run


def _consistency_blimp_mlsm_run_without_its_probe(tmp, fix):
    run, data = _mlsm_run_copy(tmp, fix), _blimp_dir(tmp, GOOD_PAIR)
    return (["blimp", str(run), "--data", str(data), "--out", str(tmp / "b")], [run, data],
            "train its probe first: mlsm probe")


def _consistency_blimp_run_whose_probe_is_unfinished(tmp, fix):
    """A probe run through the loop (--steps 2) stopped after its first step: blimp finds it as
    the run's probe and refuses it, naming the command that finishes it."""
    run, data = _mlsm_run_copy(tmp, fix), _blimp_dir(tmp, GOOD_PAIR)
    assert main(["probe", str(run), "--steps", "2", "train.save_every=1", "train.batch_size=4",
                 "train.threads=1"]) == 0
    probe_run = next(run.glob("probe-*"))
    shutil.rmtree(list_checkpoints(probe_run)[-1][1])
    return (["blimp", str(run), "--data", str(data), "--out", str(tmp / "b")], [run, data],
            ("is not finished (newest checkpoint step-1 of 2", "--resume auto"))


def _content_blimp_run_whose_probe_record_is_torn(tmp, fix):
    """A probe run resolves to the checkpoint its probe.json names (a refit killed before pruning
    leaves two): a torn record is one line naming it, not a guess at the newest checkpoint."""
    run, data = _mlsm_run_copy(tmp, fix), _blimp_dir(tmp, GOOD_PAIR)
    assert main(["probe", str(run), "--max-steps", "4", "--eval-every", "2", "--select-steps",
                 "0", "--heldout-batches", "1", "--batch-size", "4"]) == 0
    record = next(run.glob("probe-*")) / "probe.json"
    _write(record, record.read_bytes()[:20])
    return (["blimp", str(run), "--data", str(data), "--out", str(tmp / "b")], [run, data],
            ("probe.json", "delete it and train the probe again"))


def _consistency_score_run_unfinished(tmp, fix):
    run = _copy(fix["mlm_run"], tmp / "run")
    shutil.rmtree(list_checkpoints(run)[-1][1])  # stopped after step 4 of 8
    text = _write(tmp / "in.txt", "the cat sat .\n")
    return (["score", str(run), str(text), "--out", str(tmp / "o.jsonl")], [run, text],
            ("is not finished (newest checkpoint step-4 of 8", "--resume auto"))


def _content_blimp_checkpoint_of_mlsm_0_1_0(tmp, fix):
    """A run whose checkpoint.json files lack the facts mlsm 0.1.0 did not write."""
    run = _copy(fix["teacher_dir"].parent.parent, tmp / "old")
    for _, folder in list_checkpoints(run):
        info = json.loads((folder / "checkpoint.json").read_text())
        for key in ("latent_head", "pll_refusal"):
            info.pop(key, None)
        _write(folder / "checkpoint.json", json.dumps(info))
    data = _blimp_dir(tmp, GOOD_PAIR)
    return (["blimp", str(run), "--data", str(data), "--out", str(tmp / "b")], [data],
            ("mlsm 0.1.0 wrote neither", f"mlsm migrate {run}"))


# ---- #52 item 7: a sentence beyond the model's positions; a dictionary that names no teacher


def _short_model(tmp: Path, fix: dict, positions: int = 16) -> Path:
    """A masked LM of the fixture's vocabulary with only `positions` position embeddings."""
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    tok = AutoTokenizer.from_pretrained(str(fix["tokenizer_dir"]))
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=positions)
    BertForMaskedLM(config).save_pretrained(tmp / "short")
    tok.save_pretrained(tmp / "short")
    return tmp / "short"


def _bounds_blimp_sentence_beyond_the_model_positions(tmp, fix):
    model, long = _short_model(tmp, fix), " ".join(["the cat sat"] * 20)
    data = _blimp_dir(tmp, json.dumps({"sentence_good": long + " .", "sentence_bad": "cat ."}))
    return (["blimp", str(model), "--data", str(data), "--out", str(tmp / "b")], [model, data],
            ("toy pair 0: sentence_good has", "more than the model's 16 positions"))


def _teacherless_dictionary(tmp: Path, fix: dict) -> Path:
    """The fixture's atoms in a safetensors file of no meta, beside a .json written by hand that
    names no teacher: before, any teacher of the same width and layer took it."""
    from safetensors.torch import load_file, save_file

    weights = tmp / "d.safetensors"
    save_file({"atoms": load_file(str(fix["dictionary_path"]))["atoms"]}, str(weights))
    _write(tmp / "d.json", json.dumps({"lam": 0.05, "layer": 1, "k": 64}))
    return weights


def _consistency_targets_dictionary_naming_no_teacher(tmp, fix):
    weights = _teacherless_dictionary(tmp, fix)
    return (_targets(fix, tmp / "t", **{"--dictionary": str(weights)}), [weights, tmp / "d.json"],
            (f"dictionary {weights} names no teacher", "mlsm dictionary --store STORE --teacher"))


def _consistency_pretrain_dictionary_naming_no_teacher(tmp, fix):
    weights = _teacherless_dictionary(tmp, fix)
    extra = {"objective.name": "mlsm", "objective.dictionary": str(weights),
             "objective.teacher": str(fix["teacher_dir"])}
    return (["pretrain", *_run_args(fix["store_dir"], tmp / "run", **extra)], [weights],
            f"dictionary {weights} names no teacher")


# ---- #52 re-test: bounds at every loader, export sources, paths taken literally


def _alias_bomb(levels: int = 7) -> str:
    """Nested lists of nine aliases each: a few hundred bytes standing for 9**levels values
    (PyYAML builds shared references; the first reader to walk them expanded them all)."""
    parts, prev = ["&a [1, 1, 1, 1, 1, 1, 1, 1, 1]"], "a"
    for i in range(1, levels):
        name = chr(ord("a") + i)
        parts.append(f"&{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
        prev = name
    return "[" + ", ".join(parts) + "]"


def _bounds_pretrain_config_yaml_alias_bomb(tmp, fix):
    config = _write(tmp / "c.yaml", f"train: {{steps: {_alias_bomb()}}}\n")
    return (["pretrain", "--config", str(config)], [config],
            ("c.yaml is not valid YAML (its aliases expand to more than 1,000,000 values",
             "MAX_YAML_NODES"))


def _bounds_pretrain_override_alias_bomb(tmp, fix):
    return (["pretrain", *_run_args(fix["store_dir"], tmp / "run"), f"train.steps={_alias_bomb()}"],
            [fix["store_dir"]], "the value is not valid YAML (its aliases expand to more than")


def _bounds_study_file_nested_too_deep(tmp, fix):
    study = _write(tmp / "s.yaml", "out: " + "[" * 100_000 + "\n")
    return (["study", str(study)], [study], "s.yaml is not valid YAML (nested deeper than")


def _bounds_blimp_gzip_of_one_line_beyond_the_document_bound(tmp, fix):
    """A small gzip of one line longer than MAX_DOC_BYTES: read whole before (a 400 KB gzip of a
    400 MB line took 1.3 GB), now refused after MAX_DOC_BYTES characters."""
    import gzip

    from mlsm.limits import MAX_DOC_BYTES

    data = tmp / "blimp"
    data.mkdir()
    with gzip.open(data / "toy.jsonl.gz", "wb", compresslevel=1) as f:
        f.write(b'{"sentence_good": "the cat .", "sentence_bad": "' + b"cat " * (MAX_DOC_BYTES // 4)
                + b'"}\n')
    return (["blimp", str(fix["teacher_dir"]), "--data", str(data), "--out", str(tmp / "b")],
            [data], ("toy.jsonl.gz:1 is longer than", f"{MAX_DOC_BYTES:,}", "MAX_DOC_BYTES"))


def _bounds_rank_sentence_beyond_the_sentence_bound(tmp, fix):
    """A line of more than MAX_SENTENCE_CHARS was tokenised whole (a 400 MB line of a small gzip
    took 17 GB before it was killed); now one line, read that far only."""
    from mlsm.limits import MAX_SENTENCE_CHARS

    text = _write(tmp / "s.txt", "the cat sat .\n" + "cat " * (MAX_SENTENCE_CHARS // 4 + 1) + "\n")
    return (["rank", str(fix["teacher_dir"]), "--text", str(text), "--out", str(tmp / "r")],
            [text], ("s.txt:2 is longer than", f"{MAX_SENTENCE_CHARS:,}"))


def _bounds_finetune_glue_row_beyond_the_document_bound(tmp, fix):
    """A TSV row of sixteen million tabs: csv made sixteen million fields of it before."""
    from mlsm.limits import MAX_DOC_BYTES

    data = _glue(tmp, "index\tsentence1\tsentence2\tlabel\n" + "\t" * (MAX_DOC_BYTES + 1) + "\n")
    return (_finetune(fix, tmp, data), [data], ("train.tsv:2 is longer than", f"{MAX_DOC_BYTES:,}"))


def _bounds_finetune_conll_gzip_of_one_line_beyond_the_document_bound(tmp, fix):
    import gzip

    from mlsm.limits import MAX_DOC_BYTES

    folder = tmp / "data" / "conll2003"
    folder.mkdir(parents=True)
    good = b"EU NNP B-NP B-ORG\nrejects VBZ B-VP O\n\n"
    for split in ("train", "valid", "test"):
        with gzip.open(folder / f"{split}.txt.gz", "wb", compresslevel=1) as f:
            f.write(good + (b"x" * (MAX_DOC_BYTES + 1) + b"\n" if split == "train" else b""))
    return (_finetune(fix, tmp, tmp / "data", tasks="conll2003"), [folder],
            ("train.txt.gz:4 is longer than", f"{MAX_DOC_BYTES:,}"))


def _bounds_finetune_refusal_quoting_a_huge_id_is_clipped(tmp, fix):
    """A refusal that quotes the user's input (a qrels query-id of 100,000 characters) printed
    all of it on its one line; the middle is left out now, the file and the fix kept."""
    folder = tmp / "beir" / "scifact"
    _write(folder / "corpus.jsonl", '{"_id": "d1", "title": "", "text": "cells"}\n')
    _write(folder / "queries.jsonl", '{"_id": "q1", "text": "what cells"}\n')
    _write(folder / "qrels" / "test.tsv", f"query-id\tcorpus-id\tscore\n{'q' * 100_000}\td1\t1\n")
    return _beir_args(tmp, fix), [folder], ("test.tsv:2: query-id", "characters left out",
                                            "or add that query to")


def _model_with_config(tmp: Path, fix: dict, **changes: object) -> Path:
    model = _copy(fix["teacher_dir"], tmp / "model")
    config = json.loads((model / "config.json").read_text())
    _write(model / "config.json", json.dumps({**config, **changes}))
    return model


def _content_blimp_config_json_claims_fewer_layers_than_its_weights(tmp, fix):
    """num_hidden_layers: 0 beside weights of more layers loaded an encoder of no layer and
    scored it, exit 0 (the parameter check compares only a config that claims too much)."""
    model, data = _model_with_config(tmp, fix, num_hidden_layers=0), _blimp_dir(tmp, GOOD_PAIR)
    return (["blimp", str(model), "--data", str(data), "--out", str(tmp / "b")], [model, data],
            ("says num_hidden_layers = 0 but model.safetensors holds", "encoder layers"))


def _content_blimp_config_json_size_not_an_integer(tmp, fix):
    """huggingface_hub's typed config fields raised StrictDataclassFieldValidationError, an
    internal error."""
    model, data = _model_with_config(tmp, fix, intermediate_size=1.5), _blimp_dir(tmp, GOOD_PAIR)
    return (["blimp", str(model), "--data", str(data), "--out", str(tmp / "b")], [model, data],
            ("cannot load a model", "intermediate_size"))


def _content_rank_config_json_zero_attention_heads(tmp, fix):
    model = _model_with_config(tmp, fix, num_attention_heads=0)
    text = _write(tmp / "s.txt", "the cat sat .\n")
    return (["rank", str(model), "--text", str(text), "--out", str(tmp / "r")], [model, text],
            ("cannot load a model", "modulo by zero"))


def _paths_blimp_data_file_is_a_fifo(tmp, fix):
    """A FIFO named toy.jsonl: blimp waited forever for a writer."""
    import os

    data = tmp / "blimp"
    data.mkdir()
    os.mkfifo(data / "toy.jsonl")
    return (["blimp", str(fix["teacher_dir"]), "--data", str(data), "--out", str(tmp / "b")],
            [data], "toy.jsonl is a FIFO, not a file")


def _paths_export_tokenizer_is_a_fifo(tmp, fix):
    """A FIFO named tokenizer.json was left out of the export without a word (exit 0, and the
    card said it loads with from_pretrained)."""
    import os

    ckpt = _copy(fix["teacher_dir"], tmp / "ckpt")
    (ckpt / "tokenizer.json").unlink()
    os.mkfifo(ckpt / "tokenizer.json")
    return (["export", str(ckpt), "--out", str(tmp / "export")], [ckpt],
            "tokenizer.json is a FIFO, not a file")


def _paths_export_weights_link_to_nothing(tmp, fix):
    ckpt = _copy(fix["teacher_dir"], tmp / "ckpt")
    (ckpt / "vocab.txt").symlink_to(tmp / "gone.txt")
    return (["export", str(ckpt), "--out", str(tmp / "export")], [ckpt],
            ("vocab.txt is a link to", "which does not exist"))


def _paths_study_out_with_a_line_break(tmp, fix):
    """A study's out holding a line break: the store stage ran into `st\\nx`, then every run
    refused its train.out; now refused before any stage."""
    study = _write(tmp / "s.yaml", f"out: \"{tmp}/st\\nx\"\ncorpus: {{sources: "
                   f"[{fix['corpus_dir'] / 'a.txt'}]}}\nbase: {{data: {{max_len: 16}}, train: "
                   "{steps: 1, batch_size: 4}}\nreadiness: [1.0]\narms: {mlm: {objective: "
                   "{name: mlm}}}\nfinetune: {tasks: []}\n")
    return (["study", str(study), "--stages", "store", "pretrain"], [tmp],
            ("st\\nx' holds a line break", "nothing was written"))


def _paths_study_out_with_a_nul_byte(tmp, fix):
    study = _write(tmp / "s.yaml", f"out: \"{tmp}/st\\0x\"\ncorpus: {{sources: "
                   f"[{fix['corpus_dir'] / 'a.txt'}]}}\n"
                   "arms: {mlm: {objective: {name: mlm}}}\n")
    return (["study", str(study)], [tmp], "study.out holds a NUL byte")


def _bounds_dictionary_max_len_beyond_the_teacher_positions(tmp, fix):
    args = _dictionary(fix, tmp / "d")
    args[args.index("--max-len") + 1] = "100000"
    return (args, [fix["store_dir"]], ("--max-len 100000 is longer than the",
                                       "positions of the teacher"))


def _bounds_targets_max_len_beyond_the_teacher_positions(tmp, fix):
    return (_targets(fix, tmp / "t", **{"--max-len": "100000"}), [fix["store_dir"]],
            ("--max-len 100000 is longer than the", "positions of the teacher"))


def _bounds_pretrain_mlsm_max_len_beyond_the_teacher_positions(tmp, fix):
    extra = {"objective.name": "mlsm", "objective.dictionary": str(fix["dictionary_path"]),
             "objective.teacher": str(fix["teacher_dir"]), "data.max_len": 100000}
    return (["pretrain", *_run_args(fix["store_dir"], tmp / "run", **extra)], [fix["store_dir"]],
            ("data.max_len 100000 is longer than the", "positions of the teacher"))


def _bounds_compare_results_line_beyond_the_row_bound(tmp, fix):
    """A results.jsonl whose last line is one 'row' longer than MAX_ROW_BYTES: read whole
    before, and skipped as torn (exit 0); refused now after MAX_ROW_BYTES bytes."""
    from mlsm.limits import MAX_ROW_BYTES

    results = _write(tmp / "r.jsonl", _rows('{"model": "' + "a" * MAX_ROW_BYTES + "\n"))
    return (["compare", str(results), "--out", str(tmp / "c")], [results],
            ("r.jsonl:7 is longer than", f"{MAX_ROW_BYTES:,} bytes", "MAX_ROW_BYTES"))


def _bounds_rank_tokenizer_json_beyond_the_model_json_bound(tmp, fix):
    """A model folder's tokenizer.json of hundreds of MB (sparse here: no disk is used) was read
    whole by the vocabulary check; refused now from its size, before it is read."""
    import os

    from mlsm.limits import MAX_MODEL_JSON_BYTES

    model = _copy(fix["teacher_dir"], tmp / "model")
    os.truncate(model / "tokenizer.json", MAX_MODEL_JSON_BYTES + 1)
    text = _write(tmp / "s.txt", "the cat sat .\n")
    return (["rank", str(model), "--text", str(text), "--out", str(tmp / "r")], [model, text],
            ("tokenizer.json is", f"beyond the {MAX_MODEL_JSON_BYTES:,}", "MAX_MODEL_JSON_BYTES"))


# Paths are taken literally or refused: a control character in any flag or positional is one
# line naming it (`cli.args.control_problem`), and a refusal never prints one raw (`printable`).
_CONTROL_REFUSED = "holds a line break or another control character"


def _paths_compare_out_with_a_terminal_escape(tmp, fix):
    """--out holding ESC: compare wrote a folder of that name (exit 0)."""
    results = _write(tmp / "r.jsonl", _rows())
    return (["compare", str(results), "--out", f"{tmp}/c\x1b[31mx"], [tmp],
            ("argument --out: ", "c\\x1b[31mx'", _CONTROL_REFUSED))


def _paths_targets_store_with_a_nul_byte(tmp, fix):
    """--store holding NUL: refused as "not found", with the NUL printed raw in the fix."""
    return (_targets(fix, tmp / "t", **{"--store": f"{fix['store_dir']}\0x"}),
            [fix["store_dir"]], ("argument --store: ", "\\x00x'", _CONTROL_REFUSED))


def _paths_blimp_model_with_a_line_break(tmp, fix):
    """A positional (the model) holding a line break, the last character of a pasted path."""
    return (["blimp", f"{fix['teacher_dir']}\n", "--out", str(tmp / "b")], [fix["teacher_dir"]],
            ("argument model: ", "\\n'", _CONTROL_REFUSED))


def _paths_pretrain_config_store_with_a_terminal_escape(tmp, fix):
    """data.store of a recipe holding ESC is taken literally (not found), and the refusal that
    quotes it twice writes the ESC as \\x1b, not into the terminal."""
    recipe = _write(tmp / "c.yaml", f'data: {{store: "{tmp}/st\\x1bore"}}\n'
                    f"train: {{steps: 1, out: {tmp / 'run'}}}\n")
    return (["pretrain", "--config", str(recipe)], [recipe],
            ("st\\x1bore not found", "--out " + f"{tmp}/st\\x1bore`"))


CASES = {name[1:]: fn for name, fn in sorted(globals().items())
         if name.startswith(("_content_", "_values_", "_consistency_", "_paths_", "_reuse_",
                             "_bounds_"))}


def test_every_class_is_tried_on_several_verbs() -> None:
    for kind in ("content", "values", "consistency", "paths", "reuse", "bounds"):
        verbs = {name.split("_")[1] for name in CASES if name.startswith(kind)}
        assert len(verbs) >= 3, (kind, verbs)


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_input_is_one_line_and_nothing_is_lost(name: str, fx: dict,  # noqa: F811
                                                      tmp_path: Path, capsys) -> None:
    args, protect, needle = CASES[name](tmp_path, fx)
    before = {str(p): _tree(p) for p in protect}
    capsys.readouterr()
    line = _one_line_error(main(args), capsys.readouterr().err)
    check_hint_is_tried(name, line)
    assert not re.search(r"[\x00-\x1f\x7f-\x9f]", line), f"raw control character: {line!r}"
    for part in (needle,) if isinstance(needle, str) else needle:  # a tuple: each must be there
        assert part in line, line
    assert {str(p): _tree(p) for p in protect} == before, "user files changed"


# --------------------------------------------------------------------------- the Python API


def _api_cases(fix: dict, tmp: Path) -> dict:
    from mlsm import (
        compare_runs,
        finetune,
        learn_dictionary,
        prepare_corpus,
        pretrain,
        score_pll,
        sparse_encode,
    )
    from mlsm.evaluate.probe.probe import load_scorer
    from mlsm.evaluate.zeroshot.pll import load_masked_lm

    def pll(sentences: list) -> None:
        model, tok = load_masked_lm(str(fix["teacher_dir"]))
        score_pll(model, tok, sentences)

    glue = _glue(tmp)
    tiny = {"data_dir": glue, "results": tmp / "r.jsonl", "seeds": [0], "max_len": 16}
    return {
        "prepare_corpus sources=None": (
            lambda: prepare_corpus(None, str(fix["tokenizer_dir"]), tmp / "s"), "sources"),
        "prepare_corpus num_proc=0": (
            lambda: prepare_corpus(str(fix["corpus_dir"]), str(fix["tokenizer_dir"]), tmp / "s",
                                   num_proc=0), "--num-proc"),
        "learn_dictionary teacher=path": (
            lambda: learn_dictionary(fix["store_dir"], str(fix["teacher_dir"]), k=8), "Teacher"),
        "sparse_encode numpy": (
            lambda: sparse_encode(np.ones((2, 4)), torch.ones(4, 8), 0.1), "torch tensor"),
        "sparse_encode integer tensor": (
            lambda: sparse_encode(torch.ones(2, 4, dtype=torch.long), torch.ones(4, 8), 0.1),
            "floating-point"),
        "pretrain dict": (lambda: pretrain({"train": {"steps": 1}}), "RunConfig"),
        "finetune models=str": (lambda: finetune(str(fix["teacher_dir"]), ["rte"], **tiny),
                                "must be a list"),
        "finetune epochs=True": (lambda: finetune([str(fix["teacher_dir"])], ["rte"], epochs=True,
                                                  **tiny), "finetune.epochs must be an integer"),
        "score_pll None sentence": (lambda: pll(["the cat .", None]), "sentence 1"),
        "compare_runs list line": (
            lambda: compare_runs(_write(tmp / "c.jsonl", _rows("[1]\n"))), "c.jsonl:7"),
        "load_masked_lm mae_lm": (lambda: load_masked_lm(str(fix["unscored_ckpts"]["mae_lm"])),
                                  "mlsm finetune"),
        "load_scorer mae_mlsm": (lambda: load_scorer(fix["unscored_ckpts"]["mae_mlsm"]),
                                 "mlsm finetune"),
    }


API = ["prepare_corpus sources=None", "prepare_corpus num_proc=0", "learn_dictionary teacher=path",
       "sparse_encode numpy", "sparse_encode integer tensor", "pretrain dict",
       "finetune models=str", "finetune epochs=True", "score_pll None sentence",
       "compare_runs list line", "load_masked_lm mae_lm", "load_scorer mae_mlsm"]


@pytest.mark.parametrize("case", API)
def test_api_refuses_hostile_input_with_a_user_error(case: str, fx: dict,  # noqa: F811
                                                      tmp_path: Path) -> None:
    call, needle = _api_cases(fx, tmp_path)[case]
    with pytest.raises(UserError) as info:
        call()
    assert needle in str(info.value) and "\n" not in str(info.value), str(info.value)


# --------------------------------------------------------------------------- a full disk

# Each verb writes once with room, then again with the file-size limit of a full disk
# (RLIMIT_FSIZE: writes past it fail with EFBIG, as ENOSPC would): one line, and the first
# output is still whole.
FULL = {
    "compare": (["compare", "{results}", "--out", "{out}"], 300),
    "report": (["report", "{results}", "--out", "{out}"], 3000),
    "train-tokenizer": (["train-tokenizer", "{corpus}/a.txt", "--out", "{out}", "--vocab-size",
                         "100"], 2000),
}
_LIMITED = ("import resource, sys; n = int(sys.argv[1]); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (n, n)); "
            "from mlsm.cli import main; sys.exit(main(sys.argv[2:]))")


@pytest.mark.parametrize("verb", list(FULL))
def test_full_disk_is_one_line_and_keeps_the_earlier_output(verb: str, corpus_dir: Path,
                                                           tmp_path: Path) -> None:
    template, limit = FULL[verb]
    results = _write(tmp_path / "r.jsonl", _rows())
    out = tmp_path / "out"
    args = [a.format(results=results, out=out, corpus=corpus_dir) for a in template]

    def run(limit: int) -> subprocess.CompletedProcess:
        env = {**ENV, "TOKENIZERS_PARALLELISM": "false"}
        return subprocess.run([sys.executable, "-c", _LIMITED, str(limit), *args], env=env,
                              capture_output=True, text=True, timeout=300)

    assert run(10**9).returncode == 0
    before = _tree(out)
    proc = run(limit)
    _one_line_error(proc.returncode, proc.stderr)
    assert _tree(out) == before
    assert not [p for p in tmp_path.rglob(".*") if not p.name.endswith(".lock")], "temp left"
