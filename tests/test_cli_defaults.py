"""A verb's flag and the library keyword it feeds cannot drift apart (issue 33, item 3).

Verbs whose settings a study also takes (finetune, dictionary, probe, blimp, readout) generate
their flags from one dataclass. The others are a thin CLI over one function, so each setting has
two spellings: the flag and the keyword. Here every flag whose name is a keyword of the function
its verb calls must have that keyword's default, so `mlsm VERB` and `VERB()` in Python do the
same thing when nothing is given. A new verb must be placed in one of the two tables.
"""

from __future__ import annotations

import importlib
import inspect

import pytest

from .helpers import cli_verbs

CALLS = {  # verb -> the library function its handler calls
    "demo": "mlsm.demo:run_demo", "prepare": "mlsm.data.corpus:prepare_corpus",
    "train-tokenizer": "mlsm.data.tokenizer:train_tokenizer",
    "dictionary": "mlsm.teacher.dictionary:learn_dictionary",
    "targets": "mlsm.teacher.targets:build_target_store",
    "probe": "mlsm.evaluate.probe.probe:run_probe",
    "finetune": "mlsm.evaluate.finetune.finetune:finetune",
    "compare": "mlsm.evaluate.compare.stats:compare_runs",
    "report": "mlsm.evaluate.compare.report:make_report",
    "blimp": "mlsm.evaluate.zeroshot.blimp:evaluate_blimp",
    "score": "mlsm.evaluate.zeroshot.score:score_corpus",
    "readout": "mlsm.evaluate.readouts:readout",
    "rank": "mlsm.evaluate.zeroshot.rank:layerwise_effective_rank",
    "export": "mlsm.integrations.export:export_checkpoint", "migrate": "mlsm.migrate:migrate",
}
NO_KEYWORDS = {  # verb -> why no flag of it names a keyword with a default
    "pretrain": "its settings are the run config (`pretrain(config)`), flags are overrides",
    "study": "its settings are the study file",
    "flops": "`flops_table` takes the run config's shapes positionally; flags override them",
}
# A flag whose None means "the function's own default" (the handler leaves it out or fills it
# from the same constant): (verb, dest) -> why
NONE_MEANS_DEFAULT = {
    ("demo", "steps"): "`a.steps or STEPS`, and run_demo's default is STEPS",
    ("demo", "batch"): "`a.batch or BATCH`, and run_demo's default is BATCH",
    ("demo", "seeds"): "`a.seeds or SEEDS`, and run_demo's default is SEEDS",
}


def test_every_verb_is_in_one_table() -> None:
    assert set(cli_verbs()) == set(CALLS) | set(NO_KEYWORDS)
    assert not set(CALLS) & set(NO_KEYWORDS)


def _empty(value: object) -> bool:
    return value in ("", (), [], None)


@pytest.mark.parametrize("verb", sorted(CALLS))
def test_each_flag_has_the_default_of_the_keyword_it_feeds(verb: str) -> None:
    module, name = CALLS[verb].split(":")
    params = inspect.signature(getattr(importlib.import_module(module), name)).parameters
    drift = []
    for action in cli_verbs()[verb]._actions:
        param = params.get(action.dest)
        if param is None or param.default is inspect.Parameter.empty:
            continue
        same = action.default == param.default or (_empty(action.default)
                                                    and _empty(param.default))
        if not same and (verb, action.dest) not in NONE_MEANS_DEFAULT:
            drift.append(f"--{action.dest.replace('_', '-')}: flag {action.default!r}, "
                         f"{name}() {param.default!r}")
    assert not drift, f"mlsm {verb}: " + "; ".join(drift)


def test_the_demos_none_is_its_functions_default() -> None:
    from mlsm import demo

    params = inspect.signature(demo.run_demo).parameters
    assert (params["steps"].default, params["batch"].default, params["seeds"].default) == \
        (demo.STEPS, demo.BATCH, demo.SEEDS)
