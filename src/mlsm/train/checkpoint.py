"""Saving a training module into a checkpoint folder, and restoring it from one.

The folder itself (layout, the atomic write, the completion marker, verification, listing and
pruning, the facts readers need) belongs to `mlsm.artifacts.checkpoint`; this module adds only what
needs the model: writing the HF folder and heads of a `TrainModule`, recording the facts its
objective declares, and loading weights back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import PreTrainedTokenizerBase

from mlsm.artifacts.checkpoint import DamagedCheckpoint, verify, writing
from mlsm.errors import UserError
from mlsm.hf import quiet
from mlsm.models.backbone import load_student_weights
from mlsm.objectives import checkpoint_facts
from mlsm.objectives.base import TrainModule


def save_model_folder(module: TrainModule, tokenizer: PreTrainedTokenizerBase,
                      folder: Path) -> None:
    """Write the HF folder + heads (what users load), as the objective declares; no training
    state."""
    model = module.exported_model()
    with quiet(report=True):  # one bar per checkpoint shard is noise in a training log
        model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    heads = module.exported_heads().state_dict()
    if heads:
        tensors = {k: v.detach().contiguous().cpu() for k, v in heads.items()}
        save_file(tensors, folder / "heads.safetensors")
        (folder / "heads.json").write_text(json.dumps(module.objective.head_meta(), indent=2))


def with_facts(info: dict[str, Any]) -> dict[str, Any]:
    """checkpoint.json `info` plus the facts readers need (latent head name, PLL refusal), as the
    objective it names declares them for its step, so no reader imports the objectives."""
    config = info.get("config") if isinstance(info.get("config"), dict) else {}
    objective = config.get("objective") if isinstance(config.get("objective"), dict) else {}
    train = config.get("train") if isinstance(config.get("train"), dict) else {}
    name = info.get("objective") or objective.get("name")
    return {**info, **checkpoint_facts(name, objective, info.get("step"), train.get("steps"))}


def save_checkpoint(
    folder: Path,
    module: TrainModule,
    tokenizer: PreTrainedTokenizerBase,
    training_state: dict[str, Any],
    info: dict[str, Any],
) -> Path:
    """Atomically write a complete checkpoint to `folder` (replacing an older one of that name);
    a failed write is one line and older checkpoints are never touched."""
    with writing(folder, with_facts(info)) as tmp:
        save_model_folder(module, tokenizer, tmp)
        torch.save(training_state, tmp / "training_state.pt")
    return folder


def load_weights(folder: Path, module: TrainModule) -> None:
    """Restore student and head weights from `folder`; another model size is one line."""
    try:
        load_student_weights(module.exported_model(), module.exported_heads(), folder)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()
        detail = next((ln.strip() for ln in first if "size mismatch" in ln),
                      first[0] if first else "")
        raise UserError(f"checkpoint {folder} does not match the model ({detail[:160]}); resume "
                        "with the model config the run was started with") from None


def load_training_state(folder: Path, module: TrainModule) -> dict[str, Any]:
    """Restore student and head weights from `folder` and return its training state."""
    try:
        _, state = verify(folder)
    except DamagedCheckpoint as exc:
        raise UserError(f"checkpoint {folder} is damaged ({exc}); resume from another "
                        "checkpoints/step-* folder") from None
    load_weights(folder, module)
    return state
