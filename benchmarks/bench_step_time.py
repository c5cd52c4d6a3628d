"""Training step time: MLM vs MLSM (online teacher) vs MLSM (target store) vs naive MLSM.

One process, one student shape (6 layers, d = 384 — MiniLM's shape — with the MiniLM vocabulary),
one batch size; the packaged all-MiniLM-L6-v2 is the teacher (layer 5), k = 1536 atoms learned
quickly on a small sample. The objectives take turns (interleaved rounds), so load changes on a
shared machine hit them alike; each round uses a new step's batch. Reported: median seconds per
optimizer step (forward + backward + AdamW) and the ratios the issue asks for:

    MLSM online ≤ 1.35 × MLM,   MLSM store ≤ 1.10 × MLM,   naive ≥ 1.5 × MLSM (both kinds).

Usage: python benchmarks/bench_step_time.py [--batch 32] [--seq 128] [--rounds 3] [--threads 2]
Skips (exit 0) when the corpus below or the packaged teacher is absent.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from common import prefix_store, step_bench_args


def _setup(tmp: Path, args: argparse.Namespace):
    """Token store (MiniLM tokenizer), dictionary (k=1536, layer 5) and target store in tmp."""
    from mlsm.data.corpus import TokenStore
    from mlsm.teacher.dictionary import learn_dictionary
    from mlsm.teacher.targets import build_target_store
    from mlsm.teacher.teacher import default_teacher_path, load_teacher

    teacher_path = default_teacher_path()
    store = prefix_store(tmp, 6 * args.seq * args.batch * (args.rounds + 1))
    teacher = load_teacher(None, 5)
    t0 = time.perf_counter()
    dictionary = learn_dictionary(TokenStore.open(store.path), teacher, k=1536, lam=0.05,
                                  n_vectors=args.dict_vectors, max_len=args.seq, out=tmp / "dict")
    print(f"dictionary: k=1536 on {args.dict_vectors} vectors in {time.perf_counter() - t0:.0f} s")
    t0 = time.perf_counter()
    build_target_store(store.path, dictionary, teacher, args.seq, tmp / "targets")  # whole codes
    n_chunks = json.loads((tmp / "targets" / "meta.json").read_text())["n_chunks"]
    print(f"target store: {n_chunks} chunks in {time.perf_counter() - t0:.0f} s")
    return store, teacher_path


def _runners(store, teacher_path: Path, tmp: Path, args: argparse.Namespace) -> dict:
    """name -> (objective, TrainModule, optimizer); identical students (same seed) per objective."""
    from mlsm.config import ModelConfig
    from mlsm.models.backbone import build_student
    from mlsm.objectives import Context, TrainModule, build_objective

    tok = store.load_tokenizer()
    ctx = Context(tok, torch.device("cpu"), 100, str(store.path), args.seq)
    mlsm = {"dictionary": str(tmp / "dict.safetensors"), "teacher": str(teacher_path), "layer": 5}
    specs = {
        "MLM": {"name": "mlm"},
        "MLSM online": {"name": "mlsm", **mlsm},
        "MLSM store": {"name": "mlsm", "targets": str(tmp / "targets")},
        "MLSM naive": {"name": "mlsm_naive", **mlsm},
    }
    shape = {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12,
             "intermediate_size": 1536}
    out = {}
    for name, spec in specs.items():
        objective = build_objective(spec, ctx)
        student = build_student(ModelConfig(arch="bert", overrides=shape), tok, args.seq, seed=0)
        objective.attach(student)
        module = TrainModule(student, objective).train()
        out[name] = (objective, module, torch.optim.AdamW(module.parameters(), lr=1e-4))
    return out


def _step(objective, module, optimizer, batch) -> float:
    start = time.perf_counter()
    out = module(batch)  # TrainModule: targets -> student -> loss
    (out.loss_sum / out.n_targets.clamp(min=1)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> int:
    args = step_bench_args(__doc__, rounds=3, dict_vectors=8192)
    if args is None:
        return 0
    from mlsm.config import DataConfig
    from mlsm.data.batches import BatchSource

    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        store, teacher_path = _setup(tmp, args)
        runners = _runners(store, teacher_path, tmp, args)
        source = BatchSource(store, DataConfig(store=str(store.path), max_len=args.seq),
                             store.load_tokenizer())
        batches = [source.batch(np.arange(s * args.batch, (s + 1) * args.batch), s)
                   for s in range(args.rounds + 1)]
        times: dict[str, list[float]] = {n: [] for n in runners}
        for r, batch in enumerate(batches):  # round 0 = warm-up, not recorded
            for n, (objective, student, optimizer) in runners.items():
                t = _step(objective, student, optimizer, batch)
                if r:
                    times[n].append(t)
                print(f"round {r} {n:12s} {t:7.2f} s", flush=True)
    med = {n: statistics.median(v) for n, v in times.items()}
    _report(med, times, args)
    return 0


def _report(med: dict[str, float], times: dict[str, list[float]], args: argparse.Namespace) -> None:
    load = os.getloadavg()
    print(f"\nbatch {args.batch} x {args.seq}, {args.rounds} rounds, torch threads {args.threads}, "
          f"{os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print("| Objective | median s/step | all rounds (s) | × MLM |")
    print("|---|---:|---|---:|")
    for n, m in med.items():
        rounds = ", ".join(f"{t:.2f}" for t in times[n])
        print(f"| {n} | {m:.2f} | {rounds} | {m / med['MLM']:.2f} |")
    checks = [
        ("MLSM online / MLM", med["MLSM online"] / med["MLM"], "≤ 1.35"),
        ("MLSM store / MLM", med["MLSM store"] / med["MLM"], "≤ 1.10"),
        ("naive / MLSM online", med["MLSM naive"] / med["MLSM online"], "≥ 1.5"),
        ("naive / MLSM store", med["MLSM naive"] / med["MLSM store"], "≥ 1.5"),
    ]
    for label, value, goal in checks:
        print(f"{label}: {value:.2f} (goal {goal})")
    # On a shared machine the paired (same-round) ratios are steadier than ratios of medians.
    for a, b in (("MLSM online", "MLM"), ("MLSM store", "MLM"), ("MLSM naive", "MLSM online"),
                 ("MLSM naive", "MLSM store")):
        paired = [x / y for x, y in zip(times[a], times[b], strict=True)]
        rounds = ", ".join(f"{r:.2f}" for r in paired)
        print(f"paired {a} / {b}: median {statistics.median(paired):.2f} (rounds: {rounds})")


if __name__ == "__main__":
    sys.exit(main())
