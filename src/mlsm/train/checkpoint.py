"""Checkpoints: an HF model folder (+ tokenizer, + our heads) and the state needed to resume.

Layout of checkpoints/<name>/:
  config.json, model.safetensors     HF weights (AutoModelForMaskedLM for MLM-family runs,
                                     AutoModel backbone otherwise)
  tokenizer files                    so the folder is self-contained for fine-tuning
  heads.safetensors, heads.json      objective heads (latent head, MAE decoder) and how to
                                     rebuild them
  training_state.pt                  optimizer state, RNG states (torch.load(weights_only=True))
  checkpoint.json                    step, readiness, objective, run; written last = complete marker

A checkpoint is written into a temporary sibling folder, fsynced, then renamed into place, so a
crash or a failed write never leaves a folder that looks complete and never touches older ones.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from transformers import PreTrainedTokenizerBase

from mlsm.errors import UserError
from mlsm.fileio import building_dir
from mlsm.hf import first_line, quiet
from mlsm.models.backbone import load_student_weights
from mlsm.objectives.base import TrainModule

COMPLETE = "checkpoint.json"


class DamagedCheckpoint(Exception):
    """A checkpoint folder whose files are missing, torn or truncated (the reason is the
    message)."""


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


def save_checkpoint(
    folder: Path,
    module: TrainModule,
    tokenizer: PreTrainedTokenizerBase,
    training_state: dict[str, Any],
    info: dict[str, Any],
) -> Path:
    """Atomically write a complete checkpoint to `folder` (replacing an older one of that name).

    A failed write (disk full: OSError from Python, RuntimeError from torch.save,
    SafetensorError from safetensors) is one line; older checkpoints are never touched."""
    try:
        with building_dir(folder, "tmp") as tmp:
            save_model_folder(module, tokenizer, tmp)
            torch.save(training_state, tmp / "training_state.pt")
            (tmp / COMPLETE).write_text(json.dumps(info, indent=2))
    except (OSError, RuntimeError, SafetensorError) as exc:
        reason = (getattr(exc, "strerror", None) or str(exc) or type(exc).__name__).splitlines()[0]
        raise UserError(f"could not write checkpoint {folder.name} ({reason}); older checkpoints "
                        "are intact — free space and rerun with --resume auto") from None
    return folder


def remove_checkpoint(folder: Path) -> None:
    """Delete a checkpoint so that a crash midway never leaves a folder that looks complete:
    rename it out of the step-* namespace first (atomic), then delete."""
    trash = folder.with_name(f".{folder.name}.del-{os.getpid()}")
    folder.rename(trash)
    shutil.rmtree(trash, ignore_errors=True)


def remove_stale(run_dir: Path) -> None:
    """Remove temporary folders a killed process left in checkpoints/ (names start with '.')."""
    root = Path(run_dir) / "checkpoints"
    for folder in root.glob(".*") if root.is_dir() else []:
        shutil.rmtree(folder, ignore_errors=True)


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Checkpoints with a completion marker, oldest first, as (step, folder). The step is read
    from the name, so a torn marker still lists its folder (`verify` then reports it)."""
    root = Path(run_dir) / "checkpoints"
    found = []
    for folder in root.glob("step-*") if root.is_dir() else []:
        if (folder / COMPLETE).is_file() and folder.name[5:].isdigit():
            found.append((int(folder.name[5:]), folder))
    return sorted(found)


def _check_safetensors(path: Path) -> None:
    """Raise DamagedCheckpoint unless `path` is a whole safetensors file (header + every tensor)."""
    if not path.is_file():
        raise DamagedCheckpoint(f"{path.name} is missing")
    size = path.stat().st_size
    try:
        with open(path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n)) if 8 + n <= size else None
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
                  default=0)
    except (OSError, ValueError, TypeError, KeyError, AttributeError, IndexError):
        raise DamagedCheckpoint(f"{path.name} has no valid header") from None
    if 8 + n + end != size:
        raise DamagedCheckpoint(f"{path.name} is truncated ({size:,} of {8 + n + end:,} bytes)")


def read_checkpoint(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(checkpoint.json, training state) of a checkpoint after checking every file is whole.

    Raises DamagedCheckpoint for torn/truncated/missing files, UserError for a training state
    that is not a safe (weights-only) checkpoint."""
    try:
        info = json.loads((folder / COMPLETE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DamagedCheckpoint(f"{COMPLETE} is unreadable: {first_line(exc)}") from None
    if (not isinstance(info, dict) or not isinstance(info.get("step"), int)
            or not isinstance(info.get("config"), dict)):
        raise DamagedCheckpoint(f"{COMPLETE} lacks step or config")
    _check_safetensors(folder / "model.safetensors")
    if (folder / "heads.json").is_file():
        _check_safetensors(folder / "heads.safetensors")
    state = read_training_state(folder)
    if not isinstance(state, dict) or "optimizer" not in state or state.get("step") != info["step"]:
        raise DamagedCheckpoint("training_state.pt does not hold this checkpoint's "
                                "step and optimizer")
    return info, state


def read_training_state(folder: Path) -> Any:
    path = folder / "training_state.pt"
    if not path.is_file():
        raise DamagedCheckpoint("training_state.pt is missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "weights only" in str(exc).lower():
            raise UserError(f"{path} is not a safe checkpoint (it asks to unpickle objects beyond "
                            "tensors, which mlsm never runs); delete that checkpoint folder and "
                            "resume from another") from None
        raise DamagedCheckpoint(f"training_state.pt is unreadable: {first_line(exc)}") from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        why = first_line(exc)
        raise DamagedCheckpoint(f"training_state.pt is truncated or unreadable: {why}") from None


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
        _, state = read_checkpoint(folder)
    except DamagedCheckpoint as exc:
        raise UserError(f"checkpoint {folder} is damaged ({exc}); resume from another "
                        "checkpoints/step-* folder") from None
    load_weights(folder, module)
    return state
