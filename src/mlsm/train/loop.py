"""Pre-training: one function, `pretrain`, readable top to bottom.

The loop knows objectives only through their contract (`mlsm.objectives.base`): a `TrainModule`
(student + objective, what DDP wraps) turns each micro-batch into a loss *sum* and a target
count; gradients of the sums are accumulated and divided by the global number of targets once per
step, so gradient accumulation and DDP give exactly the gradient of the mean loss over the whole
global batch.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mlsm import locking, tracking
from mlsm.artifacts.outputs import OutputKind, Rule, guard_output
from mlsm.config import config_to_dict, git_revision, save_config
from mlsm.data.batches import BatchSource
from mlsm.data.corpus import TokenStore, check_token_ids, require_mask_token
from mlsm.errors import UserError
from mlsm.fileio import atomic_write_text
from mlsm.hf import first_line
from mlsm.inputs import check_apart, field_problem
from mlsm.models.backbone import build_student
from mlsm.objectives import Context, TrainModule, build_objective
from mlsm.progress import Progress
from mlsm.run_config import RunConfig, config_from_dict
from mlsm.runs import readiness_steps
from mlsm.throughput import FlopMeter, flop_meter
from mlsm.train import checkpoint as ckpt
from mlsm.train import device as dev
from mlsm.train.distributed import DistInfo, all_reduce_sum, barrier, init_distributed
from mlsm.train.schedule import lr_factor
from mlsm.train.signals import StopOnSignal


def pretrain(cfg: RunConfig, resume: str | None = None) -> Path:
    """Pre-train a student as `cfg` says; returns the run directory.

    resume: None (fresh run), "auto" (newest intact checkpoint of cfg.train.out, fresh if none)
    or a checkpoint folder. A resumed run continues exactly: same batches, RNG, optimizer, schedule.
    """
    if not isinstance(cfg, RunConfig):
        raise UserError(f"pretrain() takes a RunConfig, got a {type(cfg).__name__}; build it with "
                        "mlsm.load_config(PATH, overrides) "
                        "(a dict: mlsm.run_config.config_from_dict)")
    check_apart(cfg.train.out, "train.out", _inputs(cfg))  # before anything is written
    dist_info = init_distributed(cfg.train.device)
    run_dir = Path(cfg.train.out)
    # One process per run directory; under DDP rank 0 holds the lock for the whole group.
    with locking.hold(run_dir, "run directory", enabled=dist_info.is_main):
        _check_run_dir(run_dir, resume)  # before minutes of loading
        if resume and cfg.train.report_to:  # every rank stops alike, as for _check_run_dir
            tracking.read_state(run_dir)  # a torn tracking.json: one line, before any work
        return _pretrain(cfg, resume, dist_info, run_dir)


def _inputs(cfg: RunConfig) -> dict[str, str]:
    """The files and folders a run reads, by the key that names them (train.out must be apart)."""
    found = {"data.store": cfg.data.store, "model.init_from": cfg.model.init_from,
             "model.config": cfg.model.config}
    for key in ("teacher", "dictionary", "targets", "checkpoint"):
        value = getattr(cfg.objective, key, None)
        if isinstance(value, str) and value:
            found[f"objective.{key}"] = value
    return found


def _pretrain(cfg: RunConfig, resume: str | None, dist_info: DistInfo, run_dir: Path) -> Path:
    device = dev.resolve_device(cfg.train.device, dist_info)
    tracking.require(cfg.train.report_to, "train.report_to")  # before minutes of loading
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    store = TokenStore.open(_require(cfg.data.store, "data.store"))
    tokenizer = store.load_tokenizer()
    require_mask_token(tokenizer, f"the tokenizer of {store.path}")
    ctx = Context(tokenizer, device, cfg.train.steps, str(store.path), cfg.data.max_len,
                  store=store)
    objective = build_objective(cfg.objective, ctx)
    student = build_student(cfg.model, tokenizer, cfg.data.max_len, cfg.train.seed)
    check_token_ids(store.tokens, student.hf.get_input_embeddings().num_embeddings, store.path,
                    "the student")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.train.seed + 1)  # heads an objective adds start the same in every run
        objective.attach(student)
    module = TrainModule(student, objective).to(device).train()  # from_pretrained gives eval mode
    optimizer = _optimizer(module, cfg, device)
    scaler = dev.grad_scaler(cfg.train.precision, device)
    source = BatchSource(store, cfg.data, tokenizer)
    micro = cfg.train.micro_batch_size or cfg.train.batch_size // dist_info.world
    start = _start_run(run_dir, cfg, resume, module, optimizer, dist_info, scaler)
    if cfg.train.compile:
        dev.compile_student(module)
    model = _wrap_ddp(module, dist_info, device)
    save_steps = _save_steps(cfg)
    autocast = dev.autocast_for(cfg.train.precision, device)
    tokens_per_step = cfg.train.batch_size * cfg.data.max_len
    meter = FlopMeter(None)
    if dist_info.is_main:
        meter = flop_meter(cfg, student.config, device, dist_info.world)
    tracker = _open_tracker(cfg, run_dir, dist_info, start if resume else None)
    bar = Progress(cfg.train.steps, "pretrain", "step", initial=start, enabled=dist_info.is_main)
    t_last, s_last = time.perf_counter(), start
    stopper = StopOnSignal()
    with stopper, tracker:
        for step in range(start, cfg.train.steps):
            torch.manual_seed(_step_seed(cfg.train.seed, step, dist_info.rank))  # dropout
            lr = cfg.optim.lr * lr_factor(step, cfg.train.steps, cfg.optim)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batches = source.micro_batches(step, cfg.train.batch_size, micro, dist_info.rank,
                                           dist_info.world)
            loss, grad_norm, totals = _train_step(model, batches, autocast, device, dist_info,
                                                  cfg.optim.clip, (scaler, optimizer))
            if not math.isfinite(loss):
                raise UserError(f"non-finite loss at step {step}; lower optim.lr or check the data "
                                "— the last good checkpoint in "
                                f"{run_dir / 'checkpoints'} is intact")
            scaler.step(optimizer)  # = optimizer.step() unless fp16 found inf/NaN gradients
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            bar.update(1, loss=loss)  # every progress line shows the latest loss
            done = step + 1
            if dist_info.is_main and (done % cfg.train.log_every == 0 or done == cfg.train.steps):
                now = time.perf_counter()
                window, seconds = done - s_last, max(now - t_last, 1e-9)
                tps = tokens_per_step * window / seconds
                t_last, s_last = now, done
                bar.set_postfix(tok_s=f"{tps:,.0f}")
                flops = meter.metrics(window, seconds)  # flops_per_s, mfu
                record = _log(run_dir, done, loss, lr, grad_norm, tps, totals, tokens_per_step,
                              flops)
                tracker.log({k: v for k, v in record.items() if k != "batch_digest"}, done)
            if done in save_steps:
                _checkpoint(run_dir, done, cfg, module, tokenizer, (optimizer, scaler), save_steps,
                            dist_info)
            if stopper.requested(dist_info, device):
                if done not in save_steps:
                    _checkpoint(run_dir, done, cfg, module, tokenizer, (optimizer, scaler),
                                save_steps, dist_info)
                print(f"stopped by signal after step {done}; continue with --resume auto",
                      flush=True)
                break
    bar.close()
    barrier(dist_info)
    return run_dir


def _train_step(model: torch.nn.Module, batches: list, autocast: Any,
                device: torch.device, info: DistInfo, clip: float,
                scaling: tuple[torch.amp.GradScaler, torch.optim.Optimizer] | None = None,
                ) -> tuple[float, torch.Tensor, dict[str, torch.Tensor]]:
    """Forward/backward every micro-batch, then turn the summed gradients into the gradient of
    the global mean loss. Returns (loss, grad norm, globally summed totals).

    One host sync per step: the loss, read to stop before a non-finite step reaches the weights.
    The grad norm stays on the device (read when logged). scaling: (GradScaler, optimizer) for
    fp16, whose scaled gradients are unscaled before they are averaged and clipped."""
    scaler, optimizer = scaling or (None, None)
    module = model.module if info.world > 1 else model
    # float64 holds the digest (a sum of < 2^32 CRCs) exactly up to ~2^21 sequences per step
    totals: dict[str, torch.Tensor] = {"batch_digest": torch.zeros((), dtype=torch.float64)}
    for i, batch in enumerate(batches):
        sync = model.no_sync() if info.world > 1 and i < len(batches) - 1 else nullcontext()
        with sync:
            with autocast:
                out = model(dev.to_device(batch, device))  # batch -> targets -> student -> loss
            (scaler.scale(out.loss_sum) if scaler else out.loss_sum).backward()
        _accumulate(totals, out)
        totals["batch_digest"] += batch.digest()
    totals = {k: all_reduce_sum(v.to(device), info) for k, v in totals.items()}
    n_targets = totals["n_targets"].clamp(min=1)
    if scaler is not None and scaler.is_enabled():
        scaler.unscale_(optimizer)
    grad_norm = _finish_gradients(module, n_targets, info, clip)
    return (totals["loss_sum"] / n_targets).item(), grad_norm, totals


# ----------------------------------------------------------------------------- helpers


def _require(value: str, key: str) -> str:
    if not value:
        raise UserError(f"{key} is not set; pass {key}=PATH (make one with `mlsm prepare`)")
    return value


def _optimizer(module: torch.nn.Module, cfg: RunConfig,
               device: torch.device | None = None) -> torch.optim.Optimizer:
    """AdamW; no weight decay on biases and normalisation weights (1-D tensors), as in BERT,
    unless `optim.decay_all` (the official MLSM code decays every parameter)."""
    params = [p for p in module.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2 or cfg.optim.decay_all]
    no_decay = [p for p in params if p.ndim < 2 and not cfg.optim.decay_all]
    groups = [{"params": decay, "weight_decay": cfg.optim.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                             eps=cfg.optim.eps, **dev.adamw_options(device or torch.device("cpu")))


def _wrap_ddp(module: TrainModule, info: DistInfo, device: torch.device) -> torch.nn.Module:
    if info.world == 1:
        return module
    ids = [device.index] if device.type == "cuda" else None
    # TrainModule.forward runs the whole data flow, so DDP sees a normal forward/backward pair.
    return torch.nn.parallel.DistributedDataParallel(module, device_ids=ids,
                                                     find_unused_parameters=True)


def _accumulate(totals: dict[str, torch.Tensor], out: Any) -> None:
    parts = {"loss_sum": out.loss_sum.detach().float(), "n_targets": out.n_targets.float(),
             **{k: v.detach().float() for k, v in out.metrics.items()}}
    for key, value in parts.items():
        totals[key] = totals[key] + value if key in totals else value


def _finish_gradients(module: torch.nn.Module, n_targets: torch.Tensor, info: DistInfo,
                      clip: float) -> torch.Tensor:
    """Turn accumulated gradients of loss sums into the gradient of the global mean; clip."""
    scale = info.world / n_targets  # DDP already averaged over ranks: undo that, divide by N
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    torch._foreach_mul_(grads, scale.to(grads[0].device))
    if clip > 0:
        return torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


def _save_steps(cfg: RunConfig) -> set[int]:
    total = cfg.train.steps
    steps = readiness_steps(cfg.train.readiness, total)
    if cfg.train.save_every:
        steps |= set(range(cfg.train.save_every, total + 1, cfg.train.save_every))
    return steps | {total}


RUN_MARKER = "run.json"
# What makes two configs the same run: everything that changes the weights. Device, threads,
# precision, micro-batching, logging and checkpoint cadence may change on resume.
_SAME_RUN = {"data": None, "model": None, "objective": None, "optim": None,
             "train": ("steps", "batch_size", "seed")}


def _start_run(run_dir: Path, cfg: RunConfig, resume: str | None, module: TrainModule,
               optimizer: torch.optim.Optimizer, info: DistInfo,
               scaler: torch.amp.GradScaler | None = None) -> int:
    """Create or re-open the run directory; on resume restore state and return the next step.

    Nothing in run_dir is written before the resume is validated (same run, intact checkpoint)."""
    _check_run_dir(run_dir, resume)
    picked = _pick_checkpoint(run_dir, resume, info) if resume else None
    _check_same_run(run_dir, cfg, picked)
    if resume:
        _check_metrics(run_dir / "metrics.jsonl")
    step = 0
    if picked is not None:
        folder, _, state = picked
        ckpt.load_weights(folder, module)
        try:
            optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError, RuntimeError) as exc:
            raise UserError(f"the optimizer state of {folder} does not fit this model "
                            f"({first_line(exc)}); resume with the config the run was started "
                            "with") from None
        if scaler is not None and scaler.is_enabled() and "scaler" in state:
            scaler.load_state_dict(state["scaler"])  # fp16: the loss scale it had reached
        step = int(state["step"])
    barrier(info)  # every rank has checked run_dir before rank 0 writes into it
    if info.is_main:
        _write_run_files(run_dir, cfg, info, step)
    return step


def _check_run_dir(run_dir: Path, resume: str | None) -> None:
    """Any content of train.out counts: only an mlsm run is continued, and only with --resume."""
    guard_output(run_dir, OutputKind("mlsm run", ours=_is_run_dir),
                 Rule.SAME_KIND if resume else Rule.NEW, flag="train.out",
                 fix_existing="pass --resume auto to continue it or choose another train.out")


def _is_run_dir(run_dir: Path) -> bool:
    try:
        marker = json.loads((run_dir / RUN_MARKER).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(marker, dict) and "started" in marker


def _pick_checkpoint(run_dir: Path, resume: str, info: DistInfo) -> tuple[Path, dict, dict] | None:
    """(folder, checkpoint.json, training state) to resume from: the named folder, or for "auto"
    the newest intact checkpoint (damaged newer ones are skipped with one line on stderr)."""
    if resume != "auto":
        folder = Path(resume)
        if not (folder / ckpt.COMPLETE).is_file():
            raise UserError(f"{folder} is not a complete checkpoint; pass --resume auto or a "
                            "checkpoints/step-* folder")
        try:
            return (folder, *ckpt.read_checkpoint(folder))
        except ckpt.DamagedCheckpoint as exc:
            raise UserError(f"checkpoint {folder} is damaged ({exc}); pass --resume auto to use "
                            "the newest intact one") from None
    found = ckpt.list_checkpoints(run_dir)
    damaged = []
    for _, folder in reversed(found):
        try:
            picked = (folder, *ckpt.read_checkpoint(folder))
        except ckpt.DamagedCheckpoint as exc:
            damaged.append(f"{folder.name}: {exc}")
            continue
        if damaged and info.is_main:
            print(f"mlsm: resuming from {folder.name}, the newest intact checkpoint; "
                  f"skipped damaged {'; '.join(damaged)}", file=sys.stderr, flush=True)
        return picked
    if damaged:
        raise UserError(f"no intact checkpoint in {run_dir / 'checkpoints'} "
                        f"({'; '.join(damaged)}); choose another train.out or delete the "
                        "damaged folders")
    return None


def _same_run_diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Dotted keys of `_SAME_RUN` on which configs a and b differ."""
    diff = []
    for group, keys in _SAME_RUN.items():
        ga, gb = (g if isinstance(g, dict) else {} for g in (a.get(group), b.get(group)))
        for key in keys or sorted(set(ga) | set(gb)):
            if json.dumps(ga.get(key), sort_keys=True) != json.dumps(gb.get(key), sort_keys=True):
                diff.append(f"{group}.{key}")
    return diff


def _check_same_run(run_dir: Path, cfg: RunConfig, picked: tuple[Path, dict, dict] | None) -> None:
    """Refuse to continue a run (or a checkpoint) with a config that changes the weights."""
    import yaml

    now = json.loads(json.dumps(config_to_dict(cfg)))  # resolved: every objective option
    refs = []
    if (run_dir / "config.yaml").is_file():
        # a damaged config.yaml is rewritten below; the checkpoint's copy still decides
        with contextlib.suppress(OSError, UnicodeDecodeError, yaml.YAMLError):
            refs.append((run_dir / "config.yaml",
                         yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))))
    if picked is not None:
        refs.append((picked[0] / ckpt.COMPLETE, picked[1]["config"]))
    for where, old in refs:
        diff = _same_run_diff(now, _resolved(old)) if isinstance(old, dict) else []
        if diff:
            raise UserError(f"this config differs from the run in {run_dir} ({where.name}) in "
                            f"{', '.join(diff[:4])}; use the run's own config to resume it, or "
                            "choose another train.out for a new run")


def _resolved(old: dict[str, Any]) -> dict[str, Any]:
    """A saved config with its objective defaults filled in, so that a config.yaml written before
    objectives were saved in full (a partial objective dict) equals its resolved form."""
    try:
        return json.loads(json.dumps(config_to_dict(config_from_dict(old))))
    except UserError:  # an old option this version rejects: compare what was written
        return old


def _write_run_files(run_dir: Path, cfg: RunConfig, info: DistInfo, step: int) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        segment = {"git_revision": git_revision(),
                   "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   "world_size": info.world, "threads": torch.get_num_threads()}
        if not _is_run_dir(run_dir):  # the marker first: a folder with any of our files is a run
            marker = {"format": "mlsm-run", **segment}
        else:  # a resume, maybe by other code or on another machine: its provenance too
            marker = json.loads((run_dir / RUN_MARKER).read_text(encoding="utf-8"))
            earlier = marker.get("resumed")
            marker["resumed"] = [*(earlier if isinstance(earlier, list) else []),
                                 {"from_step": step, **segment}]
        atomic_write_text(run_dir / RUN_MARKER, json.dumps(marker, indent=2))
        ckpt.remove_stale(run_dir)
        save_config(cfg, run_dir / "config.yaml")
        _truncate_metrics(run_dir / "metrics.jsonl", step)
    except OSError as exc:
        raise UserError(f"cannot write to run directory {run_dir} ({exc.strerror or exc}); "
                        "check space and permissions, then rerun") from None


def _truncate_metrics(path: Path, step: int) -> None:
    """Keep one line per step up to the step we resume from (later lines will be logged again;
    a step logged twice by an earlier crash keeps its last line)."""
    if path.exists():
        kept = {}
        for ln in path.read_text(encoding="utf-8", errors="replace").splitlines():
            s = _logged_step(ln)
            if s <= step:
                kept[s] = ln
        atomic_write_text(path, "".join(kept[s] + "\n" for s in sorted(kept)))


def _check_metrics(path: Path) -> None:
    """Refuse, before anything is written, a metrics.jsonl line a resume would silently drop
    that is not a line torn by a crash (the start of a JSON object, broken off): a row without an
    integer step, or other text. The resume rewrites the file with the rows up to its step."""
    text = path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""
    for number, line in enumerate(text.splitlines(), 1):
        try:
            wrong = field_problem(json.loads(line), {"step": "int"})
        except json.JSONDecodeError as exc:
            torn = line.lstrip().startswith("{") and exc.msg != "Extra data"
            wrong = None if torn or not line.strip() else f"not JSON: {exc.msg}"
        if wrong:
            raise UserError(f"{path}:{number} is not a row mlsm logged ({wrong}); fix or remove "
                            "that line, then resume (the resume would drop it)")


def _logged_step(line: str) -> float:
    """Step of a metrics line; a line torn by a crash counts as after every checkpoint."""
    try:
        step = json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return math.inf
    return step if isinstance(step, int) else math.inf


def _step_seed(seed: int, step: int, rank: int) -> int:
    """Dropout seed of one step on one rank: a fresh, resumable stream with no saved RNG state."""
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1, np.uint64)[0] >> 1)


def _checkpoint(run_dir: Path, step: int, cfg: RunConfig, module: TrainModule, tokenizer: Any,
                optimizers: tuple[torch.optim.Optimizer, torch.amp.GradScaler],
                save_steps: set[int], info: DistInfo) -> None:
    if info.is_main:
        optimizer, scaler = optimizers
        state = {"step": step, "optimizer": optimizer.state_dict()}
        if scaler.is_enabled():
            state["scaler"] = scaler.state_dict()
        readiness = step / cfg.train.steps
        meta = {"step": step, "readiness": readiness, "objective": cfg.objective.name,
                "run": str(run_dir),
                "tokens": step * cfg.train.batch_size * cfg.data.max_len,
                "config": config_to_dict(cfg)}
        folder = run_dir / "checkpoints" / f"step-{step:07d}"
        ckpt.save_checkpoint(folder, module, tokenizer, state, meta)
        _prune(run_dir, cfg)
    barrier(info)


def _prune(run_dir: Path, cfg: RunConfig) -> None:
    """Keep readiness checkpoints and the last `keep_last` periodic ones."""
    keep = readiness_steps(cfg.train.readiness, cfg.train.steps) | {cfg.train.steps}
    periodic = [(s, f) for s, f in ckpt.list_checkpoints(run_dir) if s not in keep]
    for _, folder in periodic[: max(0, len(periodic) - cfg.train.keep_last)]:
        ckpt.remove_checkpoint(folder)


def _open_tracker(cfg: RunConfig, run_dir: Path, info: DistInfo,
                  resumed_from: int | None) -> tracking.Tracker:
    """The run's experiment trackers (`train.report_to`), on rank 0 only; files in run_dir.
    A resumed run (resumed_from = its checkpoint's step) continues the same tracker runs."""
    if not info.is_main:
        return tracking.Tracker()
    config = json.loads(json.dumps(config_to_dict(cfg)))
    return tracking.open_tracker(cfg.train.report_to, run_dir, config, run_dir.name,
                                 resume_step=resumed_from)


def _log(run_dir: Path, step: int, loss: float, lr: float, grad_norm: Any, tps: float,
         totals: dict[str, torch.Tensor], tokens_per_step: int,
         extra: dict[str, float] | None = None) -> dict[str, Any]:
    """Append one metrics.jsonl line; returns the record (for the trackers)."""
    n = totals["n_targets"].clamp(min=1)
    record = {"step": step, "loss": loss, "lr": lr, "grad_norm": float(grad_norm),
              "tokens_per_s": tps,
              "tokens": step * tokens_per_step, "n_targets": int(totals["n_targets"]),
              "batch_digest": int(totals["batch_digest"])}
    record.update({k: (v / n).item() for k, v in totals.items()
                   if k not in ("loss_sum", "n_targets", "batch_digest")})
    record.update(extra or {})
    try:
        with open(run_dir / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps(record) + "\n")
    except OSError as exc:
        raise UserError(f"cannot append to {run_dir / 'metrics.jsonl'} ({exc.strerror or exc}); "
                        "free space and rerun with --resume auto") from None
    return record
