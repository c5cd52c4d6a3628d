"""Pre-training: one function, `pretrain`, readable top to bottom.

The loop knows objectives only through their contract (`mlsm.objectives.base`): a `TrainModule`
(student + objective, what DDP wraps) turns each micro-batch into a loss *sum* and a target
count; gradients of the sums are accumulated and divided by the global number of targets once per
step, so gradient accumulation and DDP give exactly the gradient of the mean loss over the whole
global batch.
"""

from __future__ import annotations

import json
import math
import signal
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mlsm import locking
from mlsm.artifacts.fingerprint import folder_fingerprint
from mlsm.artifacts.run_spec import readiness_steps, resume_command
from mlsm.artifacts.rundir import RunDir
from mlsm.config import config_to_dict
from mlsm.data.batches import BatchSource
from mlsm.data.corpus import TokenStore, check_token_ids, require_mask_token
from mlsm.errors import UserError
from mlsm.hf import first_line
from mlsm.inputs import check_apart
from mlsm.models.backbone import build_student
from mlsm.objectives import Context, TrainModule, build_objective
from mlsm.progress import Progress
from mlsm.provenance import git_revision
from mlsm.run_config import RunConfig, config_from_dict
from mlsm.train import checkpoint as ckpt
from mlsm.train import device as dev
from mlsm.train import tracking
from mlsm.train.distributed import (
    DistInfo,
    all_reduce_sum,
    barrier,
    end_distributed,
    init_distributed,
)
from mlsm.train.schedule import lr_factor
from mlsm.train.signals import StopOnSignal
from mlsm.train.throughput import FlopMeter, flop_meter
from mlsm.train.validation import due, validate, validation_steps


def pretrain(cfg: RunConfig, resume: str | None = None) -> Path:
    """Pre-train a student as `cfg` says; returns the run directory.

    resume: None (fresh run), "auto" (newest intact checkpoint of cfg.train.out, fresh if none)
    or a checkpoint folder. A resumed run continues exactly: same batches, RNG, optimizer, schedule.
    SIGTERM or SIGINT ends the run after the current step with a checkpoint, and it returns then
    too (`pretrain_run` also says which signal stopped it).
    """
    return pretrain_run(cfg, resume)[0]


def pretrain_run(cfg: RunConfig, resume: str | None = None) -> tuple[Path, int | None]:
    """`pretrain`: the run directory, and the signal that stopped the run after a checkpoint
    before its last step (None when it ran to the end), which `mlsm pretrain` turns into its exit
    status (`mlsm.train.signals.exit_status`)."""
    if not isinstance(cfg, RunConfig):
        raise UserError(f"pretrain() takes a RunConfig, got a {type(cfg).__name__}; build it with "
                        "mlsm.load_config(PATH, overrides) "
                        "(a dict: mlsm.run_config.config_from_dict)")
    check_apart(cfg.train.out, "train.out", _inputs(cfg))  # before anything is written
    dist_info = init_distributed(cfg.train.device)
    run_dir = Path(cfg.train.out)
    # One process per run directory; under DDP rank 0 holds the lock for the whole group.
    try:
        with locking.hold(run_dir, "run directory", enabled=dist_info.is_main):
            RunDir(run_dir).check_folder(resume)  # before minutes of loading
            if resume and cfg.train.report_to:  # every rank stops alike, as for check_folder
                tracking.read_state(run_dir)  # a torn tracking.json: one line, before any work
            return _pretrain(cfg, resume, dist_info, run_dir)
    finally:
        end_distributed(dist_info)


def _inputs(cfg: RunConfig) -> dict[str, str]:
    """The files and folders a run reads, by the key that names them (train.out must be apart)."""
    found = {"data.store": cfg.data.store, "model.init_from": cfg.model.init_from,
             "model.config": cfg.model.config}
    for key in ("teacher", "dictionary", "targets", "checkpoint"):
        value = getattr(cfg.objective, key, None)
        if isinstance(value, str) and value:
            found[f"objective.{key}"] = value
    return found


def _pretrain(cfg: RunConfig, resume: str | None, dist_info: DistInfo,
              run_dir: Path) -> tuple[Path, int | None]:
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
    precision = dev.resolve_precision(cfg.train.precision, device)  # recorded in run.json
    start, inputs = _start_run(run_dir, cfg, resume, module, optimizer, dist_info, scaler,
                               {"device": device.type, "precision": precision})
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
    held_out = validation_steps(cfg.train.steps, cfg.train.eval_batches)  # train.eval_every
    bar = Progress(cfg.train.steps, "pretrain", "step", initial=start, enabled=dist_info.is_main)
    t_last, s_last = time.perf_counter(), start
    stopper, stopped_by = StopOnSignal(), None
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
            val = {}  # every rank validates (its sums are all-reduced); rank 0 logs them
            if due(done, cfg.train.eval_every, cfg.train.steps):
                t_val = time.perf_counter()
                val = validate(module, source, held_out, (cfg.train.batch_size, micro), autocast,
                               device, dist_info)
                t_last += time.perf_counter() - t_val  # tokens/s and MFU count training only
                bar.set_postfix(val_loss=f"{val['val_loss']:.4g}")
            if dist_info.is_main and (done % cfg.train.log_every == 0 or done == cfg.train.steps
                                      or val):
                now = time.perf_counter()
                window, seconds = done - s_last, max(now - t_last, 1e-9)
                tps = tokens_per_step * window / seconds
                t_last, s_last = now, done
                bar.set_postfix(tok_s=f"{tps:,.0f}")
                flops = meter.metrics(window, seconds)  # flops_per_s, mfu
                record = _log(run_dir, done, loss, lr, grad_norm, tps, totals, tokens_per_step,
                              {**flops, **val})
                tracker.log({k: v for k, v in record.items() if k != "batch_digest"}, done)
            if done in save_steps:
                _checkpoint(run_dir, done, cfg, module, tokenizer, (optimizer, scaler), dist_info,
                            inputs)
            if stopper.requested(dist_info, device):
                if done not in save_steps:
                    _checkpoint(run_dir, done, cfg, module, tokenizer, (optimizer, scaler),
                                dist_info, inputs)
                stopped_by = stopper.signum or signal.SIGTERM  # or another rank's (torchrun's)
                print(f"stopped by signal {signal.Signals(stopped_by).name} after step {done}; "
                      "continue with --resume auto (the same command with it, or: "
                      f"{resume_command(run_dir)})", flush=True)
                break
    bar.close()
    barrier(dist_info)
    return run_dir, stopped_by


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


def _start_run(run_dir: Path, cfg: RunConfig, resume: str | None, module: TrainModule,
               optimizer: torch.optim.Optimizer, info: DistInfo,
               scaler: torch.amp.GradScaler | None = None,
               facts: dict[str, str] | None = None) -> tuple[int, dict[str, str]]:
    """Create or re-open the run directory; on resume restore state. Returns the next step and
    the fingerprints of the run's inputs (each checkpoint records them).

    Nothing in run_dir is written before the resume is validated (same run, same inputs, intact
    checkpoint). `facts` (device, resolved precision) go into run.json's segment."""
    run = RunDir(run_dir)
    run.check_folder(resume)
    picked = run.pick(resume, announce=info.is_main) if resume else None
    run.check_same_run(_plain(cfg), picked, resolved_config)
    inputs = input_fingerprints(cfg)
    if resume:
        run.check_inputs(inputs, picked, announce=info.is_main)
        run.check_metrics()
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
        segment = {"git_revision": git_revision(), "world_size": info.world,
                   "threads": torch.get_num_threads(), **(facts or {})}
        run.start(config_to_dict(cfg), step, segment, inputs)
    return step, inputs


def _plain(cfg: RunConfig) -> dict[str, Any]:
    """The resolved config as JSON data (tuples as lists), as a checkpoint saves it."""
    return json.loads(json.dumps(config_to_dict(cfg)))


def resolved_config(old: dict[str, Any]) -> dict[str, Any]:
    """A saved config with its objective defaults filled in, so that a config.yaml written before
    objectives were saved in full (a partial objective dict) equals its resolved form."""
    try:
        return json.loads(json.dumps(config_to_dict(config_from_dict(old))))
    except UserError:  # an old option this version rejects: compare what was written
        return old


def input_fingerprints(cfg: RunConfig) -> dict[str, str]:
    """Content fingerprints of what the run reads, by the key naming it: the token store's own
    (`meta.json` fingerprint and size), the dictionary's atoms (`dictionary_hash`) and the files
    of the target store, teacher, probed checkpoint and initial weights. Equal after a copy or a
    move; different after a rebuild with other content."""
    found = {}
    if cfg.data.store:  # a Trainer fed by a dataset of its own reads no store
        store = TokenStore.open(cfg.data.store)
        found["data.store"] = f"{store.meta.get('fingerprint')}/{store.n_tokens}"
    dictionary = getattr(cfg.objective, "dictionary", None)
    if isinstance(dictionary, str) and dictionary:
        from mlsm.teacher.dictionary import load_dictionary
        from mlsm.teacher.targets import dictionary_hash

        found["objective.dictionary"] = dictionary_hash(load_dictionary(dictionary))
    folders = {"objective.targets": getattr(cfg.objective, "targets", None),
               "objective.teacher": getattr(cfg.objective, "teacher", None),
               "objective.checkpoint": getattr(cfg.objective, "checkpoint", None),
               "model.init_from": cfg.model.init_from}
    for key, folder in folders.items():  # a hub id or an unset option has no files here
        if isinstance(folder, str) and folder and Path(folder).is_dir():
            found[key] = folder_fingerprint(folder)
    return found


def _step_seed(seed: int, step: int, rank: int) -> int:
    """Dropout seed of one step on one rank: a fresh, resumable stream with no saved RNG state."""
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1, np.uint64)[0] >> 1)


def _checkpoint(run_dir: Path, step: int, cfg: RunConfig, module: TrainModule, tokenizer: Any,
                optimizers: tuple[torch.optim.Optimizer, torch.amp.GradScaler],
                info: DistInfo, inputs: dict[str, str]) -> None:
    if info.is_main:
        optimizer, scaler = optimizers
        state = {"step": step, "optimizer": optimizer.state_dict()}
        if scaler.is_enabled():
            state["scaler"] = scaler.state_dict()
        meta = {"step": step, "readiness": step / cfg.train.steps, "objective": cfg.objective.name,
                "run": str(run_dir), "tokens": step * cfg.train.batch_size * cfg.data.max_len,
                "config": config_to_dict(cfg), "inputs": inputs}
        run = RunDir(run_dir)
        ckpt.save_checkpoint(run.checkpoint_folder(step), module, tokenizer, state, meta)
        keep = readiness_steps(cfg.train.readiness, cfg.train.steps) | {cfg.train.steps}
        run.prune(keep, cfg.train.keep_last)
    barrier(info)


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
    RunDir(run_dir).log(record)
    return record
