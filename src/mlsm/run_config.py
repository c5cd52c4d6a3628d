"""A run's configuration, typed: the four fixed groups of `mlsm.config` and the objective group
resolved to its objective's own `Config`.

This is the one door to a whole run config: `load_config` (a YAML recipe and `group.key=value`
overrides), `config_from_dict` (nested dicts, e.g. a run's config.yaml or checkpoint.json), the
`RunConfig` they return and the generated reference (docs/configuration.md,
`python -m mlsm.run_config`). It stands above the objectives and imports them plainly; the schema
below it (`mlsm.config`) imports none, so the objectives (and everything under them) read their
groups from the schema without a circle.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlsm import inputs
from mlsm.config import (
    GROUPS,
    DataConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
    build_dataclass,
    check_groups,
    field_check,
    field_docs,
    merge,
    parse_overrides,
    read_yaml,
)
from mlsm.errors import UserError
from mlsm.objectives import objective_class, resolve_objective, user_objectives


@dataclass
class RunConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    objective: Any = field(default_factory=lambda: resolve_objective({}))
    """The objective's typed Config (its class's `Config`, tagged by its `name`)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


def check_config(cfg: RunConfig) -> None:
    """Checks that span fields: the student's shape, batch sizes and the objective's options."""
    check_groups(cfg.model, cfg.train)
    check = getattr(cfg.objective, "check", None)
    if check is not None:  # options that depend on each other (e.g. solver=fista without targets)
        check()


def config_from_dict(raw: dict[str, Any]) -> RunConfig:
    """Build a RunConfig from nested dicts (a parsed YAML recipe), validating every key."""
    valid = [*GROUPS, "objective"]
    if raw is not None and not isinstance(raw, dict):
        raise UserError(f"a config must be a mapping of groups ({', '.join(valid)}), got {raw!r}")
    raw = dict(raw or {})
    for key in raw:
        if key not in valid:
            raise UserError(f"unknown config group {key!r}{inputs.suggest(key, valid)}; "
                            f"valid groups: {', '.join(valid)}")
    groups = {name: build_dataclass(cls, raw.get(name, {}) or {}, name)
              for name, cls in GROUPS.items()}
    cfg = RunConfig(objective=resolve_objective(raw.get("objective")), **groups)
    _expand_home(cfg)
    check_config(cfg)
    return cfg


# The keys that name a file or folder. `~` in them means the home folder, as in a flag (the shell
# expands it there) and in a study's `out`: `train.out=~/runs/x` wrote into a folder named `~`
# below the working folder, while the checks of `check_apart` looked at the home folder.
PATH_KEYS = (("data", "store"), ("train", "out"), ("model", "init_from"), ("model", "config"),
             ("objective", "dictionary"), ("objective", "teacher"), ("objective", "targets"))


def _expand_home(cfg: RunConfig) -> None:
    for group, key in PATH_KEYS:
        node = getattr(cfg, group)
        value = getattr(node, key, None)
        if isinstance(value, str) and value.startswith("~"):
            setattr(node, key, os.path.expanduser(value))


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


def config_reference() -> str:
    """Markdown reference of every config key: default and docstring (docs/configuration.md)."""
    lines = ["# Configuration reference", "",
             "Generated from the dataclasses in `src/mlsm/config.py` and `src/mlsm/objectives/`",
             "(`python -m mlsm.run_config > docs/configuration.md`). Set keys in a YAML "
             "recipe or on the",
             "command line as `group.key=value`. A value outside a key's range (declared beside",
             "the field) is refused at load in one line.", ""]
    groups: list[tuple[str, type]] = [*GROUPS.items()]
    groups += [(f"objective ({name})", objective_class(name).Config)  # type: ignore[union-attr]
               for name in user_objectives()]
    for title, cls in groups:
        lines += [f"## {title}", "", "| key | default | range | meaning |", "|---|---|---|---|"]
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            has_factory = f.default_factory is not dataclasses.MISSING
            default = f.default_factory() if has_factory else f.default
            check = field_check(f)
            limits = check[1].replace("|", "\\|") if check else ""
            lines.append(f"| `{f.name}` | `{default!r}` | {limits} | {docs.get(f.name, '')} |")
        if not dataclasses.fields(cls):
            lines.append("| | | | no options |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(config_reference())
