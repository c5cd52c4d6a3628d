"""Checkpoints: the one module that writes, verifies and reads a checkpoint folder, and resolves the
names users give one (``FOLDER``, ``RUN``, ``RUN@50%``, ``RUN@step-N``) by reading the run's
markers (the grammar and the choice among them: `mlsm.artifacts.run_spec`).

Layout of <run>/checkpoints/step-NNNNNNN/:
  config.json, model.safetensors     HF weights (what `from_pretrained` loads)
  tokenizer files                    so the folder is self-contained for fine-tuning
  heads.safetensors, heads.json      objective heads (latent head, MAE decoder, probe)
  training_state.pt                  optimizer state (torch.load(weights_only=True))
  checkpoint.json                    step, readiness, objective, run config and the facts readers
                                     need (latent_head, pll_refusal); written last = complete

The facts are written at save time by the trainer, which knows its objective, so that no reader
imports the objectives to understand a folder. A checkpoint or export written by mlsm 0.1.0 lacks
them: reading them refuses in one line naming `mlsm migrate`, which writes them in once
(`mlsm.migrate`, above the objectives). No answer depends on what a process has imported.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from mlsm.artifacts.fingerprint import folder_fingerprint
from mlsm.artifacts.outputs import OutputKind
from mlsm.artifacts.probe_record import recorded_checkpoint_name
from mlsm.artifacts.run_spec import SYNTAX, RunCheckpoints, Saved, split_spec
from mlsm.errors import UserError
from mlsm.fileio import atomic_write_text, building_dir
from mlsm.inputs import field_problem, read_json

COMPLETE = "checkpoint.json"
SAVING = ".mlsm-saving"
"""Present while a save writes into an existing folder file by file (`MLSMTrainer.save_model`):
removed after its checkpoint.json, so a folder a kill left half old, half new is refused."""
EXPORT_MARKER = "mlsm.json"  # an `mlsm export` folder's provenance (integrations/export.py)
EXPORT_FORMAT = "mlsm-export"  # the `format` field of an export's mlsm.json


def is_export(out: Path) -> bool:
    """Whether `out` holds an export mlsm wrote (its mlsm.json names `EXPORT_FORMAT`); torch-free,
    so `mlsm export` refuses an --out holding something else before the heavy imports."""
    try:
        return read_json(out / EXPORT_MARKER, "export marker", "").get("format") == EXPORT_FORMAT
    except UserError:  # missing, torn or foreign: not an export of ours
        return False


EXPORT_KIND = OutputKind("mlsm export", ours=is_export)  # `mlsm export --out`: replaced whole
HF_LATENT_HEAD = "latent"  # the heads.json name an HF folder that is not ours is read under
FACTS = ("latent_head", "pll_refusal")  # what a marker records for its readers
MIGRATE = "mlsm migrate"  # the verb that writes them into a marker of mlsm 0.1.0
_FIX = "restore it from a copy of the checkpoint, or pass another intact checkpoints/step-* folder"


class DamagedCheckpoint(Exception):
    """A checkpoint folder whose files are missing, torn or truncated (the reason is the
    message)."""


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


# ----------------------------------------------------------------------------- writing


@contextmanager
def writing(folder: Path, info: dict[str, Any]) -> Iterator[Path]:
    """Yield a fresh temporary folder to write a checkpoint's files into; when the block ends,
    `info` is written as checkpoint.json (last: the completion marker) and the folder replaces
    `folder` atomically. A failed write (disk full: OSError from Python, RuntimeError from
    torch.save, SafetensorError) is one line; older checkpoints are never touched."""
    from safetensors import SafetensorError

    try:
        with building_dir(folder, "tmp") as tmp:
            yield tmp
            write_marker(tmp, info)
    except (OSError, RuntimeError, SafetensorError) as exc:
        reason = (getattr(exc, "strerror", None) or str(exc) or type(exc).__name__).splitlines()[0]
        raise UserError(f"could not write checkpoint {folder.name} ({reason}); older checkpoints "
                        "are intact — free space and rerun with --resume auto") from None


def write_marker(folder: Path, info: dict[str, Any], name: str = COMPLETE) -> None:
    """Write `info` as the folder's checkpoint.json (the completion marker) or, with
    name=EXPORT_MARKER, an export's mlsm.json: the one writer of both files (the training loop
    through `writing`, the HF Trainer integration, `mlsm export` and `mlsm migrate`)."""
    atomic_write_text(folder / name, json.dumps(info, indent=2))


def remove_checkpoint(folder: Path) -> None:
    """Delete a checkpoint so that a crash midway never leaves a folder that looks complete:
    rename it out of the step-* namespace first (atomic), then delete."""
    trash = folder.with_name(f".{folder.name}.del-{os.getpid()}")
    folder.rename(trash)
    shutil.rmtree(trash, ignore_errors=True)


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Checkpoints with a completion marker, oldest first, as (step, folder). The step is read
    from the name, so a torn marker still lists its folder (`verify` then reports it)."""
    root = Path(run_dir) / "checkpoints"
    found = []
    for folder in root.glob("step-*") if root.is_dir() else []:
        if (folder / COMPLETE).is_file() and folder.name[5:].isdigit():
            found.append((int(folder.name[5:]), folder))
    return sorted(found)


# ----------------------------------------------------------------------------- verifying


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


def verify(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(checkpoint.json, training state) of a checkpoint after checking every file is whole.

    Raises DamagedCheckpoint for torn/truncated/missing files, UserError for a training state
    that is not a safe (weights-only) checkpoint."""
    try:
        info = json.loads((folder / COMPLETE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DamagedCheckpoint(f"{COMPLETE} is unreadable: {_one_line(exc)}") from None
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
    """training_state.pt, loaded weights-only (a pickle asking for more is one line)."""
    import pickle

    import torch

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
        raise DamagedCheckpoint(f"training_state.pt is unreadable: {_one_line(exc)}") from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise DamagedCheckpoint("training_state.pt is truncated or unreadable: "
                                f"{_one_line(exc)}") from None


# ----------------------------------------------------------------------------- reading


def _mapping(value: Any) -> dict[str, Any]:
    """`value` if it is a JSON object, else {} (a hand-edited field of the wrong type)."""
    return value if isinstance(value, dict) else {}


def recorded_facts(info: dict[str, Any]) -> tuple[str, str | None] | None:
    """(latent head, PLL refusal) as a marker (checkpoint.json, mlsm.json) records them; None when
    it does not record both (mlsm 0.1.0 wrote neither): the reader refuses, `mlsm migrate` adds
    them."""
    head, refusal = info.get("latent_head"), info.get("pll_refusal")
    if not isinstance(head, str) or not head or "pll_refusal" not in info:
        return None
    if refusal is not None and not isinstance(refusal, str):
        return None
    return head, refusal or None


def migration_target(folder: Path) -> Path:
    """What `mlsm migrate` is told to migrate for `folder`: its run when it is a checkpoint of one
    (every checkpoint of the run at once), else the folder itself."""
    run = folder.parent.parent
    return run if folder.parent.name == "checkpoints" and is_run_dir(run) else folder


@dataclass
class Checkpoint:
    """A model folder and what mlsm knows of it. kind: "checkpoint" (checkpoint.json), "export"
    (`mlsm export`, mlsm.json) or "hf" (any other model folder: no objective, step or config;
    not ours, so scored as a masked LM with no refusal)."""

    folder: Path
    kind: str
    info: dict[str, Any] = field(repr=False)
    """The marker file as written (checkpoint.json or mlsm.json; {} for an HF folder)."""
    step: int | None
    readiness: float | None
    objective: str | None
    """The objective's name ("probe" for a probe checkpoint or an export shipping a probe)."""
    config: dict[str, Any] = field(repr=False)
    """The run's resolved config as saved ({} for an HF folder or an export)."""
    facts_of: tuple[Any, Any, dict[str, Any], Any] = field(default=(None, None, {}, None),
                                                          repr=False)
    """(objective naming the latent head, objective deciding the PLL refusal, its config, the
    run's total steps): what `mlsm migrate` computes the facts from, for a marker without them."""

    @cached_property
    def _facts(self) -> tuple[str, str | None]:
        if self.kind == "hf":  # not ours: no objective, no refusal; heads under mlsm's own name
            return HF_LATENT_HEAD, None
        facts = recorded_facts(self.info)
        if facts is None:
            marker = self.folder / (COMPLETE if self.is_checkpoint else EXPORT_MARKER)
            raise UserError(f"{marker} does not record the latent head and PLL refusal its "
                            "readers need (mlsm 0.1.0 wrote neither); add them once with: "
                            f"{MIGRATE} {migration_target(self.folder)}")
        return facts

    @property
    def latent_head(self) -> str:
        """heads.json name of the latent head, as the marker records it (the objective declares
        it); a marker without it is refused, naming `mlsm migrate`."""
        return self._facts[0]

    @property
    def pll_refusal(self) -> str | None:
        """Why this folder cannot be scored word by word through its encoder, or None, as the
        marker records it; a marker without it is refused, naming `mlsm migrate`."""
        return self._facts[1]

    @classmethod
    def open(cls, spec: str | os.PathLike) -> Checkpoint:
        """The checkpoint a spec names: FOLDER, RUN (its final checkpoint), RUN@50%, RUN@step-N,
        or any HF model folder (or hub id, which has no facts)."""
        return cls.at(resolve_checkpoint(spec))

    @classmethod
    def at(cls, folder: str | os.PathLike) -> Checkpoint:
        """The facts of one folder (no spec resolution)."""
        folder = Path(folder)
        if (folder / SAVING).exists():
            raise UserError(f"{folder} was being saved when its writer stopped ({SAVING} is "
                            "there): its files are of two saves; save it again "
                            "(trainer.save_model(FOLDER)) or use another checkpoint")
        if (folder / COMPLETE).is_file():
            return cls._checkpoint(folder)
        if (folder / EXPORT_MARKER).is_file():
            return cls._export(folder)
        return cls(folder, "hf", {}, None, None, None, {})

    @classmethod
    def _checkpoint(cls, folder: Path) -> Checkpoint:
        info = read_json(folder / COMPLETE, "checkpoint file", _FIX,
                         fields={"step": "int?", "readiness": "number?", "objective": "text?",
                                 "run": "text?", "latent_head": "text?", "pll_refusal": "text?"})
        config = _mapping(info.get("config"))
        objective_cfg = _mapping(config.get("objective"))
        name = info.get("objective") or objective_cfg.get("name")
        total = _mapping(config.get("train")).get("steps")
        name = name if isinstance(name, str) else None
        return cls(folder, "checkpoint", info, info.get("step"), info.get("readiness"), name,
                   config, (name, name, objective_cfg, total))

    @classmethod
    def _export(cls, folder: Path) -> Checkpoint:
        info = read_json(folder / EXPORT_MARKER, "export marker",
                         "restore it from a copy of the export, or export the checkpoint again")
        objective_cfg = _mapping(info.get("objective_config"))
        name = "probe" if info.get("probe") else info.get("objective")
        # step and readiness are figures of the card: of the wrong type, they are left out
        step = info.get("step") if field_problem(info, {"step": "int?"}) is None else None
        readiness = (info.get("readiness") if field_problem(info, {"readiness": "number?"}) is None
                     else None)
        fraction = readiness is not None and 0 < readiness <= 1
        total = round(step / readiness) if isinstance(step, int) and fraction else None
        # the heads shipped decide the latent head's name (a probe's, when it ships one); the
        # export's own objective decides its PLL refusal, even when it ships a probe
        return cls(folder, "export", info, step, readiness,
                   name if isinstance(name, str) else None, {},
                   (name, info.get("objective"), objective_cfg, total))

    # ------------------------------------------------------------------ what readers ask

    @property
    def is_checkpoint(self) -> bool:
        return self.kind == "checkpoint"

    @property
    def tokens(self) -> int | None:
        return self.info.get("tokens")

    @property
    def run(self) -> str | None:
        """The run directory that wrote it (as recorded)."""
        run = self.info.get("run")
        return run if isinstance(run, str) else None

    def section(self, name: str) -> dict[str, Any]:
        """One group of the run config ("data", "train", "objective", ...); {} when absent."""
        return _mapping(self.config.get(name))

    @property
    def store(self) -> str:
        """The token store the run trained on ("" when none is recorded)."""
        store = self.section("data").get("store")
        return store if isinstance(store, str) else ""

    @property
    def probe_run(self) -> Path:
        """Where `mlsm probe` puts this checkpoint's probe run: ``<run>/probe-<name>``."""
        return probe_run_of(self.folder)

    @cached_property
    def heads_meta(self) -> dict[str, Any] | None:
        """heads.json (None without one); read once."""
        path = self.folder / "heads.json"
        return read_json(path, "heads file", _FIX) if path.is_file() else None

    @cached_property
    def head_tensors(self) -> dict[str, Any]:
        """heads.safetensors, loaded once; a missing or damaged file is one line."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        path = self.folder / "heads.safetensors"
        try:
            return load_file(path)
        except (OSError, SafetensorError, ValueError, RuntimeError) as exc:
            raise UserError(f"{path} is missing or damaged ({_one_line(exc)}); restore it from a "
                            "copy or use another checkpoint of the run") from None

    @cached_property
    def exports_vocab_head(self) -> bool:
        """Whether the HF model was saved with its vocabulary head (*ForMaskedLM): MTL, MLM and
        KD checkpoints; a pure MLSM checkpoint saves only the encoder."""
        path = self.folder / "config.json"
        if not path.is_file():
            return False
        archs = read_json(path, "model config", "restore the model folder's config.json",
                          fields={"architectures": "list?"}).get("architectures") or []
        return any(str(a).endswith(("ForMaskedLM", "ForPreTraining")) for a in archs)

    @cached_property
    def fingerprint(self) -> str:
        """The folder's content fingerprint (`mlsm.artifacts.fingerprint.folder_fingerprint`)."""
        return folder_fingerprint(self.folder)

    def require_pll(self) -> None:
        """Refuse, in one line, a folder that cannot be scored word by word through its encoder
        (MAE-LM, MAE-MLSM, CLM, CLM -> MLM before its MLM phase, a probe of one)."""
        if self.pll_refusal:
            raise UserError(f"{self.folder} is a {self.objective} checkpoint: {self.pll_refusal}; "
                            f"evaluate it by fine-tuning: mlsm finetune {self.folder} "
                            "--tasks TASKS")


def probe_run_of(checkpoint: str | os.PathLike) -> Path:
    """Where `mlsm probe CHECKPOINT` puts its run by default: ``<run>/probe-<checkpoint name>``."""
    folder = Path(checkpoint)
    return folder.parent.parent / f"probe-{folder.name}"


# ----------------------------------------------------------------------------- run specs


def is_run_dir(path: str | os.PathLike) -> bool:
    """True for a directory with a ``checkpoints/`` folder (what `pretrain` writes)."""
    return (Path(path) / "checkpoints").is_dir()


# what _complete_checkpoints reads of each checkpoint.json (a hand-edited one is named)
_MARKER_FIELDS = {"step": "int", "readiness": "number?", "config.train.steps": "int?",
                  "config.train.readiness": "numbers?"}
_FIX_MARKER = "restore it from a copy, or delete that checkpoint folder to use the others"


def _complete_checkpoints(path: str | os.PathLike) -> RunCheckpoints:
    """Read a run directory's complete checkpoints; UserError when it has none."""
    root = Path(path)
    found, total, readiness = [], 0, (1.0,)
    for folder in sorted((root / "checkpoints").glob("step-*")):
        marker = folder / COMPLETE
        if not marker.is_file():
            continue  # being written, or killed while writing: not a checkpoint
        info = read_json(marker, "checkpoint file", _FIX_MARKER, fields=_MARKER_FIELDS)
        found.append(Saved(info["step"], folder))
        train = (info.get("config") or {}).get("train") or {}
        if not train.get("steps") and not info.get("readiness"):
            raise UserError(f"checkpoint file {marker} names neither config.train.steps nor "
                            f"readiness, so the run's length is unknown; {_FIX_MARKER}")
        total = int(train.get("steps") or round(info["step"] / info["readiness"]))
        readiness = tuple(float(r) for r in train.get("readiness") or readiness)
    if not found:
        raise UserError(f"{root}: the run has no complete checkpoint in {root / 'checkpoints'} "
                        "yet; train it (mlsm pretrain) or pass a checkpoint folder")
    return RunCheckpoints(root, tuple(sorted(found, key=lambda c: c.step)), total, readiness)


def _run_checkpoint(base: Path) -> Path:
    """The checkpoint a run names without a suffix: for a fitted probe run, the one its probe.json
    names (a fit killed after writing its record, before pruning an earlier fit's later step-N,
    leaves both); for any other run, its final one."""
    run = _complete_checkpoints(base)
    named = recorded_checkpoint_name(base)
    found = next((c for c in run.checkpoints if c.path.name == named), None)
    return found.path if found is not None else run.final().path


def resolve_checkpoint(spec: str | os.PathLike) -> Path:
    """The checkpoint folder a spec names (`mlsm.artifacts.run_spec`); other paths come back
    unchanged."""
    base, suffix = split_spec(spec)
    if not suffix:
        return _run_checkpoint(base) if is_run_dir(base) else base
    if not is_run_dir(base):
        raise UserError(f"{spec}: {base} is not a run directory (no checkpoints/ folder); "
                        f"the @ suffix selects a checkpoint of a run: {SYNTAX}")
    return _complete_checkpoints(base).pick(spec, suffix)


def readiness_checkpoints(spec: str | Path) -> list[Path]:
    """Every readiness checkpoint of a run (``train.readiness``), in step order."""
    base, suffix = split_spec(spec)
    if suffix or not is_run_dir(base):
        raise UserError(f"{spec}: --readiness all needs a run directory without @ suffix (a folder "
                        "with checkpoints/), not a checkpoint")
    return _complete_checkpoints(base).readiness_folders()


def expand_models(specs: list[str | Path] | tuple[str | Path, ...],
                  readiness: str = "final") -> list[str]:
    """Model arguments of `finetune` (``[NAME=]SPEC``) after ``--readiness``: ``final`` keeps them,
    ``all`` replaces every run directory by its readiness checkpoints, named ``NAME@step-<N>``
    (the run-spec syntax: ``@50`` read as a percent); other
    models (checkpoint folders, ``RUN@...``, public models: reference lines in `mlsm report`)
    stay."""
    if readiness == "final":
        return [str(s) for s in specs]
    if readiness != "all":
        raise UserError(f"--readiness {readiness}: use final (the default) or all")
    out = []
    for spec in map(str, specs):
        name, _, path = (("", "", spec) if "=" not in spec or Path(spec).is_dir()
                         else spec.partition("="))
        base, suffix = split_spec(path)
        if suffix or not is_run_dir(base):
            out.append(spec)
            continue
        for ckpt in readiness_checkpoints(path):
            step = int(ckpt.name.removeprefix("step-"))
            out.append(f"{name}@step-{step}={ckpt}" if name else str(ckpt))
    return out
