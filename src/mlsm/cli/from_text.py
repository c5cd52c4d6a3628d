"""`mlsm pretrain --text FILE...`: from text to a model in one command.

What the separate verbs do one by one (docs/tutorial.md), for a small machine: a token store of
the text with the packaged teacher's tokenizer (`OUT-store`), for MLSM a dictionary of the
teacher's layer-5 states (`OUT-dict.safetensors`), the run (`OUT`), and for MLSM its k -> |V|
probe trained to a plateau (`OUT/probe-step-N`). What exists is reused: the store when it holds
the same text (its content fingerprint), the dictionary when its record names the same store
fingerprint and settings, the run when it finished with the same config and dictionary (an
interrupted one resumes, with `mlsm pretrain --resume`'s checks; a finished one of other
settings is refused), the probe when its record is there. Sizes are the tiny recipe's, stated
in the first line; `group.key=value` overrides change the run as for `mlsm pretrain`,
`dictionary.KEY=...` the dictionary and `probe.KEY=...` the probe (their flags' names, e.g.
probe.max_steps=200). What an objective needs is read from its class (`builds_for`): a dictionary
when its Config has one, a probe when PLL scores it only through one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlsm.config import merge, parse_overrides
from mlsm.errors import Stopped, UserError

SMALL = {
    "data": {"max_len": 64, "seed": 0},
    "model": {"arch": "bert", "overrides": {"hidden_size": 128, "num_hidden_layers": 2,
                                            "num_attention_heads": 2, "intermediate_size": 512}},
    "optim": {"lr": 5e-4, "warmup": 0.02},
    "train": {"steps": 100, "batch_size": 32, "log_every": 10, "eval_every": 50},
}
"""The run's small-machine defaults, the tutorial's (configs/tiny/ at sequences of 64): a 2 x 128
BERT student, 100 steps of 32 x 64 tokens, validation every 50 steps."""
DICTIONARY = {"layer": 5, "k": 512, "n_vectors": 30_000, "lam": 0.05}
"""The dictionary's: the teacher's layer 5, k = 512, 30,000 states (the tutorial's first try);
`dictionary.KEY=VALUE` overrides any setting of `mlsm dictionary` (e.g. dictionary.n_vectors)."""


def pretrain_from_text(texts: list[str], objective: str = "mlsm",
                       overrides: list[str] | None = None,
                       log: Callable[[str], None] = print) -> Path:
    """Build what is missing from `texts` to a trained (and, for MLSM, probed) run; returns the
    run directory (train.out, default runs/<name of the first text>)."""
    from mlsm.data.corpus import prepare_corpus
    from mlsm.evaluate.probe.probe import run_probe
    from mlsm.run_config import config_from_dict
    from mlsm.teacher.teacher import default_teacher_path
    from mlsm.train.loop import pretrain_run
    from mlsm.train.signals import exit_status

    needs = builds_for(objective)
    raw = merge(SMALL, parse_overrides(overrides or []))
    settings = {**DICTIONARY, **raw.pop("dictionary", {})}  # dictionary.n_vectors=... and so on
    probe = raw.pop("probe", {})  # probe.max_steps=...: settings of `mlsm probe`
    out = Path(raw.get("train", {}).get("out") or f"runs/{Path(texts[0]).name.split('.')[0]}")
    t = raw["train"]
    learns = (f"; dictionary: k = {settings['k']}, teacher layer {settings['layer']}, "
              f"{settings['n_vectors']:,} states" if needs.dictionary else "")
    log(f"mlsm pretrain --text: {objective} on {', '.join(texts)} with small-machine defaults "
        f"(a 2 x 128 BERT, {t['steps']} steps of {t['batch_size']} x "
        f"{raw['data']['max_len']} tokens{learns}) -> {out} (group.key=value overrides change "
        "them)")
    store = prepare_corpus(texts, str(default_teacher_path()), f"{out}-store")
    log(f"token store {store.path}: {store.n_tokens:,} tokens")
    raw["data"] = {**raw["data"], "store": str(store.path)}
    raw["train"] = {**raw["train"], "out": str(out)}
    raw["objective"] = {"name": objective, **raw.get("objective", {})}
    learned = False
    if needs.dictionary:
        path, learned = _dictionary(store, Path(f"{out}-dict.safetensors"), settings, log)
        raw["objective"]["dictionary"] = path
        raw["objective"].setdefault("layer", settings["layer"])
    cfg = config_from_dict(raw)
    if not _finished(out, cfg.train.steps):  # new, or interrupted: pretrain checks a resume
        _, signum = pretrain_run(cfg, resume="auto" if (out / "run.json").is_file() else None)
        if signum is not None:  # stopped with a checkpoint: no probe of an unfinished run
            raise Stopped(exit_status(signum, cfg.train.signal_exit_zero))
    elif learned or _differs(out, cfg):
        raise UserError(f"{out} holds a finished run of other settings or another dictionary; "
                        "choose another train.out or delete that run (nothing was trained)")
    else:
        log(f"run {out}: already trained ({cfg.train.steps} steps, same config), reused")
    if needs.probe:
        _probe(out, lambda final: run_probe(final, **probe), log)
    return out


@dataclass(frozen=True)
class Builds:
    """What --text builds for an objective besides the token store and the run, read from the
    objective's own declarations (`Objective.reads_dictionary`, `.scored_through_probe`), so no
    objective is named here."""

    dictionary: bool
    """The dictionary its Config's `dictionary` option names (learned on the packaged teacher)."""
    probe: bool
    """The k -> |V| probe at the end, without which PLL cannot score it."""


def builds_for(objective: str) -> Builds:
    """What --text builds for `objective` (one line for a name that is not a user objective)."""
    from mlsm.objectives import objective_class, user_objectives

    cls = objective_class(objective) if objective in user_objectives() else None
    if cls is None:
        raise UserError(f"--objective {objective}: unknown objective; choose from "
                        f"{', '.join(user_objectives())}")
    return Builds(dictionary=cls.reads_dictionary(), probe=cls.scored_through_probe())


def _finished(out: Path, steps: int) -> bool:
    from mlsm.artifacts.checkpoint import is_run_dir, list_checkpoints

    try:
        done = list_checkpoints(out) if is_run_dir(out) else []
        return bool(done) and done[-1][0] >= steps
    except UserError:
        return False


def _differs(out: Path, cfg: Any) -> bool:
    """Whether the finished run's config.yaml differs from `cfg` beyond what changes no weight."""
    import yaml

    from mlsm.config import config_to_dict
    from mlsm.inputs import read_yaml

    volatile = ("threads", "device", "signal_exit_zero", "eval_every", "eval_batches")
    saved = read_yaml(out / "config.yaml", "run config", f"delete {out} to start over")
    now = yaml.safe_load(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    if not isinstance(saved, dict):  # not one mlsm wrote: the run is not this one
        return True
    for config in (saved, now):
        for key in volatile:
            config.get("train", {}).pop(key, None)
    return saved != now


def _dictionary(store: Any, path: Path, settings: dict[str, Any],
                log: Callable[[str], None]) -> tuple[str, bool]:
    """The dictionary at `path`, learned unless its record names this store's fingerprint and
    these settings (`DICTIONARY` and the dictionary.* overrides)."""
    from mlsm.teacher.dictionary import learn_dictionary, learned_with, record_inputs
    from mlsm.teacher.teacher import load_teacher

    wanted = {"store": store.meta["fingerprint"], **settings}
    if learned_with(path, wanted):
        log(f"dictionary {path}: same store and settings, reused")
        return str(path), False
    teacher = load_teacher(None, settings["layer"])
    learn_dictionary(store, teacher, out=path,
                     **{k: v for k, v in settings.items() if k != "layer"})
    record_inputs(path, wanted)
    log(f"dictionary {path}: learned")
    return str(path), True


def _probe(out: Path, run_probe: Callable[..., Path], log: Callable[[str], None]) -> None:
    from mlsm.artifacts.checkpoint import list_checkpoints
    from mlsm.artifacts.probe_record import has_probe_record

    final = list_checkpoints(out)[-1][1]
    probe_run = out / f"probe-{final.name}"
    if has_probe_record(probe_run):
        log(f"probe {probe_run}: reused")
        return
    log(f"probe {run_probe(final)}: trained (mlsm score {out} TEXT, mlsm export {out} work now)")
