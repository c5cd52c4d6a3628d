"""The student: any HF encoder built from an AutoConfig (or loaded for continued pre-training).

The student always wraps an `AutoModelForMaskedLM`, so an MLM-family checkpoint is a folder that
`AutoModelForMaskedLM.from_pretrained` loads with exactly our head. Its `forward` is a plain
encoder forward (ids, mask, ... -> last hidden states), so hooks, torch.compile and FSDP see a
normal module. Objectives that predict something else (MLSM's latent head, MAE-LM's decoder) own
those heads themselves (`mlsm.objectives.base.Objective`); they are saved beside the HF files in
`heads.safetensors`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors.torch import load_file
from torch import nn
from transformers import AutoConfig, AutoModelForMaskedLM, PretrainedConfig, PreTrainedTokenizerBase

from mlsm.config import ModelConfig
from mlsm.errors import UserError
from mlsm.hf import check_max_len, estimate_params, load_config, load_model, quiet_head_mismatch
from mlsm.models.heads import mlm_head_fn, read_heads


class Student(nn.Module):
    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf  # an HF *ForMaskedLM: backbone + vocabulary head
        self._vocab_head = mlm_head_fn(hf)

    @property
    def config(self) -> PretrainedConfig:
        return self.hf.config

    @property
    def hidden_size(self) -> int:
        return int(self.hf.config.hidden_size)

    @property
    def backbone(self) -> nn.Module:
        return self.hf.base_model

    def forward(self, input_ids: torch.Tensor, attention_mask: Any, **kw: Any) -> torch.Tensor:
        """Last hidden states (B, T, d). attention_mask: (B, T), or a prepared 4-D mask (CLM);
        kw: further encoder inputs (e.g. position_ids)."""
        return self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                             **kw).last_hidden_state

    def encode(self, input_ids: torch.Tensor, attention_mask: Any, **kw: Any) -> torch.Tensor:
        """Same as calling the student (kept for readability at call sites)."""
        return self(input_ids, attention_mask, **kw)

    def vocab_logits(self, h: torch.Tensor) -> torch.Tensor:
        """(N, d) hidden states at target positions -> (N, |V|) logits of the HF MLM head."""
        return self._vocab_head(h)


def _from_scratch_config(cfg: ModelConfig, tok: PreTrainedTokenizerBase,
                         max_len: int) -> PretrainedConfig:
    def make(**kw: Any) -> PretrainedConfig:
        # kwargs at construction, not setattr afterwards: some configs derive fields from others
        # (e.g. ModernBERT's layer_types from num_hidden_layers)
        return load_config(cfg.config, **kw) if cfg.config else AutoConfig.for_model(cfg.arch, **kw)

    try:
        default = make()
    except (ValueError, OSError) as exc:
        raise UserError(f"cannot build a model config from model.arch={cfg.arch!r} / "
                        f"model.config={cfg.config!r}: {str(exc).splitlines()[0]}") from None
    if "vocab_size" in cfg.overrides:
        raise UserError(f"model.overrides.vocab_size={cfg.overrides['vocab_size']!r} is not used: "
                        f"the vocabulary is the token store's tokenizer's ({len(tok)}); drop it")
    for key in cfg.overrides:
        if not hasattr(default, key):
            raise UserError(f"model.overrides.{key} is not a field of {type(default).__name__}; "
                            "check the spelling")
    # The vocabulary and special ids come from the tokenizer the data was prepared with.
    kw: dict[str, Any] = {**cfg.overrides, "vocab_size": len(tok)}
    for name in ("pad", "bos", "eos", "cls", "sep", "mask"):
        tid = getattr(tok, f"{name}_token_id", None)
        if tid is not None and hasattr(default, f"{name}_token_id"):
            kw[f"{name}_token_id"] = tid
    fallback = getattr(default, "max_position_embeddings", max_len + 2)
    positions = kw.get("max_position_embeddings", fallback)
    # roberta offsets positions by pad + 1
    kw["max_position_embeddings"] = max(positions, max_len + 2)
    try:
        config = make(**kw)
    except (ValueError, TypeError, StrictDataclassError) as exc:  # a value of the wrong type
        raise UserError(f"model.overrides: {type(default).__name__} refuses the values given "
                        f"({' '.join(str(exc).split())[:300]}); fix model.overrides") from None
    size = estimate_params(config.to_dict())
    if size is not None and size > cfg.max_params:  # before minutes of building it
        raise UserError(f"the model of model.arch / model.config / model.overrides would have "
                        f"about {size:,} parameters, more than model.max_params = "
                        f"{cfg.max_params:,.0f}; check its sizes, or raise model.max_params")
    return config


def build_student(cfg: ModelConfig, tok: PreTrainedTokenizerBase, max_len: int,
                  seed: int) -> Student:
    """A from-scratch student (seeded init) or one loaded from `cfg.init_from`."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if cfg.init_from:
            if not Path(cfg.init_from).is_dir():
                raise UserError(f"model.init_from={cfg.init_from} is not a folder; pass a "
                                "checkpoint or HF model folder")
            check_max_len(cfg.init_from, max_len, "data.max_len")  # before the first step
            with quiet_head_mismatch(cfg.init_from, with_head=True):
                hf = load_model(AutoModelForMaskedLM, cfg.init_from)
            if hf.config.vocab_size != len(tok):
                raise UserError(f"model.init_from has vocab size {hf.config.vocab_size} but the "
                                f"token store's tokenizer has {len(tok)}; prepare the corpus with "
                                "that model's tokenizer")
        else:
            hf = AutoModelForMaskedLM.from_config(_from_scratch_config(cfg, tok, max_len))
    return Student(hf)


def load_student_weights(model: nn.Module, heads: nn.Module, folder: Path) -> None:
    """Load weights written by `save_model_folder` into the exported HF `model` (the masked LM or
    its encoder) and the objective's `heads` (exact: used for resume)."""
    state = load_file(folder / "model.safetensors")
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if k.endswith(("decoder.weight", "decoder.bias"))}
    if unexpected or set(missing) - tied:
        raise UserError(f"checkpoint {folder} does not match the model (missing "
                        f"{sorted(set(missing) - tied)[:3]}, unexpected {unexpected[:3]}); resume "
                        "with the config the run was started with")
    if len(heads.state_dict()):
        heads.load_state_dict(read_heads(folder))
