"""MLSM (and KD, MTL, MLM) inside a Hugging Face `Trainer` script: `MLSMTrainer`.

An MLM script built on `transformers.Trainer` (the `run_mlm` example and its descendants) switches
to MLSM by replacing `Trainer` with `MLSMTrainer` and naming the objective; the data collator it
builds masks as `mlsm pretrain` does and attaches the objective's targets:

    trainer = MLSMTrainer(model=model, args=args, train_dataset=dataset,
                          processing_class=tokenizer,
                          objective={"name": "mlsm", "dictionary": "dict.safetensors"})

One step equals one step of `mlsm pretrain` on the same batch (tests/test_hf_trainer.py):

- Masking (`MLSMCollator`) is mlsm's `Masker`: counter-based, a pure function of (data.seed, the
  row's sample index, position), so the same rows give the same batch in any order, on any rank.
  A row's sample index is its `sample` field (`MLSMDataset` sets it: the global sample index of
  `mlsm pretrain`), else a hash of its token ids.
- Targets (teacher codes of MLSM, teacher logits of KD, labels) are computed by the collator,
  online (early-exit teacher + exact sparse coder) or read from a target store, so the number of
  targets of every micro-batch is known before any backward pass: each micro-batch's loss *sum*
  is divided by the target count of the whole accumulated (and all-reduced) batch, the gradient
  of mlsm's loop (loss_sum / n_targets over the global batch), not a mean of per-batch means.
- Saving writes mlsm's checkpoint folder (the HF folder the objective declares, heads.safetensors,
  heads.json, checkpoint.json), so `mlsm probe / blimp / finetune / export` read Trainer
  checkpoints; `resume_from_checkpoint` reads them back. They record the block length trained on
  (an `MLSMDataset`'s data.max_len, else the rows' own length).
- The Trainer's own hooks see mlsm's numbers: `model.config` is the student's (model cards,
  `push_to_hub`), `total_flos` is mlsm's analytic count (`mlsm flops`, the "mlsm" accounting),
  and the objective's metrics (MLSM: kl, target_entropy, nnz, top1_agreement, dropped) are
  logged beside the loss, per target over the logging window, to `report_to` and `on_log`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase, Trainer, TrainingArguments

from mlsm.artifacts.checkpoint import COMPLETE, SAVING, Checkpoint, write_marker
from mlsm.artifacts.rundir import RunDir
from mlsm.config import (
    DataConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
    config_to_dict,
)
from mlsm.data.batches import Batch, BatchSource, Masker
from mlsm.data.corpus import TokenStore, require_mask_token
from mlsm.errors import UserError
from mlsm.fileio import atomic_write_text, fsync_path
from mlsm.models.backbone import Student
from mlsm.objectives import (
    Context,
    Objective,
    TrainModule,
    build_objective,
    forward_step,
    resolve_objective,
)
from mlsm.run_config import RunConfig
from mlsm.train import checkpoint as ckpt

_BATCH_FIELDS = ("input_ids", "attention_mask", "special_mask", "selected", "corrupted_ids",
                 "samples", "chunks")
_COLUMNS = ["input_ids", "attention_mask", "sample", "chunk"]  # dataset columns the collator reads


class MLSMDataset(torch.utils.data.Dataset):
    """The sequences `mlsm pretrain` reads from a token store, in its order: item g is global
    sample g (a packed chunk, `[CLS] ... [SEP]`, of `data.max_len` tokens; the order is mlsm's
    seeded permutation, so the Trainer reads it sequentially). `epochs` permutations long.
    """

    def __init__(self, store: str | Path | TokenStore, data: DataConfig | None = None,
                 epochs: int = 1):
        self.store = store if isinstance(store, TokenStore) else TokenStore.open(store)
        self.data = data or DataConfig()
        self.data.store = str(self.store.path)
        self.tokenizer = self.store.load_tokenizer()
        self.source = BatchSource(self.store, self.data, self.tokenizer)
        if epochs < 1:
            raise UserError(f"MLSMDataset(epochs={epochs}) must be at least 1")
        self.epochs = epochs

    def __len__(self) -> int:
        return self.source.n_sequences * self.epochs

    def __getitem__(self, g: int) -> dict[str, Any]:
        if not 0 <= g < len(self):
            raise IndexError(g)
        chunk = self.source.chunk_ids(np.array([g], dtype=np.int64))
        ids = self.source.chunk_tokens(chunk)[0]  # (T,)
        return {"input_ids": torch.from_numpy(ids), "sample": g, "chunk": int(chunk[0])}


def _row_key(ids: np.ndarray) -> int:
    """A row's sample index when the dataset gives none: 63 bits of a hash of its token ids (the
    same row is masked the same way in every epoch, like BERT's static masking)."""
    digest = hashlib.blake2b(ids.astype(np.int64).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _to(value: Any, device: torch.device | str) -> Any:
    """Tensors of a targets structure (a tensor, a tuple of them, None) moved to `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    return value


class MLSMCollator:
    """Features (dicts with `input_ids`, optional `attention_mask`, `sample`, `chunk`) -> the fields
    of an mlsm `Batch`, the objective's `targets` and their count `n_targets` (CPU tensors).

    Rows of unequal length are padded with the tokenizer's pad id; padding is never selected.
    Targets are computed on the objective's device (the teacher's): keep `dataloader_num_workers`
    at 0 when that is a GPU.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, objective: Objective,
                 data: DataConfig | None = None, device: torch.device | str = "cpu"):
        require_mask_token(tokenizer, "the tokenizer given to MLSMCollator")
        self.tokenizer, self.objective = tokenizer, objective
        self.masker = Masker(data or DataConfig(), tokenizer)
        self.device = torch.device(device)

    def batch(self, features: list[dict[str, Any]]) -> Batch:
        """The mlsm Batch of these rows (step 0: the collator cannot know the optimizer step)."""
        rows = [np.asarray(f["input_ids"], dtype=np.int64) for f in features]
        width = max(len(r) for r in rows)
        ids = np.full((len(rows), width), self.masker.pad_id, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        for i, (row, f) in enumerate(zip(rows, features, strict=True)):
            ids[i, : len(row)] = row
            given = f.get("attention_mask")
            mask[i, : len(row)] = 1 if given is None else np.asarray(given, dtype=np.int64)
        samples = np.array([int(f["sample"]) if "sample" in f else _row_key(r)
                            for f, r in zip(features, rows, strict=True)], dtype=np.int64)
        chunks = np.array([int(f.get("chunk", -1)) for f in features], dtype=np.int64)
        return self.masker.batch(ids, samples, 0, chunks, mask)

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.batch(features)
        on_device = batch.to(self.device)
        with torch.no_grad():
            targets = self.objective.targets(on_device)
            count = self.objective.target_count(on_device, targets)
        fields = {name: getattr(batch, name) for name in _BATCH_FIELDS}
        return {**fields, "targets": _to(targets, "cpu"), "n_targets": count.cpu()}


class MLSMModule(TrainModule):
    """Student + objective, called with the collator's fields: what the Trainer trains and wraps
    (DDP, accelerate). Returns the objective's `ObjectiveOutput` (loss sum, target count)."""

    main_input_name = "input_ids"  # what the Trainer counts tokens and FLOPs by

    @property
    def config(self) -> Any:
        """The student's HF config: the Trainer's model card and Hub code read `model.config`."""
        return self.student.config

    def forward(self, targets: Any = None, n_targets: Any = None, step: int = 0,
                **fields: torch.Tensor) -> Any:  # type: ignore[override]
        batch = Batch(**{name: fields[name] for name in _BATCH_FIELDS}, step=step)
        return forward_step(self.student, self.objective, batch, targets)


def _block_length(dataset: Any) -> int | None:
    """The length of a dataset's first row (run_mlm's blocks all have it), or None when the
    dataset cannot be indexed or has no `input_ids`."""
    try:
        return len(dataset[0]["input_ids"])
    except (TypeError, KeyError, IndexError, NotImplementedError):
        return None


TRAINER = "transformers.Trainer"
"""checkpoint.json's `trainer` in the folders MLSMTrainer saves."""


class MLSMTrainer(Trainer):
    """`transformers.Trainer` training `model` (an HF masked LM, e.g. `AutoModelForMaskedLM`) with
    an mlsm objective.

    objective: the objective's options as in `mlsm pretrain` (a dict such as {"name": "mlsm",
    "dictionary": PATH} or {"name": "kd", "teacher": PATH}, or its typed Config;
    docs/objectives.md).
    data: masking options (`mlsm.config.DataConfig`: seed, mask_rate, mask_split, exact_count);
    taken from `train_dataset` when it is an `MLSMDataset`. processing_class: the tokenizer
    (required: masking needs its special tokens). The heads the objective adds are initialised
    under seed args.seed + 1, as `mlsm pretrain` does with train.seed.
    """

    def __init__(self, model: PreTrainedModel, args: TrainingArguments, *, objective: Any,
                 processing_class: PreTrainedTokenizerBase, data: DataConfig | None = None,
                 data_collator: Any = None, train_dataset: Any = None, **kwargs: Any):
        if isinstance(train_dataset, MLSMDataset):
            if data is not None and data != train_dataset.data:
                raise UserError("MLSMTrainer: pass the masking options once, as the "
                                "MLSMDataset's data (not data=) ")
            data = train_dataset.data
        self.data = data or DataConfig()
        block = None if isinstance(train_dataset, MLSMDataset) else _block_length(train_dataset)
        if block:  # checkpoints, token counts and position-bound heads use the real length
            self.data = dataclasses.replace(self.data, max_len=block)
        self.objective_config = objective if not isinstance(objective, dict) else \
            resolve_objective(objective)
        store = train_dataset.store if isinstance(train_dataset, MLSMDataset) else None
        ctx = Context(processing_class, args.device, max(args.max_steps, 1),
                      str(store.path) if store else "", self.data.max_len, store=store)
        built = build_objective(self.objective_config, ctx)
        if hasattr(built, "phase"):  # its targets depend on the optimizer step
            raise UserError(f"objective {self.objective_config.name!r} switches by optimizer "
                            "step, which a data collator cannot know; train it with mlsm pretrain")
        student = Student(model)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(args.seed + 1)  # as mlsm pretrain: train.seed + 1
            built.attach(student)
        module = MLSMModule(student, built).to(args.device)
        collator = data_collator or MLSMCollator(processing_class, built, self.data, args.device)
        super().__init__(model=module, args=args, data_collator=collator,
                         train_dataset=train_dataset, processing_class=processing_class,
                         **kwargs)
        self._inputs = self._input_fingerprints()  # recorded by every save (the resume check)
        self.loss_is_scaled_for_ga = True  # each loss sum is divided by the global count
        self._metric_sums: dict[str, torch.Tensor] = {}  # objective metrics since the last log
        self._flops_per_row: dict[int, float | None] = {}
        if self._signature_columns is None:  # keep the columns the collator reads
            self._signature_columns = list(_COLUMNS)

    # ---------------------------------------------------------------- the step

    def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
        if isinstance(self.train_dataset, MLSMDataset):  # mlsm's order is its permutation
            return torch.utils.data.SequentialSampler(self.train_dataset)
        return super()._get_train_sampler(*args, **kwargs)

    def get_batch_samples(self, *args: Any, **kwargs: Any) -> tuple[list, Any]:
        """The accumulated micro-batches and their total target count (all ranks)."""
        batches, _ = super().get_batch_samples(*args, **kwargs)
        if not batches:
            return batches, None
        total = sum(b["n_targets"] for b in batches).to(self.args.device)
        if self.args.world_size > 1:
            total = self.accelerator.gather(total.reshape(1)).sum()
        return batches, total

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        """loss_sum / (targets of the accumulated batch on all ranks); alone (evaluation): the
        micro-batch's own count."""
        out = model(**inputs, step=self.state.global_step)
        expected = int(inputs["n_targets"])
        if int(out.n_targets) != expected:
            raise UserError(f"objective {self.objective_config.name!r} counted "
                            f"{int(out.n_targets)} targets but target_count said {expected}; "
                            "its target_count must match its loss (train it with mlsm pretrain)")
        if model.training:  # logged with the loss (`log`); evaluation batches stay out
            self._add_metrics(out)
        if num_items_in_batch is None:
            loss = out.loss_sum / out.n_targets.clamp(min=1)
        else:  # DDP averages gradients over ranks: undo it, as mlsm's loop does
            loss = out.loss_sum * self.args.world_size / num_items_in_batch.clamp(min=1)
        return (loss, out) if return_outputs else loss

    def prediction_step(self, model: nn.Module, inputs: dict[str, Any],
                        prediction_loss_only: bool, ignore_keys: Any = None) -> tuple:
        """Evaluation loss only (mean over the batch's targets): MLSM has no logits to gather."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    # ---------------------------------------------------------------- what the Trainer reports

    def _add_metrics(self, out: Any) -> None:
        sums = {"n_targets": out.n_targets.detach().float(),
                **{k: v.detach().float() for k, v in out.metrics.items()}}
        for key, value in sums.items():
            self._metric_sums[key] = self._metric_sums.get(key, 0) + value

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's log, plus the objective's metrics at each training log: each summed over
        the window's targets (all ranks) and divided by their count, as `mlsm pretrain` logs them
        (equal to its metrics.jsonl at logging_steps=1)."""
        if "loss" in logs and self._metric_sums:
            names = sorted(self._metric_sums)
            sums = torch.stack([self._metric_sums[k].reshape(()) for k in names]).to(
                self.args.device)
            if self.args.world_size > 1:  # every rank logs at the same step (the loss's gather)
                sums = self.accelerator.reduce(sums, reduction="sum")
            totals = dict(zip(names, sums.tolist(), strict=True))
            n = max(totals.pop("n_targets"), 1.0)
            logs.update({k: v / n for k, v in totals.items()})
            self._metric_sums = {}
        super().log(logs, *args, **kwargs)

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """mlsm's analytic FLOPs of this micro-batch (`mlsm flops`, the "mlsm" accounting: the
        student's forward + backward and the teacher's forward, per sequence of this width),
        so `total_flos` is the count `mlsm pretrain` logs as flops_per_step × steps. Objectives
        `mlsm flops` does not model fall back to the Trainer's 6·N·params estimate."""
        ids = inputs.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.ndim != 2:
            return super().floating_point_ops(inputs)
        rows, width = ids.shape
        if width not in self._flops_per_row:
            self._flops_per_row[width] = self._row_flops(width)
        per_row = self._flops_per_row[width]
        return int(per_row * rows) if per_row is not None else \
            super().floating_point_ops(inputs)

    def _row_flops(self, width: int) -> float | None:
        from mlsm.train.throughput import flops_per_step

        cfg = self.run_config()
        cfg.data = dataclasses.replace(cfg.data, max_len=width)
        module = self.accelerator.unwrap_model(self.model)
        try:
            per_step = flops_per_step(cfg, module.student.config)
        except (UserError, OSError, ValueError, KeyError) as exc:
            print(f"mlsm: total_flos is the Trainer's estimate: cannot count this run's FLOPs "
                  f"({exc})", file=sys.stderr, flush=True)
            return None
        return None if per_step is None else per_step / cfg.train.batch_size

    # ---------------------------------------------------------------- checkpoints

    def _save(self, output_dir: str | None = None, state_dict: Any = None) -> None:
        """mlsm's checkpoint folder (HF folder + heads + checkpoint.json, written last), plus the
        Trainer's training_args.bin; the Trainer adds its optimizer state beside it."""
        if not self.args.should_save:
            return
        folder = Path(output_dir or self.args.output_dir)
        folder.mkdir(parents=True, exist_ok=True)
        info = self.checkpoint_info()
        # a save over an earlier one writes file by file: marked until its checkpoint.json is
        # in, so a kill between leaves a folder readers refuse, not a mix they trust
        atomic_write_text(folder / SAVING, "a save is writing this folder\n")
        for stale in (COMPLETE, "heads.safetensors", "heads.json"):  # an earlier save's
            (folder / stale).unlink(missing_ok=True)
        module = self.accelerator.unwrap_model(self.model)
        ckpt.save_model_folder(module, self.processing_class, folder)
        torch.save(self.args, folder / "training_args.bin")
        write_marker(folder, info)
        (folder / SAVING).unlink()
        fsync_path(folder)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """The weights of `resume_from_checkpoint`, after `mlsm pretrain --resume`'s inputs
        check: its recorded input fingerprints must equal the inputs' now (a dictionary, store
        or teacher rebuilt in place since is refused in one line)."""
        folder = Path(resume_from_checkpoint)
        info = Checkpoint.at(folder).info
        if info.get("trainer") != TRAINER:  # no Trainer state to resume (optimizer, schedule)
            raise UserError(f"{folder} was written by mlsm pretrain, not by MLSMTrainer; resume "
                            "it with `mlsm pretrain --resume auto` and the run's config, or "
                            "start the Trainer from its weights (from_pretrained) without "
                            "resume_from_checkpoint")
        self._check_same_run(folder, info)
        RunDir(folder).check_inputs(self._input_fingerprints(), (folder, info))
        ckpt.load_weights(folder, self.accelerator.unwrap_model(self.model))

    def _check_same_run(self, folder: Path, info: dict[str, Any]) -> None:
        """`mlsm pretrain --resume`'s config check (`RunDir.check_same_run`): masking, model,
        objective, optimizer, batch and seed must be the checkpoint's, or the run goes on as a mix
        of two. A Trainer that counts epochs knows its length only once training starts, so then
        the schedule's length (and warmup, a fraction of it) are left to the Trainer."""
        from mlsm.train.loop import resolved_config

        now = resolved_config(config_to_dict(self.run_config()))  # both sides alike (0 is 0.0)

        def resolve(old: dict[str, Any]) -> dict[str, Any]:
            saved = resolved_config(old)
            if self.args.max_steps > 0:
                return saved
            return {**saved, "train": {**saved.get("train", {}), "steps": now["train"]["steps"]},
                    "optim": {**saved.get("optim", {}), "warmup": now["optim"]["warmup"]}}

        picked = (folder, info, {}) if isinstance(info.get("config"), dict) else None
        RunDir(folder).check_same_run(now, picked, resolve)

    def _input_fingerprints(self) -> dict[str, str]:
        """What the training reads, by content (`mlsm.train.loop.input_fingerprints`)."""
        from mlsm.train.loop import input_fingerprints

        return input_fingerprints(RunConfig(data=self.data, objective=self.objective_config))

    def run_config(self) -> RunConfig:
        """This training as an mlsm run configuration (masking, objective, AdamW settings, the
        global batch, the schedule's length and warmup)."""
        args = self.args
        total = max(self.state.max_steps or args.max_steps, self.state.global_step, 1)
        world = max(args.world_size, 1)
        batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * world
        # transformers 5 reads warmup_steps < 1 as a ratio; 4.x has warmup_ratio
        steps = args.warmup_steps or 0
        warmup = steps / total if steps >= 1 else steps or getattr(args, "warmup_ratio", 0)
        module = self.accelerator.unwrap_model(self.model)
        return RunConfig(
            data=self.data, model=ModelConfig(arch=module.student.config.model_type),
            objective=self.objective_config,
            optim=OptimConfig(lr=args.learning_rate, weight_decay=args.weight_decay,
                              betas=[args.adam_beta1, args.adam_beta2], eps=args.adam_epsilon,
                              warmup=warmup, clip=args.max_grad_norm),
            train=TrainConfig(steps=total, batch_size=batch,
                              micro_batch_size=args.per_device_train_batch_size,
                              out=str(args.output_dir), seed=args.seed, readiness=[1.0]))

    def checkpoint_info(self) -> dict[str, Any]:
        """checkpoint.json: what mlsm's verbs read (step, readiness, objective, config, latent head,
        PLL refusal) plus the Trainer's arguments and the weights training started from."""
        args, step = self.args, self.state.global_step
        cfg = self.run_config()
        module = self.accelerator.unwrap_model(self.model)
        # from_pretrained records its source; a model built from a config has none
        start = getattr(module.student.config, "_name_or_path", "") or None
        scheduler = args.lr_scheduler_type  # an Enum: its value ("linear")
        # with the facts readers need (latent head, PLL refusal), as mlsm's own loop writes them
        return ckpt.with_facts({
            "inputs": self._inputs, "step": step, "readiness": step / cfg.train.steps,
            "objective": cfg.objective.name, "run": str(args.output_dir),
            "tokens": step * cfg.train.batch_size * cfg.data.max_len,
            "config": config_to_dict(cfg), "trainer": TRAINER,
            "base_model": start, "lr_scheduler": str(getattr(scheduler, "value", scheduler)),
            "training_args": json.loads(args.to_json_string())})
