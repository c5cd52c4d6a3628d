"""Where the time of one training step goes, per objective: MLM, MLSM (online teacher), KD.

Setup as benchmarks/bench_step_time.py: a 6-layer / d = 384 student with the MiniLM vocabulary,
batch 32 × 128, the packaged all-MiniLM-L6-v2 as MLSM teacher (layer 5, k = 1536 atoms learned on
a small sample). KD needs a teacher with a vocabulary head, which the packaged MiniLM lacks: the
KD teacher is MiniLM's encoder with an untrained BERT MLM head on top (the step time does not
depend on the head's values, only on its shape).

Phases are timed with wall-clock timers around the code that runs them (CPU ops are synchronous):
teacher forward (MLSM: `TargetCoder.teacher.hidden_states`, KD: `MLMTeacher.logits`), sparse
coding (`sparse_encode`), the rest of the objective's forward (student forward + heads + loss),
backward, and AdamW step + zero_grad. Reported: the FRACTION of the step each phase takes, the
median over rounds (fractions are robust to a loaded machine; absolute times are not), plus the
machine's load average.

Usage: python benchmarks/bench_breakdown.py [--rounds 2] [--batch 32] [--seq 128] [--threads 2]
Skips (exit 0) when the corpus or the packaged teacher is absent.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from common import prefix_store, step_bench_args

PHASES = ("student forward", "teacher forward", "sparse coding", "backward", "optimizer")


def _store_and_dictionary(tmp: Path, args: argparse.Namespace):
    from mlsm.data.corpus import TokenStore
    from mlsm.teacher.dictionary import learn_dictionary
    from mlsm.teacher.teacher import load_teacher

    store = prefix_store(tmp, 6 * args.seq * args.batch * (args.rounds + 1))
    learn_dictionary(TokenStore.open(store.path), load_teacher(None, 5), k=1536, lam=0.05,
                     n_vectors=args.dict_vectors, max_len=args.seq, out=tmp / "dict")
    return store


def _kd_teacher(tmp: Path) -> Path:
    """MiniLM's encoder under a BERT MLM head (untrained head: same shape, same cost)."""
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    from mlsm.teacher.teacher import default_teacher_path

    path = default_teacher_path()
    torch.manual_seed(0)
    model = AutoModelForMaskedLM.from_pretrained(path)
    model.save_pretrained(tmp / "kd_teacher")
    AutoTokenizer.from_pretrained(path).save_pretrained(tmp / "kd_teacher")
    return tmp / "kd_teacher"


def _timed(obj: object, attr: str, clock: dict[str, float], phase: str) -> None:
    """Replace obj.attr by a wrapper that adds its wall time to clock[phase]."""
    inner = getattr(obj, attr)

    def wrapper(*a, **kw):
        start = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            clock[phase] += time.perf_counter() - start

    setattr(obj, attr, wrapper)


def _runners(store, tmp: Path, args: argparse.Namespace, clock: dict[str, float]) -> dict:
    import mlsm.objectives.mlsm as mlsm_module
    from mlsm.config import ModelConfig
    from mlsm.models.backbone import build_student
    from mlsm.objectives import Context, TrainModule, build_objective
    from mlsm.teacher.teacher import default_teacher_path

    tok = store.load_tokenizer()
    ctx = Context(tok, torch.device("cpu"), 100, str(store.path), args.seq)
    specs = {
        "MLM": {"name": "mlm"},
        "MLSM online": {"name": "mlsm", "dictionary": str(tmp / "dict.safetensors"),
                        "teacher": str(default_teacher_path()), "layer": 5},
        "KD": {"name": "kd", "teacher": str(_kd_teacher(tmp))},
    }
    shape = {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12,
             "intermediate_size": 1536}
    out = {}
    for name, spec in specs.items():
        objective = build_objective(spec, ctx)
        if name == "MLSM online":
            _timed(objective.coder.teacher, "hidden_states", clock, "teacher forward")
        if name == "KD":
            _timed(objective.teacher, "logits", clock, "teacher forward")
        student = build_student(ModelConfig(arch="bert", overrides=shape), tok, args.seq, seed=0)
        objective.attach(student)
        module = TrainModule(student, objective).train()  # what the loop steps: student + heads
        out[name] = (module, torch.optim.AdamW(module.parameters(), lr=1e-4))
    _timed(mlsm_module, "sparse_encode", clock, "sparse coding")  # looked up at call time
    return out


def _step(module, optimizer, batch, clock: dict[str, float]) -> dict[str, float]:
    """One step; seconds per phase (student forward = objective forward − teacher − coding)."""
    clock.clear()
    t0 = time.perf_counter()
    out = module(batch)  # batch -> targets -> student -> loss, as in the loop
    t1 = time.perf_counter()
    (out.loss_sum / out.n_targets.clamp(min=1)).backward()
    t2 = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    t3 = time.perf_counter()
    teacher, coding = clock["teacher forward"], clock["sparse coding"]
    return {"student forward": t1 - t0 - teacher - coding, "teacher forward": teacher,
            "sparse coding": coding, "backward": t2 - t1, "optimizer": t3 - t2}


def main() -> int:
    args = step_bench_args(__doc__, rounds=2, dict_vectors=4096)
    if args is None:
        return 0
    from mlsm.config import DataConfig
    from mlsm.data.batches import BatchSource

    clock: dict[str, float] = defaultdict(float)
    rows: dict[str, list[dict[str, float]]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        store = _store_and_dictionary(tmp, args)
        runners = _runners(store, tmp, args, clock)
        source = BatchSource(store, DataConfig(store=str(store.path), max_len=args.seq),
                             store.load_tokenizer())
        for r in range(args.rounds + 1):  # round 0 = warm-up, not recorded
            batch = source.batch(np.arange(r * args.batch, (r + 1) * args.batch), r)
            for n, (module, optimizer) in runners.items():
                phases = _step(module, optimizer, batch, clock)
                if r:
                    rows[n].append(phases)
                print(f"round {r} {n:12s} {sum(phases.values()):7.2f} s", flush=True)
    _report(rows, args)
    return 0


def _report(rows: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> None:
    load = os.getloadavg()
    print(f"\nbatch {args.batch} x {args.seq}, {args.rounds} rounds, torch threads {args.threads}, "
          f"{os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print("| Objective | step (s, median) | " + " | ".join(PHASES) + " |")
    print("|---|---:|" + "---:|" * len(PHASES))
    for name, steps in rows.items():
        total = statistics.median(sum(p.values()) for p in steps)
        shares = [statistics.median(p[ph] / sum(p.values()) for p in steps) for ph in PHASES]
        cells = " | ".join(f"{100 * s:.0f} %" if s > 0.0005 else "–" for s in shares)
        print(f"| {name} | {total:.2f} | {cells} |")


if __name__ == "__main__":
    sys.exit(main())
