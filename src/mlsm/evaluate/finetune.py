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

import hashlib
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mlsm import tracking
from mlsm.artifacts.checkpoint import Checkpoint
from mlsm.errors import UserError
from mlsm.evaluate import protocol, qa
from mlsm.evaluate.retrieval import TEMPERATURE
from mlsm.evaluate.stats import append_results, check_model_name, read_results
from mlsm.evaluate.tasks import Example, TaskSpec, get_task, load_task
from mlsm.hf import check_max_len
from mlsm.inputs import check_apart, real_path
from mlsm.progress import Progress
from mlsm.runs import expand_models, resolve_checkpoint


@dataclass(frozen=True)
class ModelRef:
    """A model folder and what ``checkpoint.json`` says about it (None when absent)."""

    name: str
    path: str
    step: int | None = None
    readiness: float | None = None
    objective: str | None = None
    run: str | None = None


def resolve_model(spec: str | Path) -> ModelRef:
    """``"path"`` or ``"name=path"`` -> ModelRef.

    Default name: ``<run>@<step>`` if known, else the folder name.

    ``path`` may be a run directory, ``RUN@50%`` or ``RUN@step-N`` (`mlsm.runs`)."""
    text = str(spec)
    name, _, path = (("", "", text) if "=" not in text or Path(text).is_dir()
                     else text.partition("="))
    folder = resolve_checkpoint(path)
    if not (folder / "config.json").is_file():
        raise UserError(f"{folder}: not an HF model folder (no config.json); "
                        "pass a save_pretrained folder")
    meta: dict[str, Any] = {}
    if (folder / "checkpoint.json").exists():
        meta = Checkpoint.at(folder).info  # the one reader of checkpoint.json
    step = meta.get("step")
    run = meta.get("run")
    # our runs store the run directory as "run": name checkpoints <run dir name>@<step>
    if not name:
        name = (f"{Path(str(run)).name}@{step}" if run is not None and step is not None
                else real_path(folder).name)
    readiness = meta.get("readiness")
    return ModelRef(name, str(folder), None if step is None else int(step),
                    None if readiness is None else float(readiness), meta.get("objective"), run)


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from its parts, the same in every process (Python's hash() is salted)."""
    digest = hashlib.sha256("|".join(map(str, parts)).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class TaskHead(nn.Module):
    """Head on the backbone output: first token → dense+tanh → linear (cls/reg), or per-token
    linear; pooling="mean": mean of the unpadded tokens → linear (Gisserot-Boukhlef et al. 2025).

    The dense+tanh layer plays the role of BERT's pooler, built by us so that it is the same for
    every backbone (some have no pooler, others a pretrained one).
    """

    def __init__(self, d: int, n_out: int, per_token: bool, dropout: float = 0.1,
                 pooling: str = "cls") -> None:
        super().__init__()
        self.per_token, self.pooling = per_token, pooling
        self.drop = nn.Dropout(dropout)
        self.dense = None if per_token or pooling == "mean" else nn.Linear(d, d)
        self.out = nn.Linear(d, n_out)

    def forward(self, hidden: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        # hidden: (B, T, d) -> logits (B, T, n_out) per token, or (B, n_out) from position 0
        # or (pooling="mean") from the mean of the tokens the (B, T) attention mask keeps
        x = (hidden if self.per_token else protocol.mean_pool(hidden, attention_mask)
             if self.pooling == "mean" else hidden[:, 0])
        if self.dense is not None:
            x = torch.tanh(self.dense(self.drop(x)))
        return self.out(self.drop(x))


def build_head(spec: TaskSpec, d: int, seed: int, pooling: str = "cls") -> TaskHead:
    """The head for (task, seed): weights ~ N(0, 0.02²), biases 0, drawn on CPU from a generator
    seeded by (seed, task, d) alone — identical for every backbone with hidden size d."""
    head = TaskHead(d, spec.num_outputs, per_token=spec.kind in ("token", "qa"), pooling=pooling)
    gen = torch.Generator().manual_seed(stable_seed("head", seed, spec.name, d))
    with torch.no_grad():
        for module in (head.dense, head.out):
            if module is not None:
                module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * 0.02)
                module.bias.zero_()
    return head


def training_order(n: int, seed: int, task: str, epochs: int) -> list[list[int]]:
    """One permutation of range(n) per epoch, from (seed, task) only.

    The same for every model.
    """
    gen = torch.Generator().manual_seed(stable_seed("order", seed, task))
    return [torch.randperm(n, generator=gen).tolist() for _ in range(epochs)]


# ----------------------------------------------------------------------------- encoding


def load_tokenizer(path: str, spec: TaskSpec) -> Any:
    from mlsm import hf

    if spec.kind != "token":  # QA: `qa.encode_windows` refuses a slow tokenizer
        return hf.load_tokenizer(path)
    # Pre-split words need add_prefix_space for byte-level BPE tokenizers (RoBERTa, GPT-2);
    # WordPiece tokenizers ignore it.
    tok = hf.load_tokenizer(path, add_prefix_space=True)
    if not tok.is_fast:
        raise UserError(f"{path}: token tasks need a fast tokenizer (tokenizer.json) "
                        "for word alignment")
    return tok


def encode(tokenizer: Any, spec: TaskSpec, examples: Sequence[Example],
           max_len: int) -> list[dict[str, Any]]:
    """Tokenised features: {"inputs": tokenizer fields, "label": ...,
    "words": word index per labelled token}.

    Token tasks label the first sub-token of each word and put -100 on every other position.
    QA tasks give one feature per context window (`qa.encode_windows`).
    """
    if spec.kind == "qa":
        return qa.encode_windows(tokenizer, examples, max_len)
    feats = []
    for ex in examples:
        if spec.kind != "token":
            enc = tokenizer(ex.text, ex.text_pair, truncation=True, max_length=max_len)
            feats.append({"inputs": dict(enc), "label": ex.label, "words": None})
            continue
        enc = tokenizer(ex.text, is_split_into_words=True, truncation=True, max_length=max_len)
        labels, words, prev = [], [], None
        for w in enc.word_ids():
            first = w is not None and w != prev
            labels.append(ex.label[w] if first else -100)
            if first:
                words.append(w)
            prev = w
        feats.append({"inputs": dict(enc), "label": labels, "words": words})
    return feats


def collate(tokenizer: Any, spec: TaskSpec, feats: Sequence[dict[str, Any]],
            device: torch.device) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Pad a batch: model inputs (B, T) and labels (B,) or (B, T) with -100 padding; QA:
    (B, 2) start/end positions."""
    if spec.kind == "qa":
        return qa.collate(tokenizer, feats, device)
    batch = tokenizer.pad([f["inputs"] for f in feats], return_tensors="pt")
    if spec.kind == "token":
        width = batch["input_ids"].shape[1]
        labels = torch.tensor([f["label"] + [-100] * (width - len(f["label"])) for f in feats])
    else:
        labels = torch.tensor([f["label"] for f in feats],
                              dtype=torch.float32 if spec.kind == "reg" else torch.long)
    return {k: v.to(device) for k, v in batch.items()}, labels.to(device)


# ----------------------------------------------------------------------------- train / eval


def _loss(spec: TaskSpec, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    if spec.kind == "reg":
        return nn.functional.mse_loss(logits.squeeze(-1), labels)
    # (B, C) vs (B,) or (B, T, C) vs (B, T); -100 marks non-first sub-tokens and padding
    return nn.functional.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=-100)


def _optimizer(params: list[nn.Parameter], lr: float, weight_decay: float) -> torch.optim.AdamW:
    # No decay on biases and LayerNorm weights (1-D tensors), as in BERT fine-tuning.
    decay = [p for p in params if p.ndim >= 2]
    rest = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": rest, "weight_decay": 0.0}]
    try:  # the fused kernel, as the HF Trainer's default: a step ~6x faster on CPU than the
        # per-tensor loop (4.3M parameters: 0.11 s vs 0.66 s; benchmarks/README.md)
        return torch.optim.AdamW(groups, lr=lr, fused=True)
    except (RuntimeError, ValueError):  # a device or dtype the fused kernel does not take
        return torch.optim.AdamW(groups, lr=lr)


def linear_schedule(opt: torch.optim.Optimizer, total: int,
                    warm: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over ``warm`` steps, then linear decay to 0 at step ``total``."""
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else max(0.0, (total - s) / max(1, total - warm)))


def train_cell(backbone: nn.Module, head: TaskHead, tokenizer: Any, spec: TaskSpec,
               feats: list[dict[str, Any]], seed: int, cfg: dict[str, Any], device: torch.device,
               tracker: Any = None) -> int:
    """Fine-tune backbone + head in place: AdamW, linear schedule, ``cfg["epochs"]`` epochs.
    Returns the number of optimizer steps.

    cfg["fixed_order"]: every seed trains on seed 0's data order (the Hitchhikers' Guide §4.2: seeds
    differ in the head only); cfg["clip"]: gradient-norm clipping, 0 = none. tracker: an
    `mlsm.tracking.Tracker` that gets the training loss and lr every LOG_EVERY steps."""
    torch.manual_seed(seed)  # dropout masks; the data order has its own generator
    order = training_order(len(feats), 0 if cfg.get("fixed_order") else seed, spec.name,
                           cfg["epochs"])
    clip = float(cfg.get("clip", 1.0))
    bs = cfg["batch_size"]
    total = cfg["epochs"] * math.ceil(len(feats) / bs)
    if cfg.get("max_steps"):  # a step cap: whichever of epochs and max_steps ends first
        total = min(total, cfg["max_steps"])
    warm = int(cfg["warmup_ratio"] * total)
    opt = _optimizer([*backbone.parameters(), *head.parameters()], cfg["lr"], cfg["weight_decay"])
    sched = linear_schedule(opt, total, warm)
    backbone.train()
    head.train()
    step = 0
    # a cell can take many minutes on a CPU: its own progress under the grid's
    bar = Progress(total, f"{spec.name} seed {seed}", "step", leave=False)
    for perm in order:
        for i in range(0, len(perm) if step < total else 0, bs):
            inputs, labels = collate(tokenizer, spec, [feats[j] for j in perm[i:i + bs]], device)
            hidden = backbone(**inputs).last_hidden_state
            logits = head(hidden, inputs.get("attention_mask"))
            loss = (qa.loss(logits, labels, inputs["attention_mask"]) if spec.kind == "qa"
                    else _loss(spec, logits, labels))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if clip > 0:
                torch.nn.utils.clip_grad_norm_([*backbone.parameters(), *head.parameters()], clip)
            opt.step()
            sched.step()
            step += 1
            if step % LOG_EVERY == 0:  # .item() waits for the device: not every step
                value = loss.item()
                bar.set_postfix(loss=value)
                if tracker is not None:
                    tracker.log({"train/loss": value, "train/lr": sched.get_last_lr()[0]}, step)
            bar.update(1)
            if step == total:
                break
    bar.close()
    return step


@torch.no_grad()
def predict(backbone: nn.Module, head: TaskHead, tokenizer: Any, spec: TaskSpec,
            feats: list[dict[str, Any]], examples: Sequence[Example], device: torch.device,
            batch_size: int = 64) -> list[Any]:
    """Predictions per example: class ids, floats, or one tag name per word (truncated words
    → "O").

    Batches are formed from length-sorted examples (less padding); results come back in input
    order.
    """
    if spec.kind == "qa":  # windows -> one decoded answer per example
        return qa.predict(backbone, head, tokenizer, feats, examples, device, batch_size)
    backbone.eval()
    head.eval()
    order = sorted(range(len(feats)), key=lambda k: len(feats[k]["inputs"]["input_ids"]))
    preds: list[Any] = [None] * len(feats)
    for i in range(0, len(order), batch_size):
        idx = order[i:i + batch_size]
        inputs, _ = collate(tokenizer, spec, [feats[k] for k in idx], device)
        hidden = backbone(**inputs).last_hidden_state
        out = head(hidden, inputs.get("attention_mask")).float().cpu()  # (B, C) or (B, T, C)
        for row, k in zip(out, idx, strict=True):
            preds[k] = _decode(spec, row, feats[k], examples[k])
    return preds


def _decode(spec: TaskSpec, row: torch.Tensor, feat: dict[str, Any], ex: Example) -> Any:
    if spec.kind == "reg":
        return float(row[0])
    if spec.kind == "cls":
        return int(row.argmax())
    tags = ["O"] * len(ex.text)
    positions = [t for t, lab in enumerate(feat["label"]) if lab != -100]
    for t, w in zip(positions, feat["words"], strict=True):
        tags[w] = spec.labels[int(row[t].argmax())]
    return tags


def score(spec: TaskSpec, preds: list[Any], examples: Sequence[Example]) -> dict[str, float]:
    """The task metric(s) of predictions against the examples' gold labels."""
    if spec.kind == "qa":
        return spec.metric(preds, examples)
    if spec.kind == "token":
        gold = [[spec.labels[t] for t in ex.label] for ex in examples]
        return spec.metric(preds, gold)
    return spec.metric(preds, [ex.label for ex in examples])


# ----------------------------------------------------------------------------- the grid


def pick_device(device: str | torch.device = "auto") -> torch.device:
    """``"auto"`` → CUDA when available, else CPU."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _cell_key(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row["model"], row["task"], row["seed"], float(row["lr"]), row["epochs"],
            row["batch_size"], row["max_len"], row["n_train"], row.get("head", "cls"),
            row.get("max_steps", 0))


def _task_data(spec: TaskSpec, data_dir: str | Path | None, max_train: int | None,
               eval_test: bool = False) -> tuple[list[Example], dict[str, list[Example]]]:
    if spec.kind == "retrieval":  # BEIR data: training queries and test splits
        from mlsm.evaluate import retrieval_cell

        return retrieval_cell.task_data(spec, data_dir, max_train)  # type: ignore[return-value]
    train = load_task(spec.name, spec.train_split, data_dir, max_train)
    evals = {suffix: load_task(spec.name, split, data_dir)
             for suffix, split in spec.eval_splits.items()}
    if eval_test and spec.test_split:  # metric "<name>_test" beside the validation metric
        evals["test"] = load_task(spec.name, spec.test_split, data_dir)
    return train, evals


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
        from mlsm.evaluate import retrieval_cell

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


def _load_backbone(path: str) -> nn.Module:
    """``AutoModel`` in float32 (whatever dtype the folder was saved in). The load report is
    silenced: a masked-LM folder's unused head and an mlsm checkpoint's absent pooler are expected,
    and one report per (model, task, seed, lr) cell would drown the fine-tuning log."""
    from transformers import AutoModel

    from mlsm.hf import load_model, quiet

    with quiet():
        return load_model(AutoModel, path, dtype=torch.float32)


def run_cell(model: ModelRef, spec: TaskSpec, data: Prepared, seed: int, cfg: dict[str, Any],
             device: torch.device, tracker: Any = None) -> list[dict[str, Any]]:
    """One fine-tuning run (model, task, seed, lr) → one result row per metric (also sent to
    `tracker`, an `mlsm.tracking.Tracker`, as eval/<metric> at the last step)."""
    if spec.kind == "retrieval":  # a bi-encoder without a head: mlsm.evaluate.retrieval_cell
        from mlsm.evaluate import retrieval_cell

        return retrieval_cell.run_cell(model, spec, data, seed, cfg, device, tracker)  # type: ignore
    start = time.time()
    backbone = _load_backbone(model.path).to(device)
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


LOG_EVERY = 10  # training steps between tracker points of a fine-tuning cell


def _cell_tracker(report_to: Sequence[str], results: Path, ref: ModelRef, spec: TaskSpec, seed: int,
                  cfg: dict[str, Any]) -> tracking.Tracker:
    """One tracker run per cell, named model-task-seed-lr; local files in RESULTS_DIR/tracking."""
    name = f"{ref.name}-{spec.name}-seed{seed}-lr{cfg['lr']:g}".replace("/", "_")
    config = {"model": ref.name, "path": ref.path, "task": spec.name, "seed": seed, **cfg}
    folder = results.parent / "tracking"
    return tracking.open_tracker(list(report_to), folder, config, name, "--report-to")


def _check_grid(models: Sequence[str | Path], tasks: Sequence[str], seeds: Sequence[int],
                lrs: Sequence[float], epochs: int, batch_size: int, max_len: int,
                max_train_examples: int | None) -> None:
    """Refuse a grid that would train nothing and still write its (untrained) scores as results:
    a string where a list belongs, an empty axis, sizes that are not positive, bad lrs."""
    for name, value in (("models", models), ("tasks", tasks)):
        if isinstance(value, str | Path):  # a string would be iterated letter by letter
            raise UserError(f"finetune(): {name} must be a list, got the string {str(value)!r}; "
                            f"write [{str(value)!r}]")
    if not models or not tasks or not seeds or not lrs:
        raise UserError("finetune needs at least one model, task, seed and learning rate")
    sizes = {"--epochs": epochs, "--batch-size": batch_size, "--max-len": max_len}
    if max_train_examples is not None:
        sizes["--max-train-examples"] = max_train_examples
    for flag, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"{flag} must be a positive integer, got {value}; "
                            "nothing was trained or written")
    if not all(isinstance(lr, int | float) and math.isfinite(lr) and lr > 0 for lr in lrs):
        raise UserError(f"--lrs must be positive learning rates, got {list(lrs)}; "
                        "nothing was trained or written")


def _grid(models: Sequence[str | Path], tasks: Sequence[str],
          readiness: str) -> tuple[list[ModelRef], list[TaskSpec]]:
    """The models (each readiness checkpoint of a run with readiness="all") and the tasks of a
    grid; one line for two models of one name or a task given twice."""
    refs = [resolve_model(m) for m in expand_models(models, readiness)]
    if len({r.name for r in refs}) != len(refs):
        raise UserError("two models share a name; pass them as name=path to tell them apart")
    specs = [get_task(t) for t in tasks]
    twice = sorted({s.name for s in specs if [x.name for x in specs].count(s.name) > 1})
    if twice:
        raise UserError(f"--tasks lists {twice[0]} twice; give each task once")
    return refs, specs


def finetune(
    models: Sequence[str | Path],
    tasks: Sequence[str],
    seeds: Sequence[int] = (0, 1, 2, 3, 4),
    lrs: Sequence[float] = (2e-5,),
    epochs: int = 3,
    batch_size: int = 32,
    max_len: int = 128,
    data_dir: str | Path | None = None,
    results: str | Path = "results.jsonl",
    max_train_examples: int | None = None,
    device: str | torch.device = "auto",
    warmup_ratio: float = 0.0,
    weight_decay: float = 0.01,
    fixed_order: bool = False,
    clip: float = 1.0,
    eval_test: bool = False,
    readiness: str = "final",
    report_to: Sequence[str] = (),
    max_steps: int = 0,
    head: str = "cls",
    val_fraction: float = 0.0,
    preset: str = "",
    temperature: float = TEMPERATURE,
) -> Path:
    """Fine-tune every model on every task for every seed and lr; append dev metrics to ``results``.

    ``models``: HF folders or run directories (``RUN``, ``RUN@50%``, ``RUN@step-N``: `mlsm.runs`),
    optionally ``"name=path"``; ``readiness="all"`` takes every readiness checkpoint of each run
    directory (named ``name@<step>``). ``data_dir``: folder holding the task
    folders (``CoLA/``, ``SST-2/``, ``WiC/``, ``conll2003/``...); None loads HF ``datasets``.
    Cells already in ``results`` (same model, task, seed, lr, epochs, batch, max_len, n_train)
    are skipped, so an interrupted grid resumes. Returns the results path.

    Fidelity options (docs/fidelity.md): ``fixed_order`` (one data order for all seeds),
    ``clip`` (gradient-norm clipping, 0 = off), ``eval_test`` (also score tasks with a labelled
    test split, i.e. CoNLL-2003, as ``<metric>_test``); ``max_len`` up to the model's limit (512).

    Protocol options (``max_steps``, ``head``, ``val_fraction``, ``preset``; a preset's settings:
    ``**preset_settings(NAME)``): see `mlsm.evaluate.protocol` and docs/finetune.md.
    ``temperature``: InfoNCE τ of retrieval tasks (`mlsm.evaluate.retrieval`, docs/finetune.md).
    """
    if clip < 0:
        raise UserError(f"clip={clip} must be >= 0 (0 disables gradient clipping)")
    tracking.require(list(report_to), "--report-to")  # before any model is loaded
    _check_grid(models, tasks, seeds, lrs, epochs, batch_size, max_len, max_train_examples)
    protocol.check_protocol(max_steps, head, val_fraction)
    refs, specs = _grid(models, tasks, readiness)
    for ref in refs:  # names become table cells (compare refuses some)
        check_model_name(ref.name, "model name")
    check_apart(results, "--results", {"--data-dir": data_dir,
                                       **{f"model {r.name}": r.path for r in refs}})
    settings = {"epochs": epochs, "batch_size": batch_size, "max_len": max_len,
                "warmup_ratio": warmup_ratio, "weight_decay": weight_decay,
                "fixed_order": fixed_order, "clip": clip, "max_steps": max_steps, "head": head,
                "temperature": temperature,
                # zero-shot retrieval: corpus embeddings per checkpoint fingerprint
                "retrieval_cache": str(Path(results).parent / "retrieval_cache")}
    path = Path(results)
    if any(s.kind == "retrieval" for s in specs):
        from mlsm.evaluate.retrieval_cell import check_temperature

        check_temperature(path, specs, temperature)
    task_data = protocol.with_validation(
        lambda spec: _task_data(spec, data_dir, max_train_examples, eval_test), val_fraction,
        lambda spec: stable_seed("validation", spec.name))
    grid = protocol.grid_path(path) if val_fraction else path
    _run_grid(refs, specs, seeds, lrs, settings, grid, pick_device(device), report_to, task_data,
              None if not val_fraction else lambda cell: protocol.report_selected(
                  grid, path, {**cell, "lr": lrs, "seed": seeds}, preset))
    return path


def _run_grid(refs: list[ModelRef], specs: list[TaskSpec], seeds: Sequence[int],
              lrs: Sequence[float], settings: dict[str, Any], path: Path, dev: torch.device,
              report_to: Sequence[str], task_data: Callable[[TaskSpec], Any],
              finish: Callable[[dict[str, Any]], None] | None = None) -> None:
    """Run every cell (task, model, lr, seed) not yet in the results file `path`, appending its
    rows when it ends. settings: the cell config shared by all cells, besides lr; task_data:
    spec -> (train examples, {split: eval examples}), read once per task; finish: called with
    what the rows of each (model, task) share once all its cells are in `path`."""
    done = {_cell_key(r) for r in read_results(path)} if path.exists() else set()
    bar = Progress(len(refs) * len(specs) * len(seeds) * len(lrs), "finetune", "cell")
    for spec in specs:
        train, evals = task_data(spec)
        for ref in refs:
            data = None  # tokenised on first use: a finished model costs nothing on resume
            for lr, seed in itertools.product(lrs, seeds):
                cfg = {"lr": float(lr), **settings}
                if (ref.name, spec.name, seed, float(lr), settings["epochs"],
                        settings["batch_size"], settings["max_len"], len(train),
                        settings["head"], settings["max_steps"]) not in done:
                    bar.set_postfix(cell=f"{ref.name}:{spec.name}:seed={seed}:lr={lr:g}")
                    data = data or prepare(ref, spec, train, evals, settings["max_len"])
                    with _cell_tracker(report_to, path, ref, spec, seed, cfg) as tracker:
                        rows = run_cell(ref, spec, data, seed, cfg, dev, tracker)
                    append_results(path, rows)
                bar.update(1)
            if finish is not None:
                finish({"model": ref.name, "task": spec.name, "n_train": len(train),
                        **{k: settings[k] for k in protocol.GRID_FIELDS if k in settings}})
    bar.close()
