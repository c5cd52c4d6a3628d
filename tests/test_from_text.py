"""`mlsm pretrain --text FILE` (issue #54 item 7): from text to a probed MLSM run in one command,
and what exists is reused by its fingerprint."""

from __future__ import annotations

from pathlib import Path

from mlsm.cli.from_text import pretrain_from_text
from mlsm.errors import UserError
from mlsm.evaluate.probe.probe import ProbeScorer, load_scorer

TINY = ["train.steps=2", "train.batch_size=8", "train.eval_every=1", "data.max_len=32",
        "model.overrides={hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2, "
        "intermediate_size: 64}", "dictionary.n_vectors=600", "dictionary.k=64",
        "dictionary.max_len=32", "probe.max_steps=4", "probe.eval_every=2"]


def _stamps(out: Path) -> dict[str, int]:
    """mtime of every file the command builds (store, dictionary, run, probe)."""
    found = [*Path(f"{out}-store").rglob("*"), *out.rglob("*"),
             Path(f"{out}-dict.safetensors")]
    return {str(p): p.stat().st_mtime_ns for p in found if p.is_file() and p.suffix != ".lock"}


def test_text_to_a_probed_run_then_everything_is_reused(corpus_dir: Path,
                                                        tmp_path: Path) -> None:
    out = tmp_path / "runs" / "mine"
    said: list[str] = []
    text = [str(corpus_dir / "a.txt")]
    run = pretrain_from_text(text, overrides=[*TINY, f"train.out={out}"], log=said.append)
    assert run == out and said[0].startswith("mlsm pretrain --text: mlsm on ")
    assert "small-machine defaults" in said[0]
    scorer, _ = load_scorer(str(run))  # `mlsm score RUN` finds the probe the command trained
    assert isinstance(scorer, ProbeScorer)

    before = _stamps(out)
    said.clear()
    pretrain_from_text(text, overrides=[*TINY, f"train.out={out}"], log=said.append)
    assert _stamps(out) == before  # nothing rebuilt
    assert sum("reused" in line for line in said) == 3, said  # dictionary, run, probe

    other = [t.replace("dictionary.n_vectors=600", "dictionary.n_vectors=700") for t in TINY]
    try:  # other dictionary settings: learned anew, and the finished run is not taken for it
        pretrain_from_text(text, overrides=[*other, f"train.out={out}"], log=said.append)
    except UserError as exc:
        assert "other settings or another dictionary" in str(exc)
    else:
        raise AssertionError("a run of another dictionary was reused")
    assert said[-1].endswith(": learned")


def test_what_text_builds_follows_each_objectives_declarations() -> None:
    """#54: --text decides by what an objective declares, never by its name. Every registered
    objective whose Config has a `dictionary` option gets one (an MLSM variant taken for plain
    would train without its atoms), and a probe exactly when PLL can score it only through one."""
    import dataclasses

    import pytest

    from mlsm.cli.from_text import builds_for
    from mlsm.objectives import OBJECTIVES

    for name, cls in OBJECTIVES.items():
        options = {f.name for f in dataclasses.fields(cls.Config)}
        needs = builds_for(name)
        assert needs.dictionary == ("dictionary" in options), name
        assert needs.probe == (cls.predicts_latent and not cls.exports_vocab_head
                               and cls.scored_by_pll), name
    assert builds_for("mtl").dictionary and not builds_for("mtl").probe  # a vocabulary head
    assert not builds_for("mlm").dictionary
    with pytest.raises(UserError, match="--objective nosuch: unknown objective; choose from mlm"):
        builds_for("nosuch")


def test_what_text_builds_follows_the_objective_declarations(corpus_dir: Path,
                                                             tmp_path: Path) -> None:
    """What --text builds is decided by what the objective declares, not by its name: MLSM+MLM
    (mtl) has a dictionary and is scored through its own vocabulary head (no probe); feature KD
    predicts latents without a dictionary (a probe, no dictionary); MLM gets neither; an unknown
    name is one line naming the objectives."""
    import pytest

    text = [str(corpus_dir / "a.txt")]
    built = {}
    for objective in ("mtl", "feature_kd", "mlm"):
        out = tmp_path / objective
        pretrain_from_text(text, objective, [*TINY, f"train.out={out}"], log=lambda s: None)
        built[objective] = (Path(f"{out}-dict.safetensors").is_file(),
                            bool(list(out.glob("probe-*"))))
    assert built == {"mtl": (True, False), "feature_kd": (False, True), "mlm": (False, False)}
    assert isinstance(load_scorer(str(tmp_path / "feature_kd"))[0], ProbeScorer)
    with pytest.raises(UserError, match="--objective mlsmm: unknown objective; choose from .*mlsm"):
        pretrain_from_text(text, "mlsmm", [*TINY, f"train.out={tmp_path / 'x'}"])
