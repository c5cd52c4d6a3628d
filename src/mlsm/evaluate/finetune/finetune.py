"""Paired fine-tuning runs: model folders × tasks × seeds × learning rates.

The protocol of the *Hitchhikers' Guide to Masked Latent Semantic Modeling* (anonymous, under
review; §4.2).

Protocol: AdamW, linear schedule (no warmup unless asked), batch 32, 3 epochs, lr 2e-5, the dev
metric after the last epoch, 5 seeds. What makes the runs *paired* across models:

- the task head is ours (not ``AutoModelForSequenceClassification``) and for seed s it is drawn
  from a ``torch.Generator`` seeded by (s, task, hidden size) only, on CPU, so two backbones with
  the same hidden size start from bit-identical heads;
- the training order for seed s comes from a generator seeded by (s, task) only.

Any HF encoder folder works (``AutoModel`` + ``AutoTokenizer``). Our checkpoints may carry a
``checkpoint.json`` beside ``config.json`` with {"step", "readiness", "objective", "run"}.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mlsm.artifacts.checkpoint import expand_models
from mlsm.artifacts.results_file import (
    append_results,
    cell_key,
    check_model_name,
    read_results,
)
from mlsm.errors import UserError
from mlsm.evaluate.finetune import cell_reuse, protocol, retrieval_cell
from mlsm.evaluate.finetune.cell import (
    ModelRef,
    cell_max_len,
    load_backbone,
    pick_device,
    resolve_model,
    stable_seed,
    training_order,
)
from mlsm.evaluate.finetune.finetune_config import FinetuneConfig, config_of
from mlsm.evaluate.finetune.task_cell import (
    build_head,
    encode,
    load_tokenizer,
    predict,
    score,
    train_cell,
)
from mlsm.evaluate.finetune.tasks import Example, TaskSpec, get_task, load_task
from mlsm.hf import check_max_len
from mlsm.inputs import check_apart
from mlsm.progress import Progress
from mlsm.train import tracking

# the names other modules and tests import from here (their homes: mlsm.evaluate.finetune.cell
# and .task_cell)
__all__ = ["FinetuneConfig", "ModelRef", "build_head", "finetune", "pick_device", "prepare",
           "resolve_model", "run_cell", "train_cell", "training_order", "_load_backbone"]
_load_backbone = load_backbone


# ----------------------------------------------------------------------------- the grid


def _task_data(spec: TaskSpec, data_dir: str | Path | None, max_train: int | None,
               eval_test: bool = False) -> tuple[list[Example], dict[str, list[Example]]]:
    if spec.kind == "retrieval":  # BEIR data: training queries and test splits
        return retrieval_cell.task_data(spec, data_dir, max_train)  # type: ignore[return-value]
    train = load_task(spec.name, spec.train_split, data_dir, max_train)
    evals = {suffix: load_task(spec.name, split, data_dir)
             for suffix, split in spec.eval_splits.items()}
    if eval_test and spec.test_split:  # metric "<name>_test" beside the validation metric
        evals["test"] = load_task(spec.name, spec.test_split, data_dir)
    return train, evals


def _validation_split(spec: TaskSpec, held_out: list[Any], evals: dict[str, Any]) -> Any:
    """Training examples held out for validation, as the task scores them: a retrieval task's
    queries become a split over its corpus, other tasks' examples stay a list."""
    if spec.kind == "retrieval":
        return retrieval_cell.validation_split(held_out, evals)
    return held_out


@dataclass
class Prepared:
    """One model's tokenisation of one task, shared by all its seeds and learning rates."""

    tokenizer: Any
    train: list[dict[str, Any]]  # features of the training set (QA: windows)
    # metric suffix -> (examples, features)
    evals: dict[str, tuple[list[Example], list[dict[str, Any]]]]
    n_train: int = -1  # training examples (QA: questions, not windows); -1: len(train)


def prepare(model: ModelRef, spec: TaskSpec, train: list[Example], evals: dict[str, list[Example]],
            max_len: int) -> Prepared:
    """Tokenise the task's training and evaluation sets with the model's tokenizer."""
    if spec.kind == "retrieval":
        return retrieval_cell.prepare(model, spec, train, evals, max_len)  # type: ignore
    tok = load_tokenizer(model.path, spec)
    prepared = Prepared(tok, encode(tok, spec, train, max_len),
                        {k: (ex, encode(tok, spec, ex, max_len)) for k, ex in evals.items()},
                        len(train))
    every = [prepared.train, *(f for _, f in prepared.evals.values())]
    longest = max((len((f.get("inputs") or {}).get("input_ids") or ()) for feats in every
                   for f in feats), default=0)
    check_max_len(model.path, max_len, "--max-len", longest)  # before training, not at eval
    return prepared


def run_cell(model: ModelRef, spec: TaskSpec, data: Prepared, seed: int, cfg: dict[str, Any],
             device: torch.device, tracker: Any = None) -> list[dict[str, Any]]:
    """One fine-tuning run (model, task, seed, lr) → one result row per metric (also sent to
    `tracker`, an `mlsm.train.tracking.Tracker`, as eval/<metric> at the last step)."""
    if spec.kind == "retrieval":  # a bi-encoder without a head: retrieval_cell
        return retrieval_cell.run_cell(model, spec, data, seed, cfg, device, tracker)  # type: ignore
    start = time.time()
    backbone = load_backbone(model.path).to(device)
    d = getattr(backbone.config, "hidden_size", None) or backbone.config.d_model
    head = build_head(spec, d, seed, cfg.get("head", "cls")).to(device)
    steps = train_cell(backbone, head, data.tokenizer, spec, data.train, seed, cfg, device, tracker)
    rows = []
    for suffix, (examples, feats) in data.evals.items():
        preds = predict(backbone, head, data.tokenizer, spec, feats, examples, device)
        extras = spec.row_extras(preds, examples) if spec.row_extras else {}
        for metric, value in score(spec, preds, examples).items():
            rows.append({
                "model": model.name, "path": model.path, "step": model.step,
                "readiness": model.readiness,
                "objective": model.objective, "run": model.run, "task": spec.name,
                "metric": f"{metric}_{suffix}" if suffix else metric, "value": value, "seed": seed,
                "lr": cfg["lr"], "epochs": cfg["epochs"], "batch_size": cfg["batch_size"],
                "max_len": cfg["max_len"],
                "n_train": data.n_train if data.n_train >= 0 else len(data.train),
                "n_eval": len(examples),
                "fixed_order": bool(cfg.get("fixed_order")), "clip": float(cfg.get("clip", 1.0)),
                "head": cfg.get("head", "cls"), "max_steps": cfg.get("max_steps", 0),
                "seconds": round(time.time() - start, 2), **extras.get(metric, {}),
            })
    if tracker is not None:
        tracker.log({f"eval/{r['metric']}": r["value"] for r in rows}, steps)
    return rows


def _cell_tracker(report_to: Sequence[str], results: Path, ref: ModelRef, spec: TaskSpec, seed: int,
                  cfg: dict[str, Any]) -> tracking.Tracker:
    """One tracker run per cell, named model-task-seed-lr; local files in RESULTS_DIR/tracking."""
    name = f"{ref.name}-{spec.name}-seed{seed}-lr{cfg['lr']:g}".replace("/", "_")
    config = {"model": ref.name, "path": ref.path, "task": spec.name, "seed": seed, **cfg}
    folder = results.parent / "tracking"
    return tracking.open_tracker(list(report_to), folder, config, name, "--report-to")


def _grid(models: Sequence[str | Path], tasks: Sequence[str],
          readiness: str) -> tuple[list[ModelRef], list[TaskSpec]]:
    """The models (each readiness checkpoint of a run with readiness="all") and the tasks of a
    grid; one line for a string where a list belongs, an empty axis, two models of one name or a
    task given twice."""
    for name, value in (("models", models), ("tasks", tasks)):
        if isinstance(value, str | Path):  # a string would be iterated letter by letter
            raise UserError(f"finetune(): {name} must be a list, got the string {str(value)!r}; "
                            f"write [{str(value)!r}]")
    if not models or not tasks:
        raise UserError("finetune needs at least one model and one task")
    refs = [resolve_model(m) for m in expand_models(models, readiness)]
    if len({r.name for r in refs}) != len(refs):
        raise UserError("two models share a name; pass them as name=path to tell them apart")
    for ref in refs:  # names become table cells (compare refuses some)
        check_model_name(ref.name, "model name")
    specs = [get_task(t) for t in tasks]
    twice = sorted({s.name for s in specs if [x.name for x in specs].count(s.name) > 1})
    if twice:
        raise UserError(f"--tasks lists {twice[0]} twice; give each task once")
    return refs, specs


def finetune(models: Sequence[str | Path], tasks: Sequence[str],
             config: FinetuneConfig | None = None, *, results: str | Path = "results.jsonl",
             device: str | torch.device = "auto", readiness: str = "final",
             report_to: Sequence[str] = (), **settings: Any) -> Path:
    """Fine-tune every model on every task for every seed and lr; append dev metrics to `results`.

    ``models``: HF folders or run directories (``RUN``, ``RUN@50%``, ``RUN@step-N``: run specs),
    optionally ``"name=path"``; ``readiness="all"`` takes every readiness checkpoint of each run
    directory (named ``name@step-<N>``). The settings are `FinetuneConfig`'s fields (a settings
    group: docs/architecture.md, "Settings groups"). ``report_to``: trackers, one run per cell;
    ``device``: auto, cpu, cuda...

    A cell already in `results` is reused only when its fingerprint (model folder content, task
    data content, every setting that decides it: `mlsm.evaluate.finetune.cell_reuse`) equals the
    current
    one, so an interrupted grid resumes; another fingerprint is one line before any training,
    unless ``recompute=True``. Two grids on one results file append each cell once. Returns the
    results path.
    """
    cfg = config_of(config, settings)
    tracking.require(list(report_to), "--report-to")  # before any model is loaded
    refs, specs = _grid(models, tasks, readiness)
    data_dir = cfg.data_dir or None
    check_apart(results, "--results", {"--data-dir": data_dir,
                                       **{f"model {r.name}": r.path for r in refs}})
    path = Path(results)
    if any(s.kind == "retrieval" for s in specs):
        retrieval_cell.check_temperature(path, specs, cfg.temperature)
        retrieval_cell.check_validation(specs, cfg.val_fraction)
    task_data = protocol.with_validation(
        lambda spec: _task_data(spec, data_dir, cfg.max_train_examples, cfg.eval_test),
        cfg.val_fraction, lambda spec: stable_seed("validation", spec.name), _validation_split)
    grid = protocol.grid_path(path) if cfg.val_fraction else path
    _run_grid(refs, specs, cfg, grid, pick_device(device), report_to, task_data,
              None if not cfg.val_fraction else lambda cell: protocol.report_selected(
                  grid, path, {**cell, "lr": cfg.lrs, "seed": cfg.seed_list()}, cfg.preset,
                  cfg.recompute))
    return path


@dataclass
class _TaskPlan:
    """The cells of one task: the inputs of each model, and the cells to train."""

    spec: TaskSpec
    n_train: int
    inputs: dict[str, cell_reuse.CellInputs]  # model name -> what decides its cells
    todo: dict[str, list[tuple[float, int, str, Any]]]  # model -> (lr, seed, state, superseded)


def _plan(spec: TaskSpec, refs: list[ModelRef], cfg: FinetuneConfig, models: dict[str, str],
          stored: dict[tuple[Any, ...], list[dict[str, Any]]], task_data: Callable,
          path: Path) -> _TaskPlan:
    """Which cells of `spec` to train: new ones, and (recompute) those stored with another
    fingerprint; one line for a stale cell without recompute."""
    train, _ = task_data(spec)
    data = cell_reuse.data_fingerprint(spec, cfg.data_dir or None)
    settings = cfg.decisive(spec.kind, spec.kind != "retrieval" or bool(spec.train_split))
    plan = _TaskPlan(spec, len(train), {}, {})
    for ref in refs:
        max_len = _max_len(cfg, spec, ref)  # the length the cells use, never 0
        plan.inputs[ref.name] = inputs = cell_reuse.CellInputs(
            models[ref.name], data, {**settings, "max_len": max_len})
        for lr, seed in itertools.product(cfg.lrs, cfg.seed_list()):
            key = cell_key({"model": ref.name, "task": spec.name, "seed": seed,
                            "lr": lr, "epochs": cfg.epochs, "batch_size": cfg.batch_size,
                            "max_len": max_len, "n_train": len(train)}, cell_reuse.CELL_KEY)
            where = f"{path}: cell {ref.name} {spec.name} seed {seed} lr {lr:g}"
            state, old = cell_reuse.reuse(stored.get(key, []), inputs, cfg.recompute, where)
            if state != "reuse":
                plan.todo.setdefault(ref.name, []).append((float(lr), seed, state, old))
    return plan


def _max_len(cfg: FinetuneConfig, spec: TaskSpec, ref: ModelRef) -> int:
    """The sequence length of the model's cells of `spec` (`cell.cell_max_len`); a length taken
    from the model folder is said on stderr (and recorded in every row, as any length is)."""
    length, source = cell_max_len(cfg.max_len, spec.kind, ref.path)
    if not cfg.max_len and spec.kind == "retrieval":
        print(f"mlsm: note: {ref.name} {spec.name}: max_len {length} ({source}); --max-len N "
              "sets another", file=sys.stderr)
    return length


def _selection_cell(plan: _TaskPlan, ref: ModelRef, shared: dict[str, Any]) -> dict[str, Any]:
    """What the rows of one (model, task) share, to find them for the lr choice
    (`protocol.report_selected`); a bi-encoder has no head, so its rows carry none."""
    inputs = plan.inputs[ref.name]
    cell = {**shared, "max_len": inputs.settings["max_len"]}
    return {"model": ref.name, "task": plan.spec.name, "n_train": plan.n_train,
            "fingerprint": inputs.fingerprint(),
            **{k: cell[k] for k in protocol.GRID_FIELDS if k in cell
               and not (k == "head" and plan.spec.kind == "retrieval")}}


def _run_model(plan: _TaskPlan, ref: ModelRef, task: tuple[Any, Any], shared: dict[str, Any],
               dev: torch.device, report_to: Sequence[str], path: Path, bar: Progress) -> None:
    """Train the cells of one (model, task) that `plan` left to do, appending each one's rows
    to `path` when it ends. task: (train examples, {split: eval examples}), tokenised on the
    first cell (a finished model costs nothing on resume)."""
    spec, inputs, data = plan.spec, plan.inputs[ref.name], None
    max_len = inputs.settings["max_len"]
    for lr, seed, state, old in plan.todo.get(ref.name, []):
        bar.set_postfix(cell=f"{ref.name}:{spec.name}:seed={seed}:lr={lr:g}")
        data = data or prepare(ref, spec, *task, max_len)
        cell = {**shared, "lr": lr, "max_len": max_len}
        with _cell_tracker(report_to, path, ref, spec, seed, cell) as tracker:
            rows = run_cell(ref, spec, data, seed, cell, dev, tracker)
        extra = {**inputs.record(), **({"supersedes": old} if state == "recompute" else {})}
        rows = [{**r, **extra} for r in rows]
        key = cell_key(rows[0], cell_reuse.CELL_KEY) if rows else None
        append_results(path, rows, unless=cell_reuse.stored_exactly(key, inputs.fingerprint()))
        bar.update(1)


def _run_grid(refs: list[ModelRef], specs: list[TaskSpec], cfg: FinetuneConfig, path: Path,
              dev: torch.device, report_to: Sequence[str], task_data: Callable[[TaskSpec], Any],
              finish: Callable[[dict[str, Any]], None] | None = None) -> None:
    """Run every cell (task, model, lr, seed) whose rows with the current fingerprint are not in
    the results file `path`, appending its rows when it ends. Every task is planned (and a stale
    cell refused) before anything trains. task_data: spec -> (train examples, {split: eval
    examples}); finish: called with what the rows of each (model, task) share once all its
    cells are in `path`."""
    stored = cell_reuse.group_cells(read_results(path)) if path.exists() else {}
    models = cell_reuse.model_fingerprints({r.name: r.path for r in refs})
    plans = [_plan(spec, refs, cfg, models, stored, task_data, path) for spec in specs]
    shared = {k: v for k, v in dataclasses.asdict(cfg).items()
              if k not in ("seeds", "lrs", "preset", "recompute", "data_dir")}
    # zero-shot retrieval: corpus embeddings per checkpoint fingerprint
    shared["retrieval_cache"] = str(path.parent / "retrieval_cache")
    bar = Progress(len(refs) * len(specs) * len(cfg.lrs) * len(cfg.seed_list()), "finetune",
                   "cell")
    for plan in plans:
        task = task_data(plan.spec) if plan.todo else ([], {})
        for ref in refs:
            _run_model(plan, ref, task, shared, dev, report_to, path, bar)
            bar.update(len(cfg.lrs) * len(cfg.seed_list()) - len(plan.todo.get(ref.name, [])))
            if finish is not None:
                finish(_selection_cell(plan, ref, shared))
    bar.close()
