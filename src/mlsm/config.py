"""Run configuration as documented data.

A run is described by five groups of plain dataclasses (data, model, objective, optim, train).
Recipes are YAML files in `configs/`; command-line overrides are `group.key=value` pairs whose
values are parsed as YAML. Every field has a docstring right below it. The objective group is a
tagged union: `objective.name` picks one of the objective `Config` dataclasses registered in
`OBJECTIVE_CONFIGS`, and the remaining keys are validated against it and defaulted, so a resolved
config (and the config.yaml of a run) holds every option of its objective.

This module imports no objective: `mlsm.objectives` registers its configs here
(`register_objective`), and `resolve_objective` imports `mlsm.objectives` when it first needs the
registry (at config load), so there is no import cycle between the two.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import subprocess
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mlsm import inputs
from mlsm.errors import UserError
from mlsm.fileio import atomic_write_text


@dataclass
class DataConfig:
    store: str = ""
    """Token store directory written by `mlsm prepare`."""
    max_len: int = 128
    """Sequence length in tokens, special tokens included."""
    seed: int = 0
    """Data seed: sequence order and selected positions depend on it and the step only."""
    mask_rate: float = 0.15
    """Fraction of (non-special) tokens selected for prediction."""
    mask_split: list[float] = field(default_factory=lambda: [0.8, 0.1, 0.1])
    """How selected tokens are corrupted: [MASK] / random token / unchanged (must sum to 1)."""
    exact_count: bool = False
    """false = each non-special token selected with probability mask_rate (BERT; the official
    MLSM code's current pretrainer.py, which the hitchhiker recipes follow); true = exactly
    ⌊mask_rate · max_len⌋ positions per sequence (the 2023 mlsm_pretrainer.py of the official
    repository, since deleted)."""


@dataclass
class ModelConfig:
    arch: str = "bert"
    """HF model_type of a from-scratch student (bert, roberta, deberta-v2, modernbert, ...)."""
    config: str = ""
    """Optional HF config: a config.json file or a model folder; overrides `arch` when set."""
    init_from: str = ""
    """Model folder to continue pre-training from (weights loaded); empty = from scratch."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Config fields to override, e.g. {hidden_size: 256, num_hidden_layers: 4}."""
    max_params: float = 2e10
    """Refuse to build a from-scratch model of more parameters than this, estimated from its
    config before anything is built (a config claiming 20,000 layers built for minutes)."""


@dataclass
class OptimConfig:
    lr: float = 1e-4
    """Peak learning rate (AdamW)."""
    weight_decay: float = 0.01
    """AdamW weight decay; not applied to biases and LayerNorm weights unless `decay_all`."""
    decay_all: bool = False
    """Apply the weight decay to every parameter, biases and normalisation weights included, as
    the official MLSM `pretrainer.py` does (torch's AdamW over `model.parameters()`); false keeps
    1-D tensors out of it, as BERT does. The hitchhiker recipes set it."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    eps: float = 1e-6
    """AdamW epsilon (1e-6 as BERT/RoBERTa pre-training; torch's default 1e-8 is what the official
    MLSM code uses, and the hitchhiker recipes set it)."""
    schedule: str = "linear"
    """`linear` (warmup then linear decay to min_lr) or `wsd` (warmup, stable, linear decay)."""
    warmup: float = 0.02
    """Warmup length: a fraction of train.steps when < 1, else a number of steps."""
    decay: float = 0.2
    """WSD only: length of the final decay phase (fraction of steps when < 1, else steps)."""
    min_lr_ratio: float = 0.0
    """Learning rate at the end of the schedule, as a fraction of lr."""
    clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""


@dataclass
class TrainConfig:
    steps: int = 1000
    """Number of optimizer steps."""
    batch_size: int = 32
    """Global batch size in sequences per optimizer step (all ranks, all accumulation steps)."""
    micro_batch_size: int = 0
    """Sequences per forward pass on one rank; 0 = batch_size / world size (no accumulation)."""
    precision: str = "auto"
    """fp32, bf16 or fp16 autocast; auto = bf16 on CUDA that supports it, else fp32."""
    compile: bool = False
    """torch.compile the student's encoder (in place: checkpoints keep their keys). Pays a
    compile of tens of seconds on the first step for faster steps after it; heads, teacher and
    sparse-coding solver stay eager (their shapes change with the number of targets)."""
    device: str = "auto"
    """cpu, cuda, cuda:N or auto."""
    out: str = "runs/run"
    """Run directory: config.yaml, run.json, metrics.jsonl, checkpoints/."""
    readiness: list[float] = field(default_factory=lambda: [0.1, 0.25, 0.5, 1.0])
    """Fractions of train.steps at which a checkpoint is kept (the Hitchhikers' Guide compares at
    10/25/50/100 %)."""
    save_every: int = 0
    """Also write a checkpoint every N steps (0 = only at readiness levels)."""
    keep_last: int = 2
    """How many of the periodic (non-readiness) checkpoints to keep."""
    log_every: int = 10
    """Write a metrics.jsonl line every N steps."""
    seed: int = 0
    """Model-init and dropout seed (the data order has its own, data.seed)."""
    threads: int = 0
    """torch CPU threads (0 = torch's default)."""
    report_to: list[str] = field(default_factory=list)
    """Experiment trackers that receive every logged metric, the config and the git revision:
    any of tensorboard, wandb, mlflow, trackio (`pip install -e ".[tracking]"`); [] = none."""
    peak_flops: float = 0.0
    """Peak FLOP/s of one device, for the `mfu` metric; 0 = from the built-in GPU table (CPU: no
    mfu unless set)."""


# objective name -> its Config dataclass (a `name: Literal[...]` tag first, then its options).
# Filled by `mlsm.objectives` (register_objective); INTERNAL names load but are not offered
# to users.
OBJECTIVE_CONFIGS: dict[str, type] = {}
INTERNAL_OBJECTIVES: set[str] = set()


def register_objective(config_cls: type, internal: bool = False) -> None:
    """Make `config_cls` (a dataclass whose first field is its literal `name`) loadable."""
    name = dataclasses.fields(config_cls)[0].default
    OBJECTIVE_CONFIGS[name] = config_cls
    if internal:
        INTERNAL_OBJECTIVES.add(name)


def user_objectives() -> list[str]:
    """The objective names offered to users (help, docs, error messages)."""
    _registry()
    return [n for n in OBJECTIVE_CONFIGS if n not in INTERNAL_OBJECTIVES]


def _registry() -> dict[str, type]:
    if not OBJECTIVE_CONFIGS:
        import mlsm.objectives  # noqa: F401  (registers every objective's Config here)
    return OBJECTIVE_CONFIGS


def resolve_objective(raw: Any) -> Any:
    """The objective group as its typed Config: name checked, options validated and defaulted."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise UserError(f"objective must be a mapping, got {raw!r}; write objective.name={raw} "
                        "(or `objective: {name: ...}` in YAML)")
    raw = {"name": "mlm", **raw}
    name = raw["name"]
    if not isinstance(name, str) or name not in _registry():
        raise UserError(f"unknown objective.name {name!r}; valid: {', '.join(user_objectives())}")
    return build_dataclass(OBJECTIVE_CONFIGS[name], raw, "objective")


@dataclass
class RunConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    objective: Any = field(default_factory=lambda: resolve_objective({}))
    """The objective's typed Config (one of OBJECTIVE_CONFIGS, tagged by its `name`)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


_GROUPS = {"data": DataConfig, "model": ModelConfig, "optim": OptimConfig, "train": TrainConfig}

# Range of each numeric/choice field, checked when a config is loaded (so a bad value is one line
# before any work starts): "group.key" -> (predicate on the type-checked value, what it must be).
_POSITIVE = (lambda v: v > 0, "positive")
_NON_NEGATIVE = (lambda v: v >= 0, "0 or more")
_UNIT = (lambda v: 0 <= v <= 1, "between 0 and 1")
TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")  # = mlsm.tracking.BACKENDS (test_tracking)
INT_LIMIT = 2**31  # every integer of a config (a size, a count, a seed) lies below it
FIELD_CHECKS: dict[str, tuple[Any, str]] = {
    "data.max_len": (lambda v: v >= 4, "at least 4 (special tokens included)"),
    "data.mask_rate": (lambda v: 0 < v < 1, "between 0 and 1 (exclusive)"),
    "data.mask_split": (lambda v: len(v) == 3 and min(v) >= 0 and abs(sum(v) - 1) < 1e-6,
                        "three non-negative fractions [mask, random, keep] that sum to 1"),
    "optim.lr": _NON_NEGATIVE, "optim.weight_decay": _NON_NEGATIVE, "optim.eps": _POSITIVE,
    "optim.betas": (lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "two numbers in [0, 1)"),
    "optim.schedule": (lambda v: v in ("linear", "wsd"), "linear or wsd"),
    "optim.warmup": _NON_NEGATIVE, "optim.decay": _NON_NEGATIVE, "optim.min_lr_ratio": _UNIT,
    "optim.clip": _NON_NEGATIVE,
    "model.max_params": _POSITIVE,
    "train.steps": _POSITIVE, "train.batch_size": _POSITIVE,
    "train.micro_batch_size": _NON_NEGATIVE,
    "train.precision": (lambda v: v in ("auto", "fp32", "bf16", "fp16"),
                        "auto, fp32, bf16 or fp16"),
    "train.device": (lambda v: re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", v) is not None,
                     "auto, cpu, mps, cuda or cuda:N"),
    "train.out": (lambda v: bool(v) and not Path(v).is_file(),
                  "a folder (not empty, not an existing file)"),
    "train.readiness": (lambda v: all(0 < f <= 1 for f in v), "fractions in (0, 1]"),
    "train.save_every": _NON_NEGATIVE, "train.keep_last": _NON_NEGATIVE,
    "train.log_every": _POSITIVE, "train.peak_flops": _NON_NEGATIVE,
    "train.threads": (lambda v: 0 <= v <= 1024, "0 (all cores) to 1024"),
    "train.report_to": (lambda v: set(v) <= set(TRACKERS) and len(set(v)) == len(v),
                        f"a list of distinct trackers among {', '.join(TRACKERS)}"),
    # objective options (validated against the objective's own Config at config load)
    "objective.temperature": _POSITIVE,
    "objective.lam": (lambda v: 0 <= v < 1, "in [0, 1) (1 or more makes every sparse code zero)"),
    "objective.fista_iters": _POSITIVE, "objective.kappa": _UNIT, "objective.clm_fraction": _UNIT,
    "objective.decoder_layers": _NON_NEGATIVE,
    "objective.decoder_width": _NON_NEGATIVE, "objective.decoder_heads": _NON_NEGATIVE,
}
# model.overrides keys that must be positive integers when given (HF config sizes).
_SIZE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
              "max_position_embeddings")


def check_config(cfg: RunConfig) -> None:
    """Checks that span fields: the student's shape, batch sizes and the objective's options."""
    sizes = cfg.model.overrides
    for key in _SIZE_KEYS:
        if key in sizes and (not isinstance(sizes[key], int) or isinstance(sizes[key], bool)
                             or sizes[key] <= 0):
            raise UserError(f"model.overrides.{key} must be a positive integer, got {sizes[key]!r}")
    hidden, heads = sizes.get("hidden_size"), sizes.get("num_attention_heads")
    if hidden is not None and heads is not None and hidden % heads:
        raise UserError(f"model.overrides.hidden_size={hidden} is not divisible by "
                        f"num_attention_heads={heads}; "
                        "pick sizes such that hidden_size / num_attention_heads is an integer")
    if cfg.train.micro_batch_size > cfg.train.batch_size:
        raise UserError(f"train.micro_batch_size={cfg.train.micro_batch_size} is larger than "
                        f"train.batch_size={cfg.train.batch_size}; lower it or set it to 0")
    check = getattr(cfg.objective, "check", None)
    if check is not None:  # options that depend on each other (e.g. solver=fista without targets)
        check()


def _as_float(where: str, value: Any) -> float:
    """A float field: an int or a numeric string is converted (YAML 1.1 reads 3e-4, without a
    dot, as a string); booleans, text, null and NaN/inf are refused."""
    number = None
    if isinstance(value, int | float | str) and not isinstance(value, bool):
        with contextlib.suppress(ValueError):
            number = float(value)
    if number is None:
        raise UserError(f"{where} must be of type float, got {value!r}")
    if not math.isfinite(number):
        raise UserError(f"{where} must be a finite number, got {value!r}")
    return number


def _check_int_range(where: str, value: int) -> None:
    """Sizes, counts and seeds past C's int overflow deep inside torch or numpy; a negative seed
    is refused there too."""
    if value >= INT_LIMIT or value < -INT_LIMIT:
        raise UserError(f"{where} must be at most {INT_LIMIT - 1} in size, got {value}")
    if where.endswith("seed") and value < 0:
        raise UserError(f"{where} must be 0 or more, got {value}")


def _check_type(where: str, value: Any, hint: Any) -> Any:
    """Coerce a YAML value to a field's annotated type, or fail with a one-line message."""
    origin = typing.get_origin(hint) or hint
    if origin is float:
        return _as_float(where, value)
    if origin in (types.UnionType, typing.Union):
        return value
    if origin is typing.Literal:
        valid = typing.get_args(hint)
        if value not in valid:
            raise UserError(f"{where} must be one of {', '.join(map(str, valid))}, got {value!r}")
        return value
    # element types too: mask_split=[a, b] is an error here
    if origin is list and isinstance(value, list):
        (item,) = typing.get_args(hint) or (Any,)
        return [_check_type(f"{where}[{i}]", v, item) for i, v in enumerate(value)]
    if origin is Any or isinstance(value, origin):
        if origin is int and isinstance(value, bool):
            raise UserError(f"{where} must be an integer, got {value!r}")
        if origin is int:
            _check_int_range(where, value)
        return value
    raise UserError(f"{where} must be of type {getattr(origin, '__name__', origin)}, got {value!r}")


def build_dataclass(cls: type, values: dict[str, Any], where: str) -> Any:
    """Instantiate `cls` from a dict, rejecting unknown keys with the list of valid ones, wrong
    types, and values outside a field's range: the one declared beside the field,
    `field(..., metadata={"check": (predicate, "what it must be")})`, else `FIELD_CHECKS`."""
    if not isinstance(values, dict):
        raise UserError(f"{where} must be a mapping of keys to values (e.g. "
                        f"{where}.KEY=VALUE), got {values!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in values if k not in names]
    if unknown:
        raise UserError(
            f"unknown key {where}.{unknown[0]}{inputs.suggest(unknown[0], names)}; valid keys of "
            f"{where}: {', '.join(names) or '(none)'}"
        )
    kwargs = {k: _check_type(f"{where}.{k}", v, hints[k]) for k, v in values.items()}
    declared = {f.name: f.metadata.get("check") for f in dataclasses.fields(cls)}
    for key, value in kwargs.items():
        check = declared[key] or FIELD_CHECKS.get(f"{where}.{key}")
        if check is not None and not check[0](value):
            raise UserError(f"{where}.{key} must be {check[1]}, got {value!r}")
    return cls(**kwargs)


def config_from_dict(raw: dict[str, Any]) -> RunConfig:
    """Build a RunConfig from nested dicts (a parsed YAML recipe), validating every key."""
    if raw is not None and not isinstance(raw, dict):
        raise UserError("a config must be a mapping of groups "
                        f"({', '.join([*_GROUPS, 'objective'])}), got {raw!r}")
    raw = dict(raw or {})
    valid = [*_GROUPS, "objective"]
    for key in raw:
        if key not in valid:
            raise UserError(f"unknown config group {key!r}{inputs.suggest(key, valid)}; "
                            f"valid groups: {', '.join(valid)}")
    groups = {name: build_dataclass(cls, raw.get(name, {}) or {}, name)
              for name, cls in _GROUPS.items()}
    cfg = RunConfig(objective=resolve_objective(raw.get("objective")), **groups)
    check_config(cfg)
    return cfg


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """Turn ["optim.lr=3e-4", "train.steps=200"] into a nested dict."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key or "" in key.split("."):
            raise UserError(f"override {pair!r} is not group.key=value; write e.g. optim.lr=3e-4")
        node = out
        *parents, leaf = key.split(".")
        for i, part in enumerate(parents):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UserError(f"override {pair!r} conflicts with "
                                f"{'.'.join(parents[: i + 1])}={node!r} given before")
        try:
            node[leaf] = yaml.safe_load(text) if text else ""
        except yaml.YAMLError as exc:
            raise UserError(f"override {pair!r}: the value is not valid YAML "
                            f"({inputs.yaml_problem(exc)}); quote it") from None
    return out


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict merge; values of `extra` win."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def read_yaml(path: str | Path) -> Any:
    """Parse a user's YAML recipe; any problem is one UserError naming the file and the line."""
    return inputs.read_yaml(path, "config file", "pass a valid YAML recipe (see configs/)")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML recipe (optional) and apply `group.key=value` overrides."""
    raw: dict[str, Any] = {}
    if path:
        raw = read_yaml(path) or {}
        if not isinstance(raw, dict):
            raise UserError(f"config file {path} must be a YAML mapping of groups (data:, "
                            f"model:, objective:, optim:, train:), got a {type(raw).__name__}; see "
                            "configs/ for examples")
    return config_from_dict(merge(raw, parse_overrides(overrides or [])))


def config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def save_config(cfg: RunConfig, path: Path) -> None:
    """Write the resolved config as YAML (atomically)."""
    atomic_write_text(path, yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def git_revision() -> str:
    """The git revision of the mlsm source tree, or 'unknown' outside a checkout."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here, capture_output=True, text=True, timeout=5,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if out.returncode != 0:
        return "unknown"
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def machine_description() -> str:
    """One line naming the machine results came from: CPU model, cores, RAM, torch, GPU."""
    import contextlib
    import os
    import platform

    import torch

    cpu = platform.processor()
    try:  # platform.processor() is empty on most Linux systems; /proc/cpuinfo names the model
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    parts = [f"{platform.machine()} {cpu}".strip(), f"{os.cpu_count()} CPUs"]
    with contextlib.suppress(ValueError, OSError, AttributeError):  # sysconf is POSIX-only
        parts.append(f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB")
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    parts += [gpu, f"torch {torch.__version__}", f"Python {platform.python_version()}"]
    return ", ".join(parts)


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass (read from its source)."""
    import ast
    import inspect
    import textwrap

    docs: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):  # bases first
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:], strict=False):
            if (isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant)):
                text = str(nxt.value.value)
                docs[node.target.id] = " ".join(text.split())  # type: ignore[union-attr]
    return docs


def config_reference() -> str:
    """Markdown reference of every config key: default and docstring (docs/configuration.md)."""
    lines = ["# Configuration reference", "",
             "Generated from the dataclasses in `src/mlsm/config.py` and `src/mlsm/objectives/`",
             "(`python -m mlsm.config > docs/configuration.md`). Set keys in a YAML "
             "recipe or on the",
             "command line as `group.key=value`.", ""]
    groups: list[tuple[str, type]] = [*_GROUPS.items()]
    groups += [(f"objective ({name})", _registry()[name]) for name in user_objectives()]
    for title, cls in groups:
        lines += [f"## {title}", "", "| key | default | meaning |", "|---|---|---|"]
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            has_factory = f.default_factory is not dataclasses.MISSING
            default = f.default_factory() if has_factory else f.default
            lines.append(f"| `{f.name}` | `{default!r}` | {docs.get(f.name, '')} |")
        if not dataclasses.fields(cls):
            lines.append("| | | no options |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    # `python -m` runs this file as __main__, a second copy: the registry that mlsm.objectives
    # fills is the one of the imported `mlsm.config`
    from mlsm.config import config_reference as reference

    print(reference())
