"""The two attribution controls of MLSM (docs/dictionary.md, "Controls"), each a named, recorded and
fingerprinted switch: a random dictionary (`atoms: random`, same k, λ, layer and teacher) and a
randomly initialised teacher of the same architecture (`teacher_init: random`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from mlsm.errors import UserError
from mlsm.teacher.dictionary import learn_dictionary, load_dictionary, random_atoms
from mlsm.teacher.teacher import load_teacher
from tests.helpers import TINY_MODEL


def _batch(store: Path) -> tuple[Any, Any]:
    """A masked batch of the fixture store and the Context an objective reads it with."""
    from mlsm.config import DataConfig
    from mlsm.data.batches import BatchSource
    from mlsm.data.corpus import TokenStore
    from mlsm.objectives.base import Context

    st = TokenStore.open(store)
    tok = st.load_tokenizer()
    batch = BatchSource(st, DataConfig(store=str(store), max_len=32), tok).batch(np.arange(8), 0)
    return batch, Context(tok, torch.device("cpu"), 1, str(store), 32)


def _codes(store: Path, **options: object) -> torch.Tensor:
    """MLSM's online targets of one fixed batch with these objective options."""
    from mlsm.objectives.mlsm import MLSMConfig, TargetCoder

    batch, ctx = _batch(store)
    return TargetCoder(MLSMConfig(**options), ctx).codes(batch)


# --------------------------------------------------------------------------- random dictionary


def test_random_atoms_are_unit_norm_seeded_and_non_negative_only_when_asked() -> None:
    rng = torch.get_rng_state()
    atoms = random_atoms(24, 50, seed=3)
    assert torch.equal(rng, torch.get_rng_state())  # its own generator: the caller's is untouched
    assert atoms.shape == (24, 50) and atoms.dtype == torch.float32
    torch.testing.assert_close(atoms.norm(dim=0), torch.ones(50))
    assert torch.equal(atoms, random_atoms(24, 50, seed=3))
    assert not torch.allclose(atoms, random_atoms(24, 50, seed=4))
    assert bool((atoms < 0).any())  # Gaussian directions: signed, as learned atoms are
    nonneg = random_atoms(24, 50, seed=3, nonneg=True)
    assert bool((nonneg >= 0).all())
    torch.testing.assert_close(nonneg.norm(dim=0), torch.ones(50))


def test_random_dictionary_collects_no_states_says_so_and_gives_other_targets(
        store_dir, teacher_dir, dictionary_path, tmp_path, monkeypatch) -> None:
    import mlsm.teacher.dictionary as module
    from mlsm.teacher.targets import dictionary_hash

    def no_states(*_: object, **__: object) -> None:
        raise AssertionError("a random dictionary collected teacher states")

    monkeypatch.setattr(module, "collect_vectors", no_states)
    teacher = load_teacher(str(teacher_dir), layer=1)
    out = tmp_path / "random.safetensors"
    learn_dictionary(store_dir, teacher, k=64, lam=0.05, seed=5, atoms="random", out=out)
    made, learned = load_dictionary(out), load_dictionary(dictionary_path)
    assert torch.equal(made.atoms, random_atoms(32, 64, 5))
    meta = {key: made.meta.get(key) for key in ("atoms", "teacher", "layer", "d", "lam", "k",
                                                "seed", "teacher_init", "teacher_weights")}
    assert meta == {"atoms": "random", "teacher": str(teacher_dir), "layer": 1, "d": 32,
                    "lam": 0.05, "k": 64, "seed": 5, "teacher_init": "pretrained",
                    "teacher_weights": teacher.weights_fingerprint()}
    assert learned.meta["atoms"] == "learned" and learned.meta["teacher_init"] == "pretrained"
    made.check_teacher(teacher)  # the teacher it names: accepted
    assert dictionary_hash(made) != dictionary_hash(learned)  # what the study's reuse compares
    nonneg = learn_dictionary(store_dir, teacher, k=64, seed=5, atoms="random_nonneg")
    assert nonneg.meta["atoms"] == "random_nonneg" and bool((nonneg.atoms >= 0).all())
    rand = _codes(store_dir, dictionary=str(out), teacher=str(teacher_dir))
    real = _codes(store_dir, dictionary=str(dictionary_path), teacher=str(teacher_dir))
    assert rand.shape == real.shape and bool((rand > 0).any()) and bool((real > 0).any())
    assert not torch.equal(rand > 0, real > 0)  # other atoms, other supports


# --------------------------------------------------------------------------- random teacher


def _floats(teacher) -> dict[str, torch.Tensor]:
    return {k: v for k, v in teacher.model.state_dict().items() if v.is_floating_point()}


def test_random_teacher_is_reproducible_from_its_seed_and_not_the_pretrained_one(
        teacher_dir) -> None:
    pretrained = load_teacher(str(teacher_dir), 1)
    rng = torch.get_rng_state()
    first = load_teacher(str(teacher_dir), 1, init="random", seed=0)
    assert torch.equal(rng, torch.get_rng_state())  # built under a forked RNG
    again = load_teacher(str(teacher_dir), 1, init="random", seed=0)
    other = load_teacher(str(teacher_dir), 1, init="random", seed=1)
    assert (first.init, first.seed, pretrained.init) == ("random", 0, "pretrained")
    ours, same, theirs, own = map(_floats, (first, again, other, pretrained))
    assert set(ours) == set(own)  # the same architecture, to the layer
    assert all(torch.equal(v, same[k]) for k, v in ours.items())  # bit-identical from the seed
    matrices = [k for k, v in ours.items() if v.dim() == 2]
    assert matrices and all(not torch.equal(ours[k], theirs[k]) for k in matrices)
    assert all(not torch.equal(ours[k], own[k]) for k in matrices)
    prints = [t.weights_fingerprint() for t in (first, again, other, pretrained)]
    assert prints[0] == prints[1] and len(set(prints)) == 3


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_random_teacher_states_equal_hf_from_config_under_the_same_seed(
        teacher_dir, layer: int) -> None:
    from transformers import AutoConfig, AutoModel

    teacher = load_teacher(str(teacher_dir), layer, init="random", seed=7)
    torch.manual_seed(7)
    reference = AutoModel.from_config(AutoConfig.from_pretrained(str(teacher_dir))).eval()
    ids = torch.randint(5, teacher.vocab_size, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=mask,
                         output_hidden_states=True).hidden_states[layer]
    torch.testing.assert_close(teacher.hidden_states(ids, mask), want, rtol=0, atol=0)


def test_check_teacher_refuses_a_dictionary_of_another_init_seed_or_weights(
        store_dir, teacher_dir, dictionary_path) -> None:
    learned = load_dictionary(dictionary_path)  # learned on the pre-trained tiny teacher
    random0 = load_teacher(str(teacher_dir), 1, init="random", seed=0)
    with pytest.raises(UserError, match="learned on the pretrained teacher but this teacher is "
                                        "random; set teacher_init=pretrained"):
        learned.check_teacher(random0)
    on_random = learn_dictionary(store_dir, random0, k=64, lam=0.05, n_vectors=2000, max_len=32,
                                 teacher_init="random", teacher_seed=0)
    assert (on_random.meta["teacher_init"], on_random.meta["teacher_seed"],
            on_random.meta["teacher_weights"]) == ("random", 0, random0.weights_fingerprint())
    on_random.check_teacher(load_teacher(str(teacher_dir), 1, init="random", seed=0))
    with pytest.raises(UserError, match="learned on the random teacher but this teacher is "
                                        "pretrained; set teacher_init=random"):
        on_random.check_teacher(load_teacher(str(teacher_dir), 1))
    with pytest.raises(UserError, match="random teacher of seed 0 but this one has seed 1; set "
                                        "teacher_seed=0"):
        on_random.check_teacher(load_teacher(str(teacher_dir), 1, init="random", seed=1))
    retrained = load_teacher(str(teacher_dir), 1)  # same name and shape, other weights
    with torch.no_grad():
        retrained.model.get_input_embeddings().weight.add_(0.01)
    with pytest.raises(UserError, match="learned on another teacher of this shape"):
        learned.check_teacher(retrained)
    with pytest.raises(UserError, match="teacher_init=random teacher_seed=0 but the teacher given "
                                        "is pretrained"):
        learn_dictionary(store_dir, load_teacher(str(teacher_dir), 1), k=64,
                         teacher_init="random")


def test_mlsm_run_with_the_random_teacher_codes_its_states_and_records_the_switch(
        store_dir, teacher_dir, tmp_path) -> None:
    import torch.nn.functional as F

    from mlsm.config import config_to_dict
    from mlsm.run_config import load_config
    from mlsm.teacher.sparse_coding import sparse_encode
    from tests.helpers import tiny_overrides

    teacher = load_teacher(str(teacher_dir), 1, init="random", seed=4)
    out = tmp_path / "d.safetensors"
    learn_dictionary(store_dir, teacher, k=64, lam=0.05, n_vectors=2000, max_len=32,
                     teacher_init="random", teacher_seed=4, out=out)
    options = {"dictionary": str(out), "teacher": str(teacher_dir)}
    with pytest.raises(UserError, match="set teacher_init=random"):
        _codes(store_dir, **options)
    got = _codes(store_dir, **options, teacher_init="random", teacher_seed=4)
    batch, _ = _batch(store_dir)
    states = teacher.hidden_states(batch.input_ids, batch.attention_mask)[batch.selected]
    want = sparse_encode(F.normalize(states.float(), dim=-1), load_dictionary(out).atoms, 0.05)
    torch.testing.assert_close(got, want)
    cfg = load_config(None, tiny_overrides(store_dir, tmp_path / "run", **{
        "objective.name": "mlsm", "objective.dictionary": str(out),
        "objective.teacher_init": "random", "objective.teacher_seed": 4}))
    assert {k: config_to_dict(cfg)["objective"][k] for k in ("teacher_init", "teacher_seed")} \
        == {"teacher_init": "random", "teacher_seed": 4}
    with pytest.raises(UserError, match="objective.teacher_init must be one of pretrained, random"):
        load_config(None, tiny_overrides(store_dir, tmp_path / "r", **{
            "objective.name": "mlsm", "objective.teacher_init": "untrained"}))


def test_cli_makes_a_random_dictionary_of_the_random_teacher_and_targets_follow_it(
        store_dir, teacher_dir, tmp_path) -> None:
    from mlsm.cli import main
    from mlsm.teacher.targets import StoredTargets, TargetStore

    out, targets = tmp_path / "d.safetensors", tmp_path / "targets"
    assert main(["dictionary", "--store", str(store_dir), "--teacher", str(teacher_dir),
                 "--layer", "1", "--k", "16", "--atoms", "random", "--teacher-init", "random",
                 "--teacher-seed", "2", "--out", str(out)]) == 0
    meta = load_dictionary(out).meta
    assert (meta["atoms"], meta["teacher_init"], meta["teacher_seed"]) == ("random", "random", 2)
    # mlsm targets loads the teacher the dictionary names (no --teacher-init needed)
    assert main(["targets", "--store", str(store_dir), "--dictionary", str(out), "--teacher",
                 str(teacher_dir), "--max-len", "32", "--out", str(targets)]) == 0
    store = TargetStore.open(targets)
    assert (store.meta["teacher_init"], store.meta["teacher_seed"]) == ("random", 2)
    _, ctx = _batch(store_dir)
    with pytest.raises(UserError, match="coded with the random \\(seed 2\\) teacher but the run "
                                        "says objective.teacher_init=pretrained"):
        StoredTargets(str(targets), ctx.token_store(), ctx.tokenizer, 32,
                      teacher_init=("pretrained", 0))
    StoredTargets(str(targets), ctx.token_store(), ctx.tokenizer, 32, teacher_init=("random", 2))


# --------------------------------------------------------------------------- studies


def _study_raw(corpus_dir: Path, tokenizer_dir: Path, teacher_dir: Path, out: Path) -> dict:
    key = {"layer": 1, "k": 64, "lam": 0.05}
    return {
        "name": "controls", "out": str(out),
        "corpus": {"sources": [str(corpus_dir)], "tokenizer": str(tokenizer_dir)},
        "base": {"data": {"max_len": 32}, "model": {"arch": "bert", "overrides": TINY_MODEL},
                 "optim": {"lr": 1e-3},
                 "train": {"steps": 2, "batch_size": 8, "log_every": 1, "device": "cpu"}},
        "readiness": [1.0],
        "arms": {"learned": {"objective": {"name": "mlsm"}, "dictionary": key},
                 "rdict": {"objective": {"name": "mlsm"},
                           "dictionary": {**key, "atoms": "random"}},
                 "rteacher": {"objective": {"name": "mlsm"},
                              "dictionary": {**key, "teacher_init": "random", "targets": True}}},
        "dictionary": {"teacher": str(teacher_dir), "n_vectors": 2000, "max_len": 32,
                       "teacher_seed": 3},
        "executor": {"kind": "local", "threads": 1},
    }


def test_study_arms_of_the_controls_get_their_own_dictionaries(
        corpus_dir, tokenizer_dir, teacher_dir, tmp_path) -> None:
    from mlsm.study import reuse
    from mlsm.study.runner import Study, run_study
    from mlsm.study.spec import study_from_dict

    raw = _study_raw(corpus_dir, tokenizer_dir, teacher_dir, tmp_path / "study")
    spec = study_from_dict(raw)
    study = Study(spec, log=lambda s: None)
    arms = ("learned", "rdict", "rteacher")
    paths = {a: study.dictionary_path(a) for a in arms}
    names = {a: p.name.split("_l1_")[1] for a, p in paths.items()}  # after the teacher's name
    assert names == {"learned": "k64_lam0.05.safetensors",  # as before the controls
                     "rdict": "k64_lam0.05_atoms-random.safetensors",
                     "rteacher": "k64_lam0.05_teacher-random-s3.safetensors"}
    settings = {a: reuse.dictionary_inputs(study, a)["settings"] for a in arms}
    assert len(set(settings.values())) == 3
    objectives = {a: study.arm_config(a).objective for a in arms}
    assert [(o.teacher_init, o.teacher_seed) for o in objectives.values()] == [
        ("pretrained", 0), ("pretrained", 0), ("random", 3)]
    run_study(spec, stages=["store", "dictionary"], log=lambda s: None)
    metas = {a: load_dictionary(p).meta for a, p in paths.items()}
    assert [(m["atoms"], m["teacher_init"]) for m in metas.values()] == [
        ("learned", "pretrained"), ("random", "pretrained"), ("learned", "random")]
    assert metas["rteacher"]["teacher_seed"] == 3
    targets = json.loads((study.targets_path("rteacher") / "meta.json").read_text())
    assert (targets["teacher_init"], targets["teacher_seed"]) == ("random", 3)
    run_study(spec, stages=["pretrain"], arms=["rteacher"], log=lambda s: None)
    saved = yaml.safe_load((study.run_dir("rteacher") / "config.yaml").read_text())["objective"]
    assert (saved["teacher_init"], saved["teacher_seed"]) == ("random", 3)


@pytest.mark.parametrize(("key", "value", "message"), [
    ("atoms", "randm", "arms.a.dictionary.atoms must be learned or random or random_nonneg"),
    ("teacher_init", "untrained", "arms.a.dictionary.teacher_init must be pretrained or random"),
    ("init", "random", "unknown key arms.a.dictionary.init; valid keys: layer, k, lam, targets, "
                       "atoms, teacher_init")])
def test_a_bad_control_key_of_an_arm_is_one_line(key: str, value: str, message: str) -> None:
    from mlsm.study.spec import study_from_dict

    with pytest.raises(UserError, match=message):
        study_from_dict({"arms": {"a": {"objective": {"name": "mlsm"},
                                        "dictionary": {"layer": 1, key: value}}}})
