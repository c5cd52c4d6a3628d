"""Tokens/s of mlsm's MLM training step vs the HF-standard recipe, same model, data and CPU.

Anchor (what run_mlm.py does): BertForMaskedLM computing full-vocabulary logits at every position,
batches from DataCollatorForLanguageModeling (15 % masking, 80/10/10) over grouped texts, AdamW.
Ours: the same BERT, `mlsm` batches (masking precomputed by counter-based hashing), the vocabulary
head evaluated at the selected positions only, the same AdamW, loss normalised the loop's way.
Both run for the same number of steps in interleaved rounds; the ratio of medians is printed.

    python benchmarks/bench_mlm_throughput.py [--layers 6 --hidden 384 --batch 32 --rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
from common import CORPUS, corpus_store, measured_peaks
from transformers import BertConfig, BertForMaskedLM, DataCollatorForLanguageModeling

from mlsm.config import DataConfig
from mlsm.data.batches import BatchSource
from mlsm.models.backbone import Student
from mlsm.objectives import Context, TrainModule, build_objective


def make_model(args: argparse.Namespace, vocab: int) -> BertForMaskedLM:
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                     num_attention_heads=args.hidden // 64, intermediate_size=4 * args.hidden,
                     max_position_embeddings=512)
    return BertForMaskedLM(cfg)


def time_ours(model: BertForMaskedLM, source: BatchSource, tok, args, start: int) -> float:
    student = Student(model)
    objective = build_objective({"name": "mlm"}, Context(tok, torch.device("cpu"), 1))
    objective.attach(student)
    module = TrainModule(student, objective).train()
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4)
    t = time.perf_counter()
    for step in range(start, start + args.steps):
        batch = source.batch(np.arange(step * args.batch, (step + 1) * args.batch), step)
        out = module(batch)
        (out.loss_sum / out.n_targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return args.steps * args.batch * args.seq / (time.perf_counter() - t)


def time_hf(model: BertForMaskedLM, source: BatchSource, tok, args, start: int) -> float:
    collator = DataCollatorForLanguageModeling(tok, mlm_probability=0.15, return_tensors="pt")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    t = time.perf_counter()
    for step in range(start, start + args.steps):
        # grouped texts: the same packed sequences, handed over as run_mlm's dataset rows
        samples = np.arange(step * args.batch, (step + 1) * args.batch)
        ids = source.chunk_tokens(source.chunk_ids(samples))
        batch = collator([{"input_ids": row.tolist()} for row in ids])
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return args.steps * args.batch * args.seq / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4, help="steps per timed round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if not CORPUS.is_file():
        sys.exit(f"skipped: {CORPUS} not found")
    torch.set_num_threads(args.threads)
    peaks = measured_peaks()  # in the same run as the rates they divide
    with tempfile.TemporaryDirectory() as tmp:
        store, tok = corpus_store(tmp)
        source = BatchSource(store, DataConfig(store=str(store.path), max_len=args.seq), tok)
        ours_model, hf_model = make_model(args, len(tok)), make_model(args, len(tok))
        # warm-up
        time_ours(ours_model, source, tok, argparse.Namespace(**{**vars(args), "steps": 1}), 0)
        time_hf(hf_model, source, tok, argparse.Namespace(**{**vars(args), "steps": 1}), 0)
        ours, hf = [], []
        for r in range(args.rounds):  # interleaved, so drifts in machine load hit both
            ours.append(time_ours(ours_model, source, tok, args, 1 + r * args.steps))
            hf.append(time_hf(hf_model, source, tok, args, 1 + r * args.steps))
            print(f"round {r}: ours {ours[-1]:,.0f} tok/s   HF {hf[-1]:,.0f} tok/s", flush=True)
    mo, mh = statistics.median(ours), statistics.median(hf)
    print(f"model: BERT {args.layers} layers, d={args.hidden}, |V|={len(tok)}, "
          f"batch {args.batch} x {args.seq}, "
          f"{args.threads} threads, torch {torch.__version__}")
    print(f"median tokens/s: ours {mo:,.0f}  HF run_mlm-style {mh:,.0f}  "
          f"ratio {mo / mh:.2f}x (goal >= 1.5x)")
    per_token = mlm_flops_per_token(args, ours_model.config)
    print(f"ours: {mo * per_token / 1e9:,.0f} GFLOP/s = {mo * per_token / peaks['fp32']:.0%} of "
          f"the measured fp32 peak (MFU; mlsm's FLOP count of the step, heads at the selected "
          f"positions)")


def mlm_flops_per_token(args: argparse.Namespace, bert: BertConfig) -> float:
    """Training FLOPs per token of mlsm's MLM step on this model (mlsm.train.flops, "mlsm"
    accounting)."""
    from mlsm.run_config import config_from_dict
    from mlsm.train.flops import flops_for_run

    cfg = config_from_dict({"objective": {"name": "mlm"}, "data": {"max_len": args.seq},
                            "train": {"batch_size": args.batch}})
    rows = flops_for_run(cfg, vocab_size=bert.vocab_size, student_config=bert)
    return next(r for r in rows if r.objective == "MLM").total / (args.batch * args.seq)


if __name__ == "__main__":
    main()
