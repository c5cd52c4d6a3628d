"""One helper per concept: each shared check, write and loader behaves alike from every caller."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, BertConfig, BertModel

from mlsm.data.corpus import TokenStore
from mlsm.errors import UserError
from mlsm.teacher.dictionary import collect_vectors
from mlsm.teacher.targets import build_target_store
from mlsm.teacher.teacher import default_teacher_path, load_teacher


def _teacher_with(tokenizer, out: Path) -> Path:
    """A tiny random BERT encoder saved with `tokenizer`."""
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1,
                         num_attention_heads=2, intermediate_size=64)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# ----------------------------------------------------------------------- tokenizer agreement


def test_tokenizer_refusal_is_one_message_from_dictionary_and_targets(
        store_dir, dictionary_path, tmp_path) -> None:
    foreign = _teacher_with(AutoTokenizer.from_pretrained(default_teacher_path()), tmp_path / "t")
    teacher = load_teacher(str(foreign), layer=1)
    with pytest.raises(UserError) as by_dictionary:
        collect_vectors(teacher, TokenStore.open(store_dir), 10)
    with pytest.raises(UserError) as by_targets:
        build_target_store(store_dir, dictionary_path, teacher, 32, tmp_path / "targets")
    message = str(by_dictionary.value)
    assert message == str(by_targets.value)
    assert str(foreign) in message and str(store_dir) in message  # both sides named
    assert f"--tokenizer {foreign}" in message and "mlsm prepare" in message  # and the fix


def test_same_vocabulary_other_normaliser_is_another_tokenizer(store_dir, tmp_path) -> None:
    """"Same tokenizer" means the store's hash (vocabulary + normaliser + pre-tokeniser), so a
    lowercasing copy of the store's tokenizer (same vocabulary) is refused by the dictionary too."""
    store = TokenStore.open(store_dir)
    tok = store.load_tokenizer()
    tok.save_pretrained(tmp_path / "tok")
    spec = json.loads((tmp_path / "tok" / "tokenizer.json").read_text())
    spec["normalizer"]["lowercase"] = not spec["normalizer"]["lowercase"]
    (tmp_path / "tok" / "tokenizer.json").write_text(json.dumps(spec))
    lowered = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert lowered.get_vocab() == tok.get_vocab()
    teacher = load_teacher(str(_teacher_with(lowered, tmp_path / "t")), layer=1)
    with pytest.raises(UserError, match="tokenises differently"):
        collect_vectors(teacher, store, 10)


# ------------------------------------------------------------------------------ atomic folders


def test_building_dir_failure_keeps_the_old_folder_and_leaves_nothing(tmp_path) -> None:
    from mlsm.fileio import building_dir

    target = tmp_path / "out"
    target.mkdir()
    (target / "a.txt").write_text("old")
    with pytest.raises(RuntimeError, match="disk full"), building_dir(target, "partial") as tmp:
        (tmp / "a.txt").write_text("half")
        raise RuntimeError("disk full")
    assert (target / "a.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    with building_dir(target, "partial") as tmp:
        (tmp / "a.txt").write_text("new")
    assert (target / "a.txt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# ------------------------------------------------------------------------------- HF logging


def test_teacher_load_shows_no_loading_weights_bar(teacher_dir, capfd) -> None:
    """The study log showed a "Loading weights" bar per teacher load; mlsm.hf.quiet turns HF's bars
    off for the load and restores the caller's setting afterwards."""
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar()
    capfd.readouterr()
    load_teacher(str(teacher_dir), layer=1)
    assert "Loading weights" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled()


# -------------------------------------------------------------------------- latent head


def test_latent_head_is_read_back_exactly_and_a_shared_head_is_refused(tmp_path) -> None:
    from safetensors.torch import save_file

    from mlsm.models.heads import LatentHead, read_latent_head

    torch.manual_seed(0)
    head = LatentHead(8, 12)
    state = {f"latent.{k}": v for k, v in head.state_dict().items()}
    save_file({**state, "probe.weight": torch.zeros(3, 12)}, tmp_path / "heads.safetensors")
    entry = {"class": "LatentHead", "d": 8, "k": 12}
    (tmp_path / "heads.json").write_text(json.dumps({"latent": entry}))
    loaded, meta = read_latent_head(tmp_path)
    h = torch.randn(5, 8)
    torch.testing.assert_close(loaded(h), head(h), rtol=0, atol=0)
    assert meta == entry
    shared = {**entry, "class": "SharedTransformLatent"}
    (tmp_path / "heads.json").write_text(json.dumps({"latent": shared}))
    with pytest.raises(UserError, match="vocabulary head"):
        read_latent_head(tmp_path)


# ---------------------------------------------------------------------------- defaults


def test_dictionary_defaults_have_one_home() -> None:
    """The CLI, the teacher loader, the dictionary learner and a dictionary without a saved layer
    all take layer, λ and k from mlsm.defaults."""
    import inspect

    from mlsm import defaults
    from mlsm.cli import build_parser
    from mlsm.cli.dataclass_flags import flag_values
    from mlsm.teacher.dictionary import Dictionary
    from mlsm.teacher.dictionary_config import DictionaryConfig
    from mlsm.teacher.online_dictionary import learn_atoms

    parser, _ = build_parser()
    args = parser.parse_args(["dictionary", "--store", "S", "--out", str(Path("d.safetensors"))])
    settings = DictionaryConfig.build(flag_values(args, DictionaryConfig))  # flags not given
    assert (args.layer, settings.lam, settings.k) == (defaults.TEACHER_LAYER, defaults.LAM, None)
    assert inspect.signature(load_teacher).parameters["layer"].default == defaults.TEACHER_LAYER
    assert inspect.signature(learn_atoms).parameters["lam"].default == defaults.LAM
    assert DictionaryConfig().lam == defaults.LAM  # learn_dictionary's settings
    assert Dictionary(torch.zeros(4, 16), {"lam": 0.1}).layer == defaults.TEACHER_LAYER
    assert defaults.default_k(768) == 3072


# ------------------------------------------------------------------------------ error causes


def test_damaged_store_error_keeps_the_cause(store_dir, tmp_path) -> None:
    """Not just the exception's type name: the decoder's own message reaches the user."""
    import shutil

    copy = tmp_path / "store"
    shutil.copytree(store_dir, copy)
    (copy / "meta.json").write_bytes(b"\xff{}")
    with pytest.raises(UserError) as err:
        TokenStore.open(copy)
    assert "can't decode byte 0xff" in str(err.value) and str(copy) in str(err.value)


def test_study_dictionary_errors_name_study_keys_not_cli_flags(tmp_path) -> None:
    from mlsm.study.spec import study_from_dict

    arm = {"objective": {"name": "mlsm"}, "dictionary": {"k": 5000}}
    raw = {"out": str(tmp_path), "arms": {"m": arm}, "dictionary": {"n_vectors": 1000}}
    with pytest.raises(UserError) as err:
        study_from_dict(raw)
    assert "dictionary.n_vectors" in str(err.value) and "arms.m.dictionary.k" in str(err.value)
    assert "--" not in str(err.value)
