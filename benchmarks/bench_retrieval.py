"""Retrieval fine-tuning speed: mlsm's InfoNCE loop against the HF Trainer doing the same.

Both sides train the same randomly initialised BERT (same shape, same seed) on the same
(query, positive document) pairs with InfoNCE over in-batch negatives (mean pooling, cosine,
τ = 0.05), AdamW with the same settings, a linear schedule, gradient clipping 1.0, the same batch
size and max_len. The HF side is a `transformers.Trainer` whose ``compute_loss`` embeds the
queries and documents and calls the same `mlsm.evaluate.finetune.retrieval.info_nce`; its
collator pads queries and documents separately, as mlsm does. Data: the SciFact training qrels when
../shared/data/scifact is present, else synthetic pairs. Rounds alternate the two sides; the
median ratio of seconds per step (HF / mlsm) is printed with the machine, in wall
and in CPU time (fair on a shared machine).

    PYTHONPATH=src HF_HUB_OFFLINE=1 python benchmarks/bench_retrieval.py --steps 20 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import BertConfig, BertModel, Trainer, TrainingArguments

from mlsm.evaluate.finetune.retrieval import embed, info_nce, pad, tokenize
from mlsm.evaluate.finetune.retrieval_cell import RetrievalPrepared, TrainQuery, train_bi_encoder
from mlsm.provenance import machine_description

SCIFACT = Path(__file__).resolve().parents[2] / "shared/data/scifact"


def pairs(n: int, scifact: Path) -> list[TrainQuery]:
    """n training queries: SciFact's (first positive kept) when present, else synthetic."""
    if (scifact / "corpus.jsonl.gz").is_file():
        from mlsm.evaluate.finetune.beir import read_beir
        from mlsm.evaluate.finetune.retrieval_cell import training_queries

        queries = training_queries(read_beir(scifact, "train"))
        return [TrainQuery(t.qid, t.text, t.positives[:1]) for t in queries][:n]
    rng = random.Random(0)
    words = [f"w{i}" for i in range(2000)]
    return [TrainQuery(f"q{i}", " ".join(rng.choices(words, k=12)),
                       ((f"d{i}", " ".join(rng.choices(words, k=150))),)) for i in range(n)]


def model(tok, layers: int, d: int) -> BertModel:
    torch.manual_seed(0)
    return BertModel(BertConfig(vocab_size=len(tok), hidden_size=d, num_hidden_layers=layers,
                                num_attention_heads=max(1, d // 64), intermediate_size=4 * d))


def _clock() -> tuple[float, float]:
    """(wall, CPU) seconds; CPU time of the whole process (all threads) stays fair on a shared,
    loaded machine, where wall time measures the other jobs as much as ours."""
    return time.perf_counter(), time.process_time()


def _per_step(t0: tuple[float, float], steps: int, dev: torch.device) -> tuple[float, float]:
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t1 = _clock()
    return (t1[0] - t0[0]) / steps, (t1[1] - t0[1]) / steps


def run_mlsm(data: RetrievalPrepared, net: BertModel, cfg: dict,
             dev: torch.device) -> tuple[float, float]:
    t0 = _clock()
    steps = train_bi_encoder(net, data, "bench", 0, cfg, dev)
    return _per_step(t0, steps, dev)


class InfoNCETrainer(Trainer):
    """The HF side: the same loss, computed in the Trainer's own loop."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        q = embed(model, inputs["q"])  # (B, d)
        d = embed(model, inputs["d"])  # (B, d)
        loss = info_nce(q, d, 0.05, inputs["keys"])
        return (loss, None) if return_outputs else loss


def run_hf(data: RetrievalPrepared, net: BertModel, cfg: dict, dev: torch.device,
           out: str) -> tuple[float, float]:
    rows = [{"q": data.query_feats[i], "d": data.doc_feats[t.positives[0][0]],
             "key": t.positives[0][0]} for i, t in enumerate(data.train)]

    def collate(batch: list[dict]) -> dict:
        return {"q": pad(data.tokenizer, [b["q"] for b in batch], torch.device("cpu")),
                "d": pad(data.tokenizer, [b["d"] for b in batch], torch.device("cpu")),
                "keys": [b["key"] for b in batch]}

    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=cfg["batch_size"],
        num_train_epochs=cfg["epochs"], learning_rate=cfg["lr"], weight_decay=0.01,
        lr_scheduler_type="linear", warmup_steps=0, max_grad_norm=1.0, logging_steps=10**9,
        save_strategy="no", report_to=[], dataloader_num_workers=0, disable_tqdm=True,
        remove_unused_columns=False, use_cpu=dev.type == "cpu", seed=0)
    trainer = InfoNCETrainer(model=net, args=args, train_dataset=rows, data_collator=collate)
    t0 = _clock()
    result = trainer.train()
    return _per_step(t0, result.global_step, dev)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps per side and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--scifact", type=Path, default=SCIFACT, help="BEIR SciFact folder")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not (a.scifact / "corpus.jsonl.gz").is_file():
        print(f"note: {a.scifact} absent, synthetic pairs")
    from mlsm import hf
    from mlsm.teacher.teacher import default_teacher_path

    tok = hf.load_tokenizer(default_teacher_path())  # the packaged MiniLM tokenizer
    train = pairs(a.steps * a.batch, a.scifact)
    docs = {t.positives[0][0]: t.positives[0][1] for t in train}
    data = RetrievalPrepared(tok, train, tokenize(tok, [t.text for t in train], a.max_len),
                             dict(zip(docs, tokenize(tok, list(docs.values()), a.max_len),
                                      strict=True)), {})
    cfg = {"lr": 2e-5, "epochs": 1, "batch_size": a.batch, "warmup_ratio": 0.0,
           "weight_decay": 0.01, "clip": 1.0, "temperature": 0.05, "fixed_order": True}
    print(f"machine: {machine_description()}; load average {os.getloadavg()[0]:.1f}; "
          f"{a.threads} torch threads; BERT {a.layers}x{a.hidden}, "
          f"batch {a.batch}, max_len {a.max_len}, {len(train)} pairs, {a.steps} steps per side")
    wall, cpu = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            sides = [lambda: run_mlsm(data, model(tok, a.layers, a.hidden).to(dev), cfg, dev),
                     lambda: run_hf(data, model(tok, a.layers, a.hidden).to(dev), cfg, dev, tmp)]
            # the side that runs first in a round alternates (warm-up and order effects cancel)
            first, second = (sides[0](), sides[1]()) if r % 2 == 0 else (sides[1](), sides[0]())
            ours, theirs = (first, second) if r % 2 == 0 else (second, first)
            wall.append(theirs[0] / ours[0])
            cpu.append(theirs[1] / ours[1])
            print(f"round {r}: seconds per step wall/CPU: mlsm {ours[0]:.3f}/{ours[1]:.3f}, "
                  f"HF Trainer {theirs[0]:.3f}/{theirs[1]:.3f}; ratio HF/mlsm "
                  f"{wall[-1]:.2f} wall, {cpu[-1]:.2f} CPU")
    print(f"median ratio HF/mlsm per step: {statistics.median(wall):.2f} wall, "
          f"{statistics.median(cpu):.2f} CPU time (>= 1: mlsm at least as fast); load average "
          f"{os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
