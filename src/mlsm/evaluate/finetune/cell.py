"""What every fine-tuning cell shares, whatever its task kind (classification, token, QA,
retrieval): the model it starts from, its seeds, its optimizer and schedule, and the backbone
loader. `finetune.py` (the grid), `task_cell.py`, `qa.py` and `retrieval_cell.py` build on it; it
imports none of them, so the grid can hand a retrieval cell to `retrieval_cell` without an import
circle.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mlsm.artifacts.checkpoint import Checkpoint, resolve_checkpoint
from mlsm.errors import UserError
from mlsm.evaluate.finetune.finetune_config import DEFAULT_MAX_LEN, MODEL_MAX_LEN_CAP
from mlsm.inputs import real_path

LOG_EVERY = 10  # training steps between tracker points of a fine-tuning cell


@dataclass(frozen=True)
class ModelRef:
    """A model folder and what ``checkpoint.json`` says about it (None when absent)."""

    name: str
    path: str
    step: int | None = None
    readiness: float | None = None
    objective: str | None = None
    run: str | None = None


def resolve_model(spec: str | Path) -> ModelRef:
    """``"path"`` or ``"name=path"`` -> ModelRef.

    Default name: ``<run>@step-<N>`` if known, else the folder name.

    ``path`` may be a run directory, ``RUN@50%`` or ``RUN@step-N`` (`mlsm.artifacts.checkpoint`)."""
    text = str(spec)
    name, _, path = (("", "", text) if "=" not in text or Path(text).is_dir()
                     else text.partition("="))
    folder = resolve_checkpoint(path)
    if not (folder / "config.json").is_file():
        raise UserError(f"{folder}: not an HF model folder (no config.json); "
                        "pass a save_pretrained folder")
    meta: dict[str, Any] = {}
    if (folder / "checkpoint.json").exists():
        meta = Checkpoint.at(folder).info  # the one reader of checkpoint.json
    step = meta.get("step")
    run = meta.get("run")
    # our runs store the run directory as "run": name checkpoints <run dir name>@step-<N>, the
    # run-spec syntax (a bare @50 reads as 50 %)
    if not name:
        name = (f"{Path(str(run)).name}@step-{step}" if run is not None and step is not None
                else real_path(folder).name)
    readiness = meta.get("readiness")
    return ModelRef(name, str(folder), None if step is None else int(step),
                    None if readiness is None else float(readiness), meta.get("objective"), run)


def cell_max_len(max_len: int, kind: str, model_path: str) -> tuple[int, str]:
    """(The sequence length of a cell, where it comes from). `max_len` when given (> 0); else
    DEFAULT_MAX_LEN, but a retrieval cell (`TaskSpec.kind`) takes the model's own length as
    sentence-transformers does: sentence_bert_config.json's max_seq_length, else the model's
    positions up to MODEL_MAX_LEN_CAP, else DEFAULT_MAX_LEN."""
    from mlsm.hf import model_positions, read_json

    if max_len > 0:
        return max_len, "--max-len"
    if kind != "retrieval":
        return DEFAULT_MAX_LEN, f"the default of {kind} tasks"
    st = Path(model_path) / "sentence_bert_config.json"
    if st.is_file():
        data = read_json(st)
        value = data.get("max_seq_length") if isinstance(data, dict) else None
        if not isinstance(value, int) or isinstance(value, bool) or value < 4:
            raise UserError(f"{st}: max_seq_length is {value!r}, not a length of 4 tokens or "
                            "more; fix the file or pass --max-len N")
        return value, "sentence_bert_config.json max_seq_length"
    positions = model_positions(model_path)
    if positions is None:
        return DEFAULT_MAX_LEN, "the model folder gives no length"
    capped = " up to " + str(MODEL_MAX_LEN_CAP) if positions > MODEL_MAX_LEN_CAP else ""
    return min(positions, MODEL_MAX_LEN_CAP), f"config.json max_position_embeddings{capped}"


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from its parts, the same in every process (Python's hash() is salted)."""
    digest = hashlib.sha256("|".join(map(str, parts)).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def training_order(n: int, seed: int, task: str, epochs: int) -> list[list[int]]:
    """One permutation of range(n) per epoch, from (seed, task) only.

    The same for every model.
    """
    gen = torch.Generator().manual_seed(stable_seed("order", seed, task))
    return [torch.randperm(n, generator=gen).tolist() for _ in range(epochs)]


def step_budget(n: int, cfg: dict[str, Any]) -> int:
    """The optimizer steps of a run over `n` training items, the same rule for every task kind:
    ``cfg["epochs"]`` epochs of ceil(n / ``cfg["batch_size"]``) batches, ended earlier by
    ``cfg["max_steps"]`` when it is set (whichever comes first; 0 or absent: no cap)."""
    total = cfg["epochs"] * math.ceil(n / cfg["batch_size"])
    cap = cfg.get("max_steps") or 0
    return min(total, cap) if cap > 0 else total


def optimizer(params: list[nn.Parameter], lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW without decay on biases and LayerNorm weights (1-D tensors), as in BERT
    fine-tuning."""
    decay = [p for p in params if p.ndim >= 2]
    rest = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": rest, "weight_decay": 0.0}]
    try:  # the fused kernel, as the HF Trainer's default: a step ~6x faster on CPU than the
        # per-tensor loop (4.3M parameters: 0.11 s vs 0.66 s; benchmarks/README.md)
        return torch.optim.AdamW(groups, lr=lr, fused=True)
    except (RuntimeError, ValueError):  # a device or dtype the fused kernel does not take
        return torch.optim.AdamW(groups, lr=lr)


def linear_schedule(opt: torch.optim.Optimizer, total: int,
                    warm: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over ``warm`` steps, then linear decay to 0 at step ``total``."""
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else max(0.0, (total - s) / max(1, total - warm)))


def load_backbone(path: str) -> nn.Module:
    """``AutoModel`` in float32 (whatever dtype the folder was saved in). The load report is
    silenced: a masked-LM folder's unused head and an mlsm checkpoint's absent pooler are expected,
    and one report per (model, task, seed, lr) cell would drown the fine-tuning log."""
    from transformers import AutoModel

    from mlsm.hf import load_model, quiet

    with quiet():
        return load_model(AutoModel, path, dtype=torch.float32)


def pick_device(device: str | torch.device = "auto") -> torch.device:
    """``"auto"`` → CUDA when available, else CPU."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)
