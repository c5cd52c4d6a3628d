"""Checkpoints: an HF model folder (+ tokenizer, + our heads) and the state needed to resume.

Layout of checkpoints/<name>/:
  config.json, model.safetensors     HF weights (AutoModelForMaskedLM for MLM-family runs,
                                     AutoModel backbone otherwise)
  tokenizer files                    so the folder is self-contained for fine-tuning
  heads.safetensors, heads.json      objective heads (latent head, MAE decoder) and how to rebuild them
  training_state.pt                  optimizer state, RNG states (torch.load(weights_only=True))
  checkpoint.json                    step, readiness, objective, run; written last = complete marker

A checkpoint is written into a temporary sibling folder, fsynced, then renamed into place, so a
crash or a failed write never leaves a folder that looks complete and never touches older ones.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from mlsm.errors import UserError
from mlsm.fileio import replace_dir
from mlsm.models.backbone import Student, load_student_weights

COMPLETE = "checkpoint.json"


def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_model_folder(student: Student, tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    """Write the HF folder + heads (what users load); no training state."""
    model = student.hf if student.exports_vocab_head else student.backbone
    hf_logging.disable_progress_bar()  # one bar per checkpoint shard is noise in a training log
    try:
        model.save_pretrained(folder, safe_serialization=True)
    finally:
        hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(folder)
    if len(student.heads):
        state = {k: v.detach().contiguous().cpu() for k, v in student.heads.state_dict().items()}
        save_file(state, folder / "heads.safetensors")
        (folder / "heads.json").write_text(json.dumps(student.head_meta, indent=2))


def save_checkpoint(
    folder: Path,
    student: Student,
    tokenizer: PreTrainedTokenizerBase,
    training_state: dict[str, Any],
    info: dict[str, Any],
) -> Path:
    """Atomically write a complete checkpoint to `folder` (replacing an older one of that name)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        save_model_folder(student, tokenizer, tmp)
        torch.save(training_state, tmp / "training_state.pt")
        (tmp / COMPLETE).write_text(json.dumps(info, indent=2))
        _fsync_tree(tmp)
        replace_dir(tmp, folder)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"could not write checkpoint {folder.name} ({exc.strerror or exc}); older checkpoints are intact — free space and rerun with --resume auto") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
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
    """Complete checkpoints of a run, oldest first, as (step, folder)."""
    root = Path(run_dir) / "checkpoints"
    found = []
    for folder in root.glob("step-*") if root.is_dir() else []:
        marker = folder / COMPLETE
        if marker.is_file():
            found.append((int(json.loads(marker.read_text())["step"]), folder))
    return sorted(found)


def load_training_state(folder: Path, student: Student) -> dict[str, Any]:
    """Restore student weights from `folder` and return its training state."""
    load_student_weights(student, folder)
    return torch.load(folder / "training_state.pt", map_location="cpu", weights_only=True)
