"""The run configuration's schema, as documented data.

A run is described by five groups (data, model, objective, optim, train). This module holds the
four fixed groups' dataclasses, each field with its docstring right below it and its range beside
it (`ranged(default, (predicate, "what it must be"))`), and the tools every config-shaped file
uses: `build_dataclass` (unknown keys, types and ranges, one line each), `group.key=value`
overrides, YAML and the resolved config's YAML (where a result came from is
`mlsm.provenance`'s).

It is a leaf: it imports no objective, lazily or not, and keeps no registry that others fill. The
objective group is a tagged union of the objectives' own `Config`s; it is resolved above the
objectives (`mlsm.objectives.resolve_objective`), and a whole run's config is typed and loaded by
`mlsm.run_config` (`load_config`, `config_from_dict`, `RunConfig`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mlsm import inputs
from mlsm.errors import UserError
from mlsm.fileio import atomic_write_text
from mlsm.limits import MAX_MODEL_PARAMS

Check = tuple[Callable[[Any], bool], str]
"""A field's range: a predicate on its type-checked value and what the value must be."""

POSITIVE: Check = (lambda v: v > 0, "positive")
NON_NEGATIVE: Check = (lambda v: v >= 0, "0 or more")
UNIT: Check = (lambda v: 0 <= v <= 1, "between 0 and 1")
TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")  # = train.tracking.BACKENDS
INT_LIMIT = 2**31  # every integer of a config (a size, a count, a seed) lies below it


def whole(v: Any) -> bool:
    """An int, not a bool, inside INT_LIMIT: the part of a range every count, size and seed
    shares (an optional one's `None` is not whole)."""
    return isinstance(v, int) and not isinstance(v, bool) and -INT_LIMIT < v < INT_LIMIT


POSITIVE_INT: Check = (lambda v: whole(v) and v > 0, "a positive whole number")
NON_NEGATIVE_INT: Check = (lambda v: whole(v) and v >= 0, "0 or more")


def changed_fields(obj: Any, cls: type) -> dict[str, Any]:
    """The fields of dataclass `cls` on which `obj` (a `cls` or a subclass) differs from `cls`'s
    defaults: what a user set, for merging onto another config or a stable fingerprint."""
    default = cls()
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(cls)
            if getattr(obj, f.name) != getattr(default, f.name)}


def plain(value: Any) -> Any:
    """A Python argument as a config holds it: tuples and ranges as lists, paths as text."""
    if isinstance(value, tuple | range):
        return list(value)
    if value is not None and hasattr(value, "__fspath__"):
        return str(value)
    return value


class Settings:
    """What every settings group of a verb shares (DictionaryConfig, ProbeFitConfig, BlimpConfig,
    FinetuneConfig): built from flags, Python arguments or a study section with one line per bad
    name or range (`build`), read back as what differs from the defaults (`given`), and merged
    under a function's keyword arguments (`over`). A study's subclass (its own defaults or extra
    fields) is narrowed back to the group (`root`) wherever a verb takes it."""

    SECTION: typing.ClassVar[str] = ""
    """The name a bad value's line starts with when `build` is given no other."""

    @classmethod
    def root(cls) -> type:
        """The group: the class in `cls`'s MRO that names Settings as its base."""
        return next(c for c in cls.__mro__ if Settings in c.__bases__)

    @classmethod
    def build(cls, values: dict[str, Any], where: str = "") -> Any:
        """A config of `cls` from `values` (tuples become lists, paths text), every name, type
        and range checked in one line each."""
        return build_dataclass(cls, {k: plain(v) for k, v in values.items()},
                               where or cls.SECTION)

    def given(self) -> dict[str, Any]:
        """The group's fields on which this config differs from the group's defaults."""
        return changed_fields(self, self.root())

    @classmethod
    def over(cls, config: Any, settings: dict[str, Any], where: str = "") -> Any:
        """A function's settings: `config` (a config of the group, a study's subclass too, or
        None for the defaults) with its keyword `settings` on top (None = not given), as a plain
        config of the group."""
        root = cls.root()
        where = where or root.SECTION
        if config is not None and not isinstance(config, root):
            raise UserError(f"{where}: config must be a {root.__name__}, got "
                            f"{type(config).__name__}")
        base = {} if config is None else config.given()
        return root.build({**base, **{k: v for k, v in settings.items() if v is not None}}, where)


def field_with_default(cls: type, name: str, default: Any) -> Any:
    """`cls`'s field `name` with another default, for a subclass that keeps its own (a study's
    smaller sample): the same range and metavar."""
    (f,) = [f for f in dataclasses.fields(cls) if f.name == name]
    return field(default=default, metadata=f.metadata)


def ranged(default: Any, check: Check) -> Any:
    """A dataclass field with its range beside it: `build_dataclass` (and `check_fields`) refuse a
    value for which `check[0]` is false, in one line saying it must be `check[1]`. A list or dict
    default is copied for each instance."""
    if isinstance(default, list | dict):
        return field(default_factory=lambda: copy.deepcopy(default), metadata={"check": check})
    return field(default=default, metadata={"check": check})


def field_check(f: dataclasses.Field) -> Check | None:
    """The range declared beside a dataclass field (None when it has none)."""
    return f.metadata.get("check")


@dataclass
class DataConfig:
    store: str = ""
    """Token store directory written by `mlsm prepare`."""
    max_len: int = ranged(128, (lambda v: v >= 4, "at least 4 (special tokens included)"))
    """Sequence length in tokens, special tokens included."""
    seed: int = 0
    """Data seed: sequence order and selected positions depend on it and the step only."""
    mask_rate: float = ranged(0.15, (lambda v: 0 < v < 1, "between 0 and 1 (exclusive)"))
    """Fraction of (non-special) tokens selected for prediction."""
    mask_split: list[float] = ranged(
        [0.8, 0.1, 0.1], (lambda v: len(v) == 3 and min(v) >= 0 and abs(sum(v) - 1) < 1e-6,
                          "three non-negative fractions [mask, random, keep] that sum to 1"))
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
    max_params: float = ranged(float(MAX_MODEL_PARAMS), POSITIVE)
    """Refuse to build a from-scratch model of more parameters than this, estimated from its
    config before anything is built (a config claiming 20,000 layers built for minutes)."""


@dataclass
class OptimConfig:
    lr: float = ranged(1e-4, NON_NEGATIVE)
    """Peak learning rate (AdamW)."""
    weight_decay: float = ranged(0.01, NON_NEGATIVE)
    """AdamW weight decay; not applied to biases and LayerNorm weights unless `decay_all`."""
    decay_all: bool = False
    """Apply the weight decay to every parameter, biases and normalisation weights included, as
    the official MLSM `pretrainer.py` does (torch's AdamW over `model.parameters()`); false keeps
    1-D tensors out of it, as BERT does. The hitchhiker recipes set it."""
    betas: list[float] = ranged([0.9, 0.999], (lambda v: len(v) == 2 and all(0 <= b < 1 for b in v),
                                               "two numbers in [0, 1)"))
    """AdamW betas."""
    eps: float = ranged(1e-6, POSITIVE)
    """AdamW epsilon (1e-6 as BERT/RoBERTa pre-training; torch's default 1e-8 is what the official
    MLSM code uses, and the hitchhiker recipes set it)."""
    schedule: str = ranged("linear", (lambda v: v in ("linear", "wsd"), "linear or wsd"))
    """`linear` (warmup then linear decay to min_lr) or `wsd` (warmup, stable, linear decay)."""
    warmup: float = ranged(0.02, NON_NEGATIVE)
    """Warmup length: a fraction of train.steps when < 1, else a number of steps."""
    decay: float = ranged(0.2, NON_NEGATIVE)
    """WSD only: length of the final decay phase (fraction of steps when < 1, else steps)."""
    min_lr_ratio: float = ranged(0.0, UNIT)
    """Learning rate at the end of the schedule, as a fraction of lr."""
    clip: float = ranged(1.0, NON_NEGATIVE)
    """Clip the global gradient norm to this value (0 disables)."""


@dataclass
class TrainConfig:
    steps: int = ranged(1000, POSITIVE)
    """Number of optimizer steps."""
    batch_size: int = ranged(32, POSITIVE)
    """Global batch size in sequences per optimizer step (all ranks, all accumulation steps)."""
    micro_batch_size: int = ranged(0, NON_NEGATIVE)
    """Sequences per forward pass on one rank; 0 = batch_size / world size (no accumulation)."""
    precision: str = ranged("auto", (lambda v: v in ("auto", "fp32", "bf16", "fp16"),
                                     "auto, fp32, bf16 or fp16"))
    """fp32, bf16 or fp16 autocast; auto = bf16 on CUDA that supports it, else fp32."""
    compile: bool = False
    """torch.compile the student's encoder (in place: checkpoints keep their keys). Pays a
    compile of tens of seconds on the first step; heads, teacher and sparse-coding solver stay
    eager (their shapes change with the number of targets). Off by default: on a 2-core CPU it
    made the step slower (BERT 6 x 384: 0.86x eager's speed in fp32, 0.78x in bf16;
    benchmarks/README.md)."""
    device: str = ranged("auto", (lambda v: bool(re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", v)),
                                  "auto, cpu, mps, cuda or cuda:N"))
    """cpu, cuda, cuda:N or auto."""
    out: str = ranged("runs/run", (lambda v: bool(v) and str(v).isprintable()
                                   and not Path(v).is_file(),
                                   "a folder (not empty, not an existing file, no line break or "
                                   "other control character in its name)"))
    """Run directory: config.yaml, run.json, metrics.jsonl, checkpoints/."""
    readiness: list[float] = ranged([0.1, 0.25, 0.5, 1.0],
                                    (lambda v: all(0 < f <= 1 for f in v), "fractions in (0, 1]"))
    """Fractions of train.steps at which a checkpoint is kept (the Hitchhikers' Guide compares at
    10/25/50/100 %)."""
    save_every: int = ranged(0, NON_NEGATIVE)
    """Also write a checkpoint every N steps (0 = only at readiness levels)."""
    keep_last: int = ranged(2, NON_NEGATIVE)
    """How many of the periodic (non-readiness) checkpoints to keep."""
    log_every: int = ranged(10, POSITIVE)
    """Write a metrics.jsonl line every N steps."""
    eval_every: int = ranged(0, NON_NEGATIVE)
    """Validate every N steps and at the last one (0 = never): the held-out loss of the run's own
    objective and its metrics (MLM: masked top-1 `accuracy`) on `eval_batches` batches of the
    chunks right after the run's last batch, the ones the study's held-out readouts use, logged as
    `val_loss`, `val_<metric>` in metrics.jsonl and the trackers (as run_mlm.py's
    eval_strategy=steps). Changes no weight: a study treats it as volatile."""
    eval_batches: int = ranged(4, POSITIVE)
    """Batches of `batch_size` sequences each validation reads (with `eval_every`)."""
    seed: int = 0
    """Model-init and dropout seed (the data order has its own, data.seed)."""
    threads: int = ranged(0, (lambda v: 0 <= v <= 1024, "0 (all cores) to 1024"))
    """torch CPU threads (0 = torch's default)."""
    report_to: list[str] = ranged([], (lambda v: set(v) <= set(TRACKERS) and len(set(v)) == len(v),
                                       f"a list of distinct trackers among {', '.join(TRACKERS)}"))
    """Experiment trackers that receive every logged metric, the config and the git revision:
    any of tensorboard, wandb, mlflow, trackio (`pip install -e ".[tracking]"`); [] = none."""
    peak_flops: float = ranged(0.0, NON_NEGATIVE)
    """Peak FLOP/s of one device, for the `mfu` metric; 0 = from the built-in GPU table, or on a
    CPU the measured GEMM rate of the run's precision at its thread count (measured once per
    machine and cached: mlsm.train.throughput.cpu_peak)."""
    signal_exit_zero: bool = False
    """Exit status of `mlsm pretrain` when SIGTERM or Ctrl-C (SIGINT) stopped it after its
    checkpoint: false = the shell's 128 + signal (143, 130), so a `set -e` script or a scheduler
    sees the run did not finish; true = 0, for a scheduler or wrapper that requeues only jobs
    that exit 0. Either way `--resume auto` continues the run; it never changes a result."""


GROUPS: dict[str, type] = {"data": DataConfig, "model": ModelConfig, "optim": OptimConfig,
                           "train": TrainConfig}
"""The run's fixed groups; the fifth, `objective`, is a union resolved by mlsm.objectives."""
# model.overrides keys that must be positive integers when given (HF config sizes).
_SIZE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
              "max_position_embeddings")


def check_groups(model: ModelConfig, train: TrainConfig) -> None:
    """Checks that span fields of the fixed groups: the student's shape and the batch sizes."""
    sizes = model.overrides
    for key in _SIZE_KEYS:
        if key in sizes and (not isinstance(sizes[key], int) or isinstance(sizes[key], bool)
                             or sizes[key] <= 0):
            raise UserError(f"model.overrides.{key} must be a positive integer, got {sizes[key]!r}")
    hidden, heads = sizes.get("hidden_size"), sizes.get("num_attention_heads")
    if hidden is not None and heads is not None and hidden % heads:
        raise UserError(f"model.overrides.hidden_size={hidden} is not divisible by "
                        f"num_attention_heads={heads}; "
                        "pick sizes such that hidden_size / num_attention_heads is an integer")
    if train.micro_batch_size > train.batch_size:
        raise UserError(f"train.micro_batch_size={train.micro_batch_size} is larger than "
                        f"train.batch_size={train.batch_size}; lower it or set it to 0")


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
    if origin is str and isinstance(value, str) and "\x00" in value:  # open() raised ValueError
        raise UserError(f"{where} holds a NUL byte ({ascii(value)}); no name or path can hold one: "
                        "remove it")
    if origin is Any or isinstance(value, origin):
        if origin is int and isinstance(value, bool):
            raise UserError(f"{where} must be an integer, got {value!r}")
        if origin is int:
            _check_int_range(where, value)
        return value
    raise UserError(f"{where} must be of type {getattr(origin, '__name__', origin)}, got {value!r}")


def build_dataclass(cls: type, values: dict[str, Any], where: str) -> Any:
    """Instantiate `cls` from a dict, rejecting unknown keys with the list of valid ones, wrong
    types, and values outside a field's range: the one declared beside the field (`ranged`)."""
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
    declared = {f.name: field_check(f) for f in dataclasses.fields(cls)}
    for key, value in kwargs.items():
        _check_range(f"{where}.{key}", value, declared[key])
    return cls(**kwargs)


def deciding(obj: Any, cls: type | None = None) -> dict[str, Any]:
    """The settings of a config dataclass that can change a result, for fingerprints: the fields
    of `cls` (default: `obj`'s own class) not marked `metadata["decides"] = False`. Marking the
    others (rather than these) means a new field decides until someone says it cannot, so a
    forgotten mark makes a fingerprint stricter, never blind."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(cls or obj)
            if f.metadata.get("decides", True)}


def check_fields(obj: Any, where: str) -> None:
    """The declared range of every field of a dataclass instance built in Python (not by
    `build_dataclass`), e.g. an objective's typed Config passed to `build_objective`."""
    for f in dataclasses.fields(obj):
        _check_range(f"{where}.{f.name}", getattr(obj, f.name), field_check(f))


def _check_range(where: str, value: Any, check: Check | None) -> None:
    if check is not None and not check[0](value):
        raise UserError(f"{where} must be {check[1]}, got {value!r}")


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
        if not text.isprintable():  # YAML folds "a\nb" into "a b": another path, silently
            raise UserError(f"override {key}={ascii(text)[1:-1]}: the value holds a line break "
                            "or another control character; a value is one line, and a path is "
                            "taken literally: pass one without them")
        try:
            node[leaf] = inputs.parse_yaml(text) if text else ""
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


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """A resolved config (`mlsm.run_config.RunConfig`) as nested dicts, every option included."""
    return dataclasses.asdict(cfg)


def save_config(cfg: Any, path: Path) -> None:
    """Write the resolved config as YAML (atomically)."""
    atomic_write_text(path, yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


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


if __name__ == "__main__":  # a page once gave this command, which printed nothing and exited 0
    raise SystemExit("mlsm.config is not a command; the configuration reference is generated by "
                     "`python -m mlsm.run_config > docs/configuration.md`")
