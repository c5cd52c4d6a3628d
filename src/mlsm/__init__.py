"""mlsm: sample-efficient encoder pre-training with Masked Latent Semantic Modeling.

The public API is small and its names are stable; heavy modules load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_API = {
    "prepare_corpus": "mlsm.data.corpus",
    "TokenStore": "mlsm.data.corpus",
    "train_tokenizer": "mlsm.data.tokenizer",
    "load_config": "mlsm.config",
    "RunConfig": "mlsm.config",
    "pretrain": "mlsm.train.loop",
    "UserError": "mlsm.errors",
}


def __getattr__(name: str) -> Any:
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'mlsm' has no attribute {name!r}")


__all__ = sorted(_API)
