"""mlsm: sample-efficient encoder pre-training with Masked Latent Semantic Modeling.

The public API is small and its names are stable; heavy modules load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"
DISTRIBUTION = "mlsm-lab"
"""The name pip installs this package by (pyproject.toml's [project].name); `mlsm` on PyPI is an
unrelated project. The import name and the command stay `mlsm`."""

# public name -> module that defines it
_API = {
    "prepare_corpus": "mlsm.data.corpus",
    "TokenStore": "mlsm.data.corpus",
    "train_tokenizer": "mlsm.data.tokenizer",
    "load_config": "mlsm.run_config",
    "RunConfig": "mlsm.run_config",
    "pretrain": "mlsm.train.loop",
    "learn_dictionary": "mlsm.teacher.dictionary",
    "load_dictionary": "mlsm.teacher.dictionary",
    "sparse_encode": "mlsm.teacher.sparse_coding",
    "load_teacher": "mlsm.teacher.teacher",
    "build_target_store": "mlsm.teacher.targets",
    "finetune": "mlsm.evaluate.finetune.finetune",
    "compare_runs": "mlsm.evaluate.compare.stats",
    "make_report": "mlsm.evaluate.compare.report",
    "score_pll": "mlsm.evaluate.zeroshot.pll",
    "evaluate_blimp": "mlsm.evaluate.zeroshot.blimp",
    "run_probe": "mlsm.evaluate.probe.probe",
    "flops_table": "mlsm.train.flops",
    "UserError": "mlsm.errors",
}


def __getattr__(name: str) -> Any:
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'mlsm' has no attribute {name!r}")


__all__ = sorted(_API)
