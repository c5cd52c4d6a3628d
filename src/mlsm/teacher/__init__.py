"""Teacher side of MLSM: frozen early-exit teacher, dictionary learning, sparse coding.

The names below load on first use: importing a light submodule (`dictionary_config`, which the CLI
reads to build its flags) must not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {"SparseCodes": "sparse_coding", "fista": "sparse_coding",
          "kkt_violation": "sparse_coding", "sparse_encode": "sparse_coding",
          "top_nnz": "sparse_coding", "Teacher": "teacher", "default_teacher_path": "teacher",
          "load_teacher": "teacher"}

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(importlib.import_module(f"mlsm.teacher.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'mlsm.teacher' has no attribute {name!r}")
