"""Each setting of the plateau probe is declared once (issue 33, item 3): every field of
`mlsm.evaluate.probe.probe_fit_config.ProbeFitConfig` is a flag of `mlsm probe` (same default), a
keyword
of `train_probe_to_plateau` and a key of a study's `probe:` group, and a value given in any of the
three reaches the fit. The fit itself is replaced by a recorder where it would run: what it is
given is the claim here (tests/test_probe_fit.py trains it)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from mlsm.cli import build_parser
from mlsm.cli.dataclass_flags import flag_values
from mlsm.errors import UserError
from mlsm.evaluate.probe.probe_fit_config import ProbeFitConfig

FIELDS = dataclasses.fields(ProbeFitConfig)
OTHER = {"lr": 0.05, "inputs": ["logits", "probs"], "select_steps": 7, "max_steps": 9,
         "eval_every": 3, "patience": 5, "min_delta": 0.01, "heldout_batches": 2, "batch_size": 6,
         "head": "factored", "rank": 12}
# a study fits its latent arms' probes with head latent (the controls are probe.controls)
STUDY_OTHER = {**OTHER, "head": "latent"}
# the defaults `train_probe_to_plateau` and a study's `probe:` group had before this declaration
OLD_FUNCTION = {"lr": 0.2, "inputs": ["probs", "logprobs", "logits"], "select_steps": 100,
                "max_steps": 2000, "eval_every": 50, "patience": 3, "min_delta": 0.005,
                "heldout_batches": 4, "batch_size": None, "head": "latent", "rank": 0}
OLD_STUDY = {**OLD_FUNCTION, "batch_size": 16, "recipe": "plateau", "steps": 10_000,
             "controls": []}


def _flags(values: dict) -> list[str]:
    return [t for name, value in values.items()
            for t in (f"--{name.replace('_', '-')}",
                      ",".join(value) if isinstance(value, list) else str(value))]


def _parse(extra: list[str]) -> object:
    parser, _ = build_parser()
    return parser.parse_args(["probe", "ckpt", *extra])


def test_other_values_cover_every_field_and_differ_from_the_defaults() -> None:
    assert set(OTHER) == {f.name for f in FIELDS}
    assert dataclasses.asdict(ProbeFitConfig()) == OLD_FUNCTION
    assert all(OTHER[k] != v for k, v in OLD_FUNCTION.items())


def test_every_setting_is_a_flag_with_the_dataclass_default() -> None:
    assert flag_values(_parse([]), ProbeFitConfig) == {}  # not given: the dataclass's default
    assert flag_values(_parse(_flags(OTHER)), ProbeFitConfig) == OTHER
    help_text = build_parser()[0]._subparsers._group_actions[0].choices["probe"].format_help()
    assert "(default 2000)" in help_text and "--max-steps" in help_text


@pytest.mark.parametrize("flag", ["--max-steps 0", "--lr 0", "--inputs probs,words",
                                  "--inputs probs,probs", "--batch-size 0", "--min-delta -1",
                                  "--select-steps 1.5"])
def test_a_flag_out_of_its_fields_range_is_refused(flag: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        _parse(flag.split())
    assert exit_.value.code == 2 and flag.split()[0] in capsys.readouterr().err


@pytest.mark.parametrize("name", [f.name for f in FIELDS])
def test_every_setting_is_a_keyword_of_the_fit(name: str, tmp_path: Path) -> None:
    from mlsm.evaluate.probe.probe_fit import train_probe_to_plateau

    missing = tmp_path / "no-checkpoint"
    # the keyword is accepted: the refusal is the checkpoint's, after the settings were read
    with pytest.raises(UserError, match="no-checkpoint"):
        train_probe_to_plateau(missing, tmp_path / "out", **{name: OTHER[name]})
    with pytest.raises(UserError, match="no-checkpoint"):
        train_probe_to_plateau(missing, tmp_path / "out", ProbeFitConfig(**{name: OTHER[name]}))
    assert getattr(ProbeFitConfig.over(None, {name: OTHER[name]}), name) == OTHER[name]


def test_the_fit_refuses_unknown_and_out_of_range_settings(tmp_path: Path) -> None:
    from mlsm.evaluate.probe.probe_fit import train_probe_to_plateau

    with pytest.raises(UserError, match=r"unknown key train_probe_to_plateau\(\)\.max_step"):
        train_probe_to_plateau(tmp_path, tmp_path / "out", max_step=5)
    with pytest.raises(UserError, match="max_steps must be a positive whole number, got 0"):
        train_probe_to_plateau(tmp_path, tmp_path / "out", max_steps=0)
    # settings given as keywords win over the config's; a tuple of inputs is a list
    got = ProbeFitConfig.over(ProbeFitConfig(lr=0.3, patience=9), {"lr": 0.1, "inputs": ("probs",)})
    assert (got.lr, got.patience, got.inputs) == (0.1, 9, ["probs"])


def _study(tmp_path: Path, group: dict) -> object:
    from mlsm.study.spec import study_from_dict

    return study_from_dict({"out": str(tmp_path), "probe": group,
                            "arms": {"m": {"objective": {"name": "mlm"}}}})


def test_every_setting_is_a_study_probe_key(tmp_path: Path) -> None:
    from mlsm.study.spec import ProbeSpec

    assert dataclasses.asdict(ProbeSpec()) == OLD_STUDY  # a study keeps its batch size of 16
    spec = _study(tmp_path, STUDY_OTHER)
    assert dataclasses.asdict(ProbeFitConfig.over(spec.probe, {})) == STUDY_OTHER  # narrowed
    with pytest.raises(UserError, match="probe.head must be latent in a study"):
        _study(tmp_path, {"head": "vocab"})
    with pytest.raises(UserError, match="probe.inputs must be distinct input kinds"):
        _study(tmp_path, {"inputs": ["words"]})
    with pytest.raises(UserError, match="probe.batch_size must be of type int"):
        _study(tmp_path, {"batch_size": None})


def test_the_study_stage_fits_with_the_groups_settings(tmp_path: Path, monkeypatch) -> None:
    import mlsm.evaluate.probe.probe_fit as fit
    from mlsm.study import reuse, stages

    spec = _study(tmp_path, {**STUDY_OTHER, "batch_size": 6})
    seen: dict = {}
    monkeypatch.setattr(fit, "train_probe_to_plateau",
                        lambda ck, out, config=None, **kw: seen.update(config=config, kw=kw))
    monkeypatch.setattr(reuse, "probe_inputs", lambda *a: {})
    study = SimpleNamespace(spec=spec, probe_dir=lambda a, f: tmp_path / "p",
                            reusable=lambda *a, **k: False, checkpoint=lambda a, f: "ck")
    assert stages._probe(study, "m", 1.0) is None
    given = {k: v for k, v in seen["kw"].items() if k != "threads"}
    assert dataclasses.asdict(ProbeFitConfig.over(seen["config"], given)) == STUDY_OTHER


def test_a_default_study_probe_fingerprint_is_unchanged(tmp_path: Path) -> None:
    """The study's probe settings hash as before ProbeSpec came from ProbeFitConfig (these are the
    fingerprints main computed then), so existing studies' probes are not trained again."""
    from mlsm.artifacts.fingerprint import settings_fingerprint
    from mlsm.study.reuse import probe_settings

    def fingerprint(group: dict) -> str:  # a latent arm's probe, as the probe stage keys it
        return settings_fingerprint(probe_settings(_study(tmp_path, group).probe, "latent"))

    assert fingerprint({}) == "2dc6bba3fdce2c5d"
    assert fingerprint({"recipe": "paper", "batch_size": 8}) == "5ac6bb24b2b44a3f"


# ------------------------------------------------------------------------ through `mlsm probe`


@pytest.fixture(scope="module")
def mlsm_ckpt(store_dir: Path, teacher_dir: Path, dictionary_path: Path,
              tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-step MLSM checkpoint: its own training, not conftest's 30-step `mlsm_run`, because
    test_every_setting_changes_the_fit needs a barely trained encoder, whose probe's held-out loss
    falls at every evaluation; on the 30-step one the falls are so small that, run after other
    modules, the probe stopped after 8 of 16 steps with min_delta 0."""
    from .helpers import train_tiny

    out = tmp_path_factory.mktemp("mlsm") / "run"
    return train_tiny(store_dir, out, **{
        "objective.name": "mlsm", "objective.dictionary": str(dictionary_path),
        "objective.teacher": str(teacher_dir), "train.steps": 2,
        "train.readiness": "[1.0]"}) / "checkpoints" / "step-0000002"


def test_mlsm_probe_flags_reach_the_fit(mlsm_ckpt: Path, tmp_path: Path, monkeypatch) -> None:
    import mlsm.evaluate.probe.probe_fit as fit
    from mlsm.cli import main

    seen: dict = {}
    monkeypatch.setattr(fit, "train_probe_to_plateau",
                        lambda ck, out, config=None, **kw: seen.update(config=config, kw=kw))
    main(["probe", str(mlsm_ckpt), "--out", str(tmp_path / "a"), *_flags(OTHER)])
    assert dataclasses.asdict(ProbeFitConfig.over(seen["config"], seen["kw"])) == OTHER
    main(["probe", str(mlsm_ckpt), "--out", str(tmp_path / "b")])
    assert dataclasses.asdict(ProbeFitConfig.over(seen["config"], seen["kw"])) == OLD_FUNCTION


@pytest.mark.parametrize("loop", [["--steps", "2"], ["--recipe", "paper"], ["optim.lr=1e-3"]])
def test_plateau_flags_with_the_training_loop_are_one_line(mlsm_ckpt: Path, tmp_path: Path,
                                                           loop: list[str], capsys,
                                                           monkeypatch) -> None:
    import mlsm.evaluate.probe.probe as probe
    from mlsm.cli import main

    ran: list = []  # a loop that would run is recorded, not trained (10,000 steps for paper)
    monkeypatch.setattr(probe, "pretrain_run",
                        lambda cfg, resume=None: (ran.append(cfg) or Path(), None))
    out = tmp_path / "p"
    assert main(["probe", str(mlsm_ckpt), "--out", str(out), "--max-steps", "5", *loop]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--max-steps" in err and "drop" in err
    assert not out.exists() and not ran


@pytest.mark.parametrize("head", [[], ["--head", "latent"], ["--head", "vocab"]])
def test_a_rank_for_a_head_without_one_is_one_line(mlsm_ckpt: Path, tmp_path: Path, head: list,
                                                    capsys, monkeypatch) -> None:
    """--rank sets a factored head's width only: with a latent or vocab head it would be dropped
    without a word, so it is refused before anything is fitted or written."""
    import mlsm.evaluate.probe.probe_fit as fit
    from mlsm.cli import main

    fitted: list = []
    monkeypatch.setattr(fit, "train_probe_to_plateau", lambda *a, **kw: fitted.append(kw))
    out = tmp_path / "p"
    assert main(["probe", str(mlsm_ckpt), "--out", str(out), "--rank", "64", *head]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--rank 64" in err and "--head factored" in err, err
    assert not out.exists() and not fitted
    main(["probe", str(mlsm_ckpt), "--out", str(out), "--rank", "64", "--head", "factored"])
    assert fitted and fitted[-1]["rank"] == 64 and fitted[-1]["head"] == "factored"


def test_every_setting_changes_the_fit(mlsm_ckpt: Path, tmp_path: Path) -> None:
    """Two real fits of a few steps, each setting visible in what probe.json records: the lr and
    batch size; a candidate per input kind; curves at multiples of eval_every up to max_steps;
    after select_steps only the winner trains; patience and min_delta stop it (min_delta also on
    its own); heldout_batches sets how many targets it is scored on."""
    from mlsm.evaluate.probe.probe_fit import train_probe_to_plateau

    # min_delta 0.99 is never reached: every candidate stops after `patience` = 1 evaluation
    a = train_probe_to_plateau(mlsm_ckpt, tmp_path / "a", lr=0.05, inputs=("logits", "probs"),
                               select_steps=2, max_steps=6, eval_every=2, patience=1,
                               min_delta=0.99, heldout_batches=1, batch_size=4)
    assert (a["lr"], a["batch_size"], sorted(a["candidates"])) == (0.05, 4, ["logits", "probs"])
    assert [[p["step"] for p in c["curve"]] for c in a["candidates"].values()] == [[2], [2]]
    # min_delta alone: the held-out loss falls by ~0.1-2 % per evaluation here, so with min_delta
    # 0 every fall counts and the probe trains to max_steps; with 0.5 none does and it stops
    # after `patience` = 2 evaluations
    def steps(min_delta: float) -> list[int]:
        r = train_probe_to_plateau(mlsm_ckpt, tmp_path / f"md{min_delta}", lr=0.05,
                                   inputs=("probs",), select_steps=0, max_steps=16, eval_every=4,
                                   patience=2, min_delta=min_delta, heldout_batches=1,
                                   batch_size=4)
        return [p["step"] for p in r["candidates"]["probs"]["curve"]]

    assert (steps(0.0), steps(0.5)) == ([4, 8, 12, 16], [4, 8])
    b = train_probe_to_plateau(mlsm_ckpt, tmp_path / "b", ProbeFitConfig(
        inputs=["logits", "probs"], select_steps=1, max_steps=3, eval_every=2, patience=5,
        min_delta=0.0, heldout_batches=2, batch_size=4))
    winner, loser = b["candidates"][b["input"]], b["candidates"][
        next(k for k in b["candidates"] if k != b["input"])]
    assert [p["step"] for p in winner["curve"]] == [2, 3] and loser["curve"] == []
    assert b["n_heldout_targets"] > a["n_heldout_targets"]  # 2 held-out batches, not 1


# ------------------------------------------------------------------------ which probe: ProbeRecipe


def test_the_recipe_is_declared_once_for_flags_function_and_study(tmp_path: Path) -> None:
    from mlsm.evaluate.probe.probe_fit_config import PAPER_PROBE_STEPS, ProbeRecipe
    from mlsm.study.spec import ProbeSpec

    assert flag_values(_parse([]), ProbeRecipe) == {}
    assert flag_values(_parse(["--recipe", "paper", "--steps", "7"]), ProbeRecipe) == {
        "recipe": "paper", "steps": 7}
    assert issubclass(ProbeSpec, ProbeRecipe)
    # 0 steps = the recipe's: the plateau fit, or the paper's 10,000 through the loop
    assert ProbeRecipe().loop_steps() == 0
    assert ProbeRecipe(recipe="paper").loop_steps() == PAPER_PROBE_STEPS == 10_000
    assert ProbeRecipe(recipe="paper", steps=30).loop_steps() == 30
    assert _study(tmp_path, {"recipe": "paper", "steps": 0}).probe.loop_steps() == 10_000


def test_a_bad_recipe_is_one_line_from_flag_function_and_study(tmp_path: Path, capsys) -> None:
    from mlsm.evaluate.probe.probe import run_probe

    with pytest.raises(SystemExit):
        _parse(["--recipe", "fig6"])
    assert "--recipe" in capsys.readouterr().err
    with pytest.raises(UserError, match=r"^run_probe\(\)\.recipe must be"):
        run_probe(tmp_path, recipe="fig6")
    with pytest.raises(UserError, match=r"^run_probe\(\)\.steps must be a whole number 0 or more"):
        run_probe(tmp_path, steps=-1)
    with pytest.raises(UserError, match=r"^probe\.recipe must be"):
        _study(tmp_path, {"recipe": "fig6"})


@pytest.mark.parametrize("inputs", [["logits", "probs"], ["probs", "logits"]])
def test_a_probe_that_never_beats_unigram_reports_the_input_it_trained(mlsm_ckpt: Path,
                                                                       tmp_path: Path,
                                                                       inputs) -> None:
    """A step this large never beats the unigram start, so every candidate ties at it: the input
    reported is the one selection kept and trained on (its curve), whatever the order of
    `inputs` (it was the first of them, so a flaky test saw a winner without a curve)."""
    from mlsm.evaluate.probe.probe_fit import train_probe_to_plateau

    info = train_probe_to_plateau(mlsm_ckpt, tmp_path / "p", ProbeFitConfig(
        lr=1e4, inputs=inputs, select_steps=1, max_steps=3, eval_every=2, patience=5,
        min_delta=0.0, heldout_batches=1, batch_size=4))
    assert info["heldout_loss"] == info["unigram_loss"]  # the tie this is about
    assert info["candidates"][info["input"]]["curve"] != []
