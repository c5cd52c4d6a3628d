"""The one door through which mlsm loads Hugging Face configs, tokenizers and models.

Every `from_pretrained` in mlsm goes through `load_config`, `load_tokenizer` or `load_model`, so
three promises hold everywhere (docs/reliability.md, "Nobody in"):

- foreign code never runs: `trust_remote_code=False` is always passed (transformers then never
  asks "run custom code? [y/N]" on stdin), and a local folder whose config.json or
  tokenizer_config.json declares `auto_map`, or whose `model_type` is not a built-in
  transformers architecture, is refused before transformers reads it;
- no pickles: weights are read by transformers with `torch.load(weights_only=True)` at most; a
  `pytorch_model.bin` that needs more is refused as "not a safe checkpoint";
- a folder that cannot be loaded (torn JSON, no weights, unknown format) is a `UserError` of one
  line that names the file and keeps the cause's message.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from mlsm import inputs
from mlsm.errors import UserError
from mlsm.limits import MAX_MODEL_JSON_BYTES, MAX_MODEL_PARAMS, transformer_params

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")
# What a broken folder raises inside transformers/tokenizers/safetensors (JSONDecodeError is a
# ValueError; the Rust tokenizers library raises a plain Exception, handled in load_tokenizer).
# huggingface_hub >= 1.0 validates config fields by type (`intermediate_size: 1.5` in a config.json
# raised StrictDataclassFieldValidationError, an internal error before); a config.json of
# `num_attention_heads: 0` raised ZeroDivisionError (ArithmeticError) in its validation.
try:
    from huggingface_hub.errors import StrictDataclassError
except ImportError:  # an older huggingface_hub checks no field
    StrictDataclassError = ValueError  # type: ignore[misc,assignment]
_LOAD_ERRORS = (OSError, ValueError, KeyError, RuntimeError, pickle.UnpicklingError, EOFError,
                SafetensorError, StrictDataclassError, ArithmeticError)


def first_line(exc: BaseException) -> str:
    """An exception's message on one line (its type name only when it has no message)."""
    text = " ".join(str(exc).split())
    return text if text else type(exc).__name__


def read_json(path: Path) -> Any:
    """A JSON file of a model folder or checkpoint, any top level (mlsm.inputs.read_json, whose
    shape checks its callers add); torn or binary content is one UserError."""
    return inputs.read_json(path, "model file", "restore the file or re-export the model folder",
                            kind=object, limit=MAX_MODEL_JSON_BYTES,
                            raised_by="mlsm.limits.MAX_MODEL_JSON_BYTES")


def _check_json(path: Path) -> None:
    """Refuse a config/tokenizer JSON that asks for custom code or names a foreign model_type."""
    if not path.is_file():
        return
    data = read_json(path)
    if not isinstance(data, dict):
        raise UserError(f"{path} must hold a JSON object, got {type(data).__name__}; "
                        "restore the file")
    if "auto_map" in data:
        raise UserError(f"{path} declares auto_map (custom Python code shipped with the model); "
                        "mlsm never runs a folder's code: use a model of a built-in transformers "
                        "architecture")
    model_type = data.get("model_type")
    if path.name != "tokenizer_config.json" and model_type is not None:
        from transformers import CONFIG_MAPPING

        if model_type not in CONFIG_MAPPING:
            raise UserError(f"{path} has model_type {model_type!r}, which is not a built-in "
                            "transformers architecture; mlsm never runs a folder's code: use a "
                            "built-in model type")


def check_folder(path: str | os.PathLike) -> None:
    """Vet a local config file or model/tokenizer folder before transformers reads it.

    Hub ids (not existing paths) pass: transformers itself refuses their code
    (trust_remote_code=False) and HF_HUB_OFFLINE decides whether they are fetched at all.
    """
    p = Path(path)
    text = str(path)
    if not p.exists() and (p.is_absolute() or text.startswith((".", "~")) or text.count("/") > 1
                           or text.endswith(".json")):
        raise UserError(f"{path} does not exist; pass a local model or tokenizer folder")
    if p.is_file():
        _check_json(p)
    elif p.is_dir():
        for name in ("config.json", "tokenizer_config.json"):
            _check_json(p / name)


@contextlib.contextmanager
def quiet(report: bool = False) -> Iterator[None]:
    """transformers' logging while mlsm loads something: no progress bars (a "Loading weights" bar
    per load drowns mlsm's own output and error lines) and, unless `report`, nothing below ERROR.
    Model loads keep their weight-loading report (missing/unexpected keys matter; the expected
    ones are silenced by `quiet_head_mismatch`). The one switch mlsm uses for HF's logging."""
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    if not report:
        hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def quiet_head_mismatch(folder: str | os.PathLike, with_head: bool) -> Iterator[None]:
    """Silence transformers' weight-loading report when only the head is expected to differ.

    MLSM and MAE-LM checkpoints export the encoder alone (architectures "BertModel" etc.), so
    loading one into a masked-LM class (with_head=True) necessarily reports the head as missing,
    which reads like a corrupted checkpoint; loading a masked-LM folder as a bare encoder
    (with_head=False: a teacher, a fine-tuning backbone) reports the unused head. Other folders
    keep the report.
    """
    try:  # bounded like every model file (read_json); a torn one is the loader's to report
        archs = _json_object(Path(folder) / "config.json").get("architectures") or []
    except (UserError, OSError, ValueError):
        archs = []
    bare = bool(archs) and all(str(a).endswith("Model") for a in archs)
    if not archs or bare != with_head:
        yield
        return
    with quiet():
        yield


def _refusal(what: str, path: Any, exc: BaseException) -> UserError:
    text = first_line(exc)
    if isinstance(exc, pickle.UnpicklingError) or "weights_only" in text:
        return UserError(f"{path}: the weights are not a safe checkpoint (a pickle that needs more "
                         "than tensors to load); mlsm loads only safetensors or plain tensor "
                         "files: re-export the model with save_pretrained(safe_serialization=True)")
    if "ignore_mismatched_sizes" in text:  # transformers points at a report mlsm silenced
        return UserError(f"{path}: a tensor of its weights has another size than its config.json "
                         "says; restore the config.json the weights were saved with")
    if "custom code" in text or "trust_remote_code" in text:
        return UserError(f"{path} needs custom Python code to load; mlsm never runs a folder's "
                         "code: use a model of a built-in transformers architecture")
    return UserError(f"cannot load {what} from {path}: {text}")


def load_config(path: str | os.PathLike, **kwargs: Any) -> Any:
    """`AutoConfig.from_pretrained` without remote code; UserError (one line) if it cannot load."""
    from transformers import AutoConfig

    check_folder(path)
    try:
        with quiet():
            return AutoConfig.from_pretrained(str(path), trust_remote_code=False, **kwargs)
    except _LOAD_ERRORS as exc:
        raise _refusal("a model config", path, exc) from None


def load_tokenizer(path: str | os.PathLike, **kwargs: Any) -> Any:
    """`AutoTokenizer.from_pretrained` without remote code.

    UserError (one line) if it cannot load.
    """
    from transformers import AutoTokenizer

    check_folder(path)
    try:
        with quiet():
            tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False, **kwargs)
    except UserError:
        raise
    # the Rust tokenizers library raises a bare Exception for a torn tokenizer.json
    except Exception as exc:
        raise _refusal("a tokenizer", path, exc) from None
    try:  # a tokenizer that loads may still fail on its first text (a WordPiece without [UNK])
        tok("Tokenisers meet odd words: naïve 42 x-ray.")
    except Exception as exc:
        raise UserError(f"tokenizer {path} cannot encode text ({first_line(exc)}); repair it or "
                        "train one with `mlsm train-tokenizer`") from None
    return tok


def load_model(cls: Any, path: str | os.PathLike, **kwargs: Any) -> Any:
    """`cls.from_pretrained` (an Auto* or model class) without remote code or pickled code.

    Refused in one line, before any work: weights that lack encoder tensors the config asks for
    (they would be random: an empty weights file, a config with more layers or another shape),
    tensors whose size differs from the config's, NaN or inf weights. A head the folder does not
    hold (or holds unused) is one note on stderr, unless the caller silenced the report
    (`quiet`, `quiet_head_mismatch`: where that is expected) or asked for `output_loading_info`."""
    from transformers.utils import logging as hf_logging

    check_folder(path)
    p = Path(path)
    if p.is_dir() and not any((p / name).is_file() for name in _WEIGHT_FILES):
        raise UserError(f"{p} has no weights (model.safetensors); pass a model folder written by "
                        "save_pretrained or an mlsm checkpoint")
    if p.is_dir():
        check_parts_agree(p)  # before transformers builds anything from config.json
    with_info = kwargs.pop("output_loading_info", False)
    # a caller that asks for the loading info, or silenced the report, handles what is missing
    report = not with_info and hf_logging.get_verbosity() <= hf_logging.WARNING
    try:
        with quiet():
            model, info = cls.from_pretrained(str(path), trust_remote_code=False,
                                              output_loading_info=True, **kwargs)
    except _LOAD_ERRORS as exc:
        raise _refusal(f"a model ({getattr(cls, '__name__', cls)})", path, exc) from None
    _check_loaded(model, info, path)
    if p.is_dir():
        check_tokenizer_fits(model, p)
    if report and (info["missing_keys"] or info["unexpected_keys"]):
        print(f"mlsm: note: {path} loaded as {type(model).__name__}: "
              f"{_keys(info['unexpected_keys'])} of its weights unused, "
              f"{_keys(info['missing_keys'])} newly initialised", file=sys.stderr)
    return (model, info) if with_info else model


# encoder tensors (not a head's, not the pooler's) in the names of BERT-, RoBERTa-, DeBERTa-,
# ELECTRA- and ModernBERT-style models: "bert.encoder.layer.0.*", "model.layers.3.*", "embeddings.*"
_ENCODER_KEY = re.compile(r"(^|\.)(embeddings|encoder|layers?)\.")


def _check_loaded(model: Any, info: dict[str, Any], path: str | os.PathLike) -> None:
    import torch

    lacking = sorted(k for k in info["missing_keys"] if _ENCODER_KEY.search(k))
    if lacking:
        total = sum(1 for k in model.state_dict() if _ENCODER_KEY.search(k))
        raise UserError(f"{path}: its weights lack {len(lacking)} of the {total} encoder tensors "
                        f"its config.json asks for ({lacking[0]}, ...), which would be random; "
                        "restore the weights file or the config.json they were saved with")
    with torch.no_grad():
        bad = next((n for n, w in model.named_parameters() if not torch.isfinite(w).all()), None)
    if bad is not None:
        raise UserError(f"{path}: its weights hold NaN or inf ({bad}); the checkpoint is "
                        "damaged: use an earlier one")


def _keys(names: Any) -> str:
    names = sorted(names)
    return str(len(names)) + (f" ({', '.join(names[:2])}{', ...' if len(names) > 2 else ''})"
                              if names else "")


# --------------------------------------------------------------------------- parts that agree


def check_parts_agree(folder: Path) -> None:
    """Refuse, before anything is built, a model folder whose files do not belong together:
    a model.safetensors whose header is torn or lies about its length; a config.json describing
    far more parameters than the weights hold (20,000 layers built for a minute before being
    refused) or more than `MAX_MODEL_PARAMS`."""
    config = _json_object(folder / "config.json")
    estimate = estimate_params(config)
    weights, layers = _safetensors_params(folder / "model.safetensors")
    claimed = config.get("num_hidden_layers")
    # fewer layers than the weights hold: the rest were dropped without a word (more are caught
    # below, or by the load's check of weights it would have to leave random)
    if layers and isinstance(claimed, int) and not isinstance(claimed, bool) and claimed < layers:
        raise UserError(f"{folder}: its config.json says num_hidden_layers = {claimed} but "
                        f"model.safetensors holds {layers} encoder layers (the rest would be "
                        "dropped without a word); restore the "
                        "config.json the weights were saved with")
    if estimate is not None and weights is not None and estimate > 2 * weights + 1_000_000:
        raise UserError(f"{folder}: its config.json describes a model of about {estimate:,} "
                        f"parameters but model.safetensors holds {weights:,}; restore the "
                        "config.json the weights were saved with")
    if estimate is not None and estimate > MAX_MODEL_PARAMS:
        raise UserError(f"{folder}: its config.json describes a model of about {estimate:,} "
                        f"parameters, more than mlsm builds ({MAX_MODEL_PARAMS:,}); check its "
                        "sizes (num_hidden_layers, hidden_size, ...)")


def check_tokenizer_fits(model: Any, folder: Path) -> None:
    """Refuse a folder whose tokenizer has more ids than the loaded model has embeddings (an
    index error in the first forward pass on a text that uses them)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embeddings, "num_embeddings", None)
    ids = tokenizer_size(folder)
    if isinstance(rows, int) and ids is not None and ids > rows:
        raise UserError(f"{folder}: its tokenizer has {ids:,} ids but the model only {rows:,} "
                        "embeddings; the tokenizer is another model's: restore the tokenizer "
                        "files the model was saved with")


def _json_object(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = read_json(path)
    return data if isinstance(data, dict) else {}


def estimate_params(config: dict[str, Any]) -> int | None:
    """Parameters of the encoder a config.json describes (`limits.transformer_params`), or None
    when it does not give the usual sizes as positive integers."""
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size",
            "max_position_embeddings")
    sizes = [config.get(k, 0 if k == "max_position_embeddings" else None) for k in keys]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in sizes):
        return None
    return transformer_params(*sizes)


_LAYER_KEY = re.compile(r"(?:^|\.)layers?\.(\d+)\.")
"""A weight of encoder layer N: `bert.encoder.layer.N.`, `layers.N.` (ModernBERT), ..."""


def _safetensors_params(path: Path) -> tuple[int | None, int]:
    """How many numbers model.safetensors holds, from its header (nothing else is read), and how
    many encoder layers its tensor names number (0 when they number none, e.g. a decoder-only
    name scheme this does not know); (None, 0) without the file. A torn header, or one whose
    tensors run past the file's end, is one line."""
    if not path.is_file():
        return None, 0
    try:
        with safe_open(str(path), "pt") as fh:
            names = list(fh.keys())
            params = sum(_numel(fh.get_slice(k).get_shape()) for k in names)
    except (SafetensorError, OSError) as exc:
        raise UserError(f"{path} is damaged or not a safetensors file ({first_line(exc)}); "
                        "restore it from a copy or re-export the model folder") from None
    layers = {m.group(1) for name in names if "decoder" not in name
              for m in [_LAYER_KEY.search(name)] if m}
    return params, len(layers)


def _numel(shape: list[int]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


def tokenizer_size(folder: Path) -> int | None:
    """The largest token id + 1 of the tokenizer files in `folder` (tokenizer.json, else
    vocab.txt), read without loading the tokenizer; None without them or when they do not say."""
    path = folder / "tokenizer.json"
    if path.is_file():
        data = _json_object(path)
        model = data.get("model") if isinstance(data.get("model"), dict) else {}
        vocab = model.get("vocab")
        ids = list(vocab.values()) if isinstance(vocab, dict) else (
            list(range(len(vocab))) if isinstance(vocab, list) else [])
        added = data.get("added_tokens") if isinstance(data.get("added_tokens"), list) else []
        ids += [t.get("id") for t in added if isinstance(t, dict)]
        ids = [i for i in ids if isinstance(i, int) and not isinstance(i, bool)]
        return max(ids) + 1 if ids else None
    vocab_txt = folder / "vocab.txt"
    if vocab_txt.is_file():
        with vocab_txt.open("rb") as fh:
            return sum(1 for _ in fh) or None
    return None


_POSITION_OFFSET_TYPES = ("roberta", "xlm-roberta", "camembert", "longformer")


def model_positions(folder: str | os.PathLike) -> int | None:
    """The longest input the model at `folder` has absolute positions for (config.json's
    max_position_embeddings, less the pad offset of RoBERTa-like models); None for a model
    without absolute positions (DeBERTa's relative ones) or a config that does not say."""
    return positions_of(_json_object(Path(folder) / "config.json"))


def positions_of(config: dict[str, Any]) -> int | None:
    """`model_positions` of a config's dict (`config.json`, or a loaded `config.to_dict()`)."""
    positions = config.get("max_position_embeddings")
    if not isinstance(positions, int) or isinstance(positions, bool) or \
            config.get("position_biased_input") is False:
        return None
    if config.get("model_type") in _POSITION_OFFSET_TYPES:  # positions start after the pad id
        positions -= int(config.get("pad_token_id") or 0) + 1
    return positions


def check_max_len(folder: str | os.PathLike, max_len: int, flag: str,
                  longest: int | None = None) -> None:
    """Refuse a sequence length the model at `folder` has no positions for, before any training
    (inputs longer than max_position_embeddings failed only after training, at evaluation).
    `longest`: the longest input actually tokenised (at most max_len), when only inputs that
    reach beyond the positions are to be refused. A model without absolute positions (DeBERTa's
    relative ones) has no such limit."""
    positions = model_positions(folder)
    if positions is None:
        return
    if (max_len if longest is None else longest) > positions:
        inputs = "" if longest is None else f" lets inputs of {longest} tokens through, which"
        raise UserError(f"{flag} {max_len}{inputs} is longer than the {positions} positions of "
                        f"the model {folder} (config.json max_position_embeddings); use {flag} "
                        f"{positions} or less")
