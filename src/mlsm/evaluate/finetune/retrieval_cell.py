"""Retrieval cells of the fine-tuning grid (`mlsm finetune --tasks scifact,beir:NAME,...`).

A retrieval task (``TaskSpec.kind == "retrieval"``) fine-tunes the bare encoder as a bi-encoder
(`mlsm.evaluate.finetune.retrieval`: mean pooling, InfoNCE with in-batch negatives) on the training
qrels
and scores the test qrels by exact search over the whole corpus; a ``_zeroshot`` task skips the
training. Cells pair across models the way classification cells do: for seed s on task t the
positive chosen for each training query (when it has several) and the data order come from
generators seeded by (s, t) only, and dropout from ``torch.manual_seed(s)``.

`finetune.py` (above this module) hands retrieval tasks to `task_data`, `prepare` and `run_cell`
here, and the training queries a validation fraction holds out to `validation_split`; the rows
written are ordinary result rows (metrics ``ndcg@10``, ``recall@100``, ``mrr@10``) that
``compare``, ``report`` and studies read unchanged.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mlsm.artifacts.results_file import read_results
from mlsm.errors import UserError
from mlsm.evaluate.finetune.beir import BeirSplit, load_beir_hf, read_beir
from mlsm.evaluate.finetune.cell import (
    LOG_EVERY,
    ModelRef,
    linear_schedule,
    load_backbone,
    optimizer,
    stable_seed,
    step_budget,
    training_order,
)
from mlsm.evaluate.finetune.retrieval import (
    TEMPERATURE,
    embed,
    encode_corpus,
    evaluate_split,
    info_nce,
    pad,
    tokenize,
)
from mlsm.evaluate.finetune.tasks import TaskSpec, task_folder
from mlsm.progress import Progress


@dataclass(frozen=True)
class TrainQuery:
    """A training query and its relevant documents (grade > 0), sorted by document id."""

    qid: str
    text: str
    positives: tuple[tuple[str, str], ...]  # (document id, document text)
    judged: tuple[tuple[str, int], ...] = ()  # its qrels: (document id, grade), by document id


def load_split(spec: TaskSpec, data_dir: str | Path | None, split: str) -> BeirSplit:
    """One split of the task: the BEIR folder under ``data_dir``, else HF datasets."""
    if data_dir is None:
        return load_beir_hf(spec.folders[0], split, [path for path, _ in spec.hf])
    return read_beir(task_folder(spec, data_dir), split)


def training_queries(split: BeirSplit) -> list[TrainQuery]:
    """The queries of a training split that have at least one relevant document, in qrels order."""
    text = dict(zip(split.doc_ids, split.doc_texts, strict=True))
    out = []
    for qid, judged in split.qrels.items():
        pos = tuple(sorted((d, text[d]) for d, grade in judged.items() if grade > 0))
        if pos:
            out.append(TrainQuery(qid, split.queries[qid], pos, tuple(sorted(judged.items()))))
    return out


def validation_split(held_out: Sequence[TrainQuery], evals: dict[str, BeirSplit]) -> BeirSplit:
    """Training queries held out for validation (`protocol.with_validation`) as a split scored
    like the test split: the dataset's corpus (one per BEIR dataset, here the test split's) and
    the held-out queries' own training qrels."""
    corpus = next(iter(evals.values()))
    return BeirSplit(corpus.doc_ids, corpus.doc_texts, {q.qid: q.text for q in held_out},
                     {q.qid: dict(q.judged) for q in held_out},
                     f"{corpus.where} (validation queries held out of the training qrels)")


def task_data(spec: TaskSpec, data_dir: str | Path | None,
              max_train: int | None) -> tuple[list[TrainQuery], dict[str, BeirSplit]]:
    """(training queries, {metric suffix: test split}); no training queries for a zero-shot task.

    ``max_train`` keeps a fixed random subset of training queries (seed 0, qrels order kept),
    the same for every model and seed, as `tasks.load_task` does for examples."""
    evals = {suffix: load_split(spec, data_dir, split)
             for suffix, split in spec.eval_splits.items()}
    if not spec.train_split:
        return [], evals
    train = training_queries(load_split(spec, data_dir, spec.train_split))
    if max_train is not None and max_train < len(train):
        keep = np.sort(np.random.default_rng(0).choice(len(train), size=max_train, replace=False))
        train = [train[i] for i in keep]
    return train, evals


@dataclass
class RetrievalPrepared:
    """One model's tokenisation of a retrieval task's training data (test sets are encoded at
    evaluation time, by the fine-tuned weights)."""

    tokenizer: Any
    train: list[TrainQuery]
    query_feats: list[dict[str, list[int]]]  # per training query
    doc_feats: dict[str, dict[str, list[int]]]  # per positive document id
    evals: dict[str, BeirSplit]


def prepare(model: ModelRef, spec: TaskSpec, train: list[TrainQuery],
            evals: dict[str, BeirSplit], max_len: int) -> RetrievalPrepared:
    """Tokenise the training queries and every positive document with the model's tokenizer.
    A `max_len` beyond the model's positions is one line here, before any training: the test
    corpus is tokenised only at evaluation."""
    from mlsm import hf

    hf.check_max_len(model.path, max_len, "--max-len")
    tok = hf.load_tokenizer(model.path)
    docs = dict(p for t in train for p in t.positives)
    ids = list(docs)
    doc_feats = dict(zip(ids, tokenize(tok, [docs[d] for d in ids], max_len), strict=True))
    return RetrievalPrepared(tok, train, tokenize(tok, [t.text for t in train], max_len),
                             doc_feats, evals)


def pick_positives(train: Sequence[TrainQuery], seed: int, task: str) -> list[str]:
    """One positive document id per query: the only one, or one drawn from a generator seeded by
    (seed, task) alone, so every model sees the same pairs for a seed."""
    gen = torch.Generator().manual_seed(stable_seed("positive", seed, task))
    return [t.positives[int(torch.randint(len(t.positives), (1,), generator=gen))][0]
            for t in train]


def batch_loss(backbone: torch.nn.Module, data: RetrievalPrepared, idx: Sequence[int],
               chosen: Sequence[str], temperature: float, device: torch.device) -> torch.Tensor:
    """InfoNCE of one batch of (query, chosen positive) pairs; queries and documents are
    embedded in two forward passes, each padded to its own length."""
    q = embed(backbone, pad(data.tokenizer, [data.query_feats[i] for i in idx], device))  # (B, d)
    keys = [chosen[i] for i in idx]
    d = embed(backbone, pad(data.tokenizer, [data.doc_feats[k] for k in keys], device))  # (B, d)
    return info_nce(q, d, temperature, keys)


def train_bi_encoder(backbone: torch.nn.Module, data: RetrievalPrepared, task: str, seed: int,
                     cfg: dict[str, Any], device: torch.device, tracker: Any = None) -> int:
    """Fine-tune the encoder in place with InfoNCE: AdamW, linear schedule, ``cfg["epochs"]``
    epochs of ``cfg["batch_size"]`` queries, or ``cfg["max_steps"]`` steps when that ends first
    (`step_budget`, as every kind); returns the number of optimizer steps."""
    torch.manual_seed(seed)  # dropout; pairs and order have their own generators
    data_seed = 0 if cfg.get("fixed_order") else seed
    chosen = pick_positives(data.train, data_seed, task)
    order = training_order(len(data.train), data_seed, task, cfg["epochs"])
    bs, clip = cfg["batch_size"], float(cfg.get("clip", 1.0))
    tau = float(cfg.get("temperature", TEMPERATURE))
    total = step_budget(len(data.train), cfg)
    params = list(backbone.parameters())
    opt = optimizer(params, cfg["lr"], cfg["weight_decay"])
    sched = linear_schedule(opt, total, int(cfg["warmup_ratio"] * total))
    backbone.train()
    step = 0
    bar = Progress(total, f"{task} seed {seed}", "step", leave=False)
    for perm in order:
        for i in range(0, len(perm) if step < total else 0, bs):
            loss = batch_loss(backbone, data, perm[i:i + bs], chosen, tau, device)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(params, clip)
            opt.step()
            sched.step()
            step += 1
            if step % LOG_EVERY == 0 and tracker is not None:
                tracker.log({"train/loss": loss.item(), "train/lr": sched.get_last_lr()[0]}, step)
            bar.update(1)
            if step == total:
                break
    bar.close()
    return step


def run_cell(model: ModelRef, spec: TaskSpec, data: RetrievalPrepared, seed: int,
             cfg: dict[str, Any], device: torch.device,
             tracker: Any = None) -> list[dict[str, Any]]:
    """One retrieval run (model, task, seed, lr) -> one result row per metric. A zero-shot
    cell scores the checkpoint as loaded; its corpus embeddings are cached in
    ``cfg["retrieval_cache"]`` (keyed by the weights' fingerprint), fine-tuned ones are not."""
    start = time.time()
    backbone = load_backbone(model.path).to(device)
    steps = train_bi_encoder(backbone, data, spec.name, seed, cfg, device, tracker) \
        if data.train else 0
    rows = []
    for suffix, (split, scores) in _score_splits(backbone, data, cfg, device).items():
        for metric, value in scores.items():
            rows.append({
                "model": model.name, "path": model.path, "step": model.step,
                "readiness": model.readiness, "objective": model.objective, "run": model.run,
                "task": spec.name, "metric": f"{metric}_{suffix}" if suffix else metric,
                "value": value, "seed": seed, "lr": cfg["lr"], "epochs": cfg["epochs"],
                "batch_size": cfg["batch_size"], "max_len": cfg["max_len"],
                "max_steps": cfg.get("max_steps", 0), "n_train": len(data.train),
                "n_eval": len(split.queries), "n_docs": len(split.doc_ids),
                "zero_shot": not data.train,
                "temperature": float(cfg.get("temperature", TEMPERATURE)) if data.train else None,
                "fixed_order": bool(cfg.get("fixed_order")), "clip": float(cfg.get("clip", 1.0)),
                "seconds": round(time.time() - start, 2)})
    if tracker is not None:
        tracker.log({f"eval/{r['metric']}": r["value"] for r in rows}, steps)
    return rows


def _score_splits(backbone: torch.nn.Module, data: RetrievalPrepared, cfg: dict[str, Any],
                  device: torch.device) -> dict[str, tuple[BeirSplit, dict[str, float]]]:
    """metric suffix -> (split, its scores). Splits over one corpus (the test split and a
    validation split held out of the training queries) share one encoding of it."""
    cache = None if data.train else cfg.get("retrieval_cache")
    corpora: dict[int, torch.Tensor] = {}  # id of a split's document list -> its embeddings
    out = {}
    for suffix, split in data.evals.items():
        docs = corpora.get(id(split.doc_texts))
        if docs is None:
            docs = corpora[id(split.doc_texts)] = encode_corpus(
                backbone, data.tokenizer, split, cfg["max_len"], device, cache)
        out[suffix] = split, evaluate_split(backbone, data.tokenizer, split, cfg["max_len"],
                                            device, docs=docs)
    return out


def check_validation(specs: Sequence[TaskSpec], fraction: float) -> None:
    """Refuse a zero-shot retrieval task in a grid that picks its learning rate on a validation
    split: nothing is trained, so there are no training queries to hold out, nor an lr."""
    zero = next((s for s in specs if s.kind == "retrieval" and not s.train_split), None)
    if fraction and zero is not None:
        tuned = zero.name[:-len("_zeroshot")]
        raise UserError(f"task {zero.name} trains nothing, so it has no learning rate to choose "
                        f"on a validation split (--val-fraction {fraction:g}, set by a --preset "
                        f"too); score it in a grid without them, or fine-tune it as {tuned}")


def check_temperature(results: Path, specs: Sequence[TaskSpec], temperature: float) -> None:
    """Refuse to add fine-tuned retrieval cells at one temperature to a results file holding the
    same tasks at another: `compare`'s cell key has no temperature, so it would pair them (the
    grid itself never reuses one: temperature is in the cell's fingerprint)."""
    if not (math.isfinite(temperature) and temperature > 0):
        raise UserError(f"--temperature must be a positive number, got {temperature}; "
                        f"the usual InfoNCE setting is {TEMPERATURE}")
    tasks = {s.name for s in specs if s.kind == "retrieval" and s.train_split}
    if not tasks or not results.exists():
        return
    for row in read_results(results):
        held = row.get("temperature")
        if row["task"] in tasks and held is not None and float(held) != temperature:
            raise UserError(f"{results} holds {row['task']} results fine-tuned at temperature "
                            f"{held}, this grid uses {temperature}; pass another --results file "
                            "for another temperature (nothing was trained or written)")
