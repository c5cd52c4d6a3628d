"""Where a CPU training step's time goes under fp32 and under bf16 autocast, per kind of op.

The anchor is issue #50's measurement on an Intel Xeon with AMX (not re-measured here): the BERT
encoder alone (HF BertModel, forward + backward) ran 1.95x faster under bf16 autocast than in
fp32, yet the whole mlsm MLM step only 1.32x. This script measures, in one run on the same machine:

1. the whole MLM step (mlsm's objective, model and AdamW, as `mlsm pretrain` runs it) in fp32 and
   in bf16, interleaved rounds, paired ratio fp32 / bf16;
2. the encoder alone (the same student's encoder, forward + backward of a sum of its output),
   fp32 / bf16 — the ceiling a whole step could reach;
3. one profiled step of each precision: self CPU time summed per kind of op (matrix products,
   casts, embedding and its gradient, normalisation/softmax, the optimizer, other elementwise), so
   the share of the step outside the matmuls is a measured number, not a guess;
4. the machine's fp32 and bf16 GEMM peaks (common.measured_peaks), so each step's MFU is printed
   against the peak of its own precision.

With --compile the student's encoder is compiled as `train.compile=true` does (round 0, the
warm-up, pays the compilation of each precision); run it beside a run without to compare.

Usage: python benchmarks/bench_precision.py [--rounds 3] [--batch 32] [--seq 128] [--threads 2]
       [--layers 6 --width 384] [--compile]
Skips (exit 0) when the corpus or the packaged teacher (its tokenizer) is absent.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from common import measured_peaks, prefix_store, skip_reason

# First matching substring wins; names are torch's aten op names (profiler "self" time).
KINDS = (
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "mkldnn", "onednn")),
    ("optimizer", ("optimizer", "_foreach", "adam")),
    ("cast", ("aten::to", "aten::_to_copy", "aten::copy_", "aten::_copy")),
    ("embedding", ("embedding", "index_select", "index_add", "index_put", "scatter", "gather")),
    ("norm/softmax", ("layer_norm", "softmax", "log_softmax", "gelu", "dropout", "nll_loss")),
)


def _kind(name: str) -> str:
    low = name.lower()
    for kind, needles in KINDS:
        if any(n in low for n in needles):
            return kind
    return "other"


def _setup(tmp: Path, args: argparse.Namespace):
    """A token store of enough enwiki text for the rounds, and the batches of each round."""
    from mlsm.config import DataConfig
    from mlsm.data.batches import BatchSource

    store = prefix_store(tmp, 6 * args.seq * args.batch * (args.rounds + 2))
    source = BatchSource(store, DataConfig(store=str(store.path), max_len=args.seq),
                         store.load_tokenizer())
    batches = [source.batch(np.arange(s * args.batch, (s + 1) * args.batch), s)
               for s in range(args.rounds + 1)]
    return store, batches


def _runner(store, args: argparse.Namespace):
    """(TrainModule, AdamW) of an MLM student, as `mlsm pretrain` builds them (seed 0; AdamW's
    kernel as `mlsm pretrain` picks it on a CPU)."""
    from mlsm.config import ModelConfig
    from mlsm.models.backbone import build_student
    from mlsm.objectives import Context, TrainModule, build_objective
    from mlsm.train import device as dev

    tok = store.load_tokenizer()
    ctx = Context(tok, torch.device("cpu"), 100, str(store.path), args.seq)
    objective = build_objective({"name": "mlm"}, ctx)
    shape = {"hidden_size": args.width, "num_hidden_layers": args.layers,
             "num_attention_heads": args.width // 32, "intermediate_size": 4 * args.width}
    student = build_student(ModelConfig(arch="bert", overrides=shape), tok, args.seq, seed=0)
    objective.attach(student)
    module = TrainModule(student, objective).train()
    if args.compile:
        dev.compile_student(module)  # as train.compile=true: the encoder, in place
    return module, torch.optim.AdamW(module.parameters(), lr=1e-4,
                                     **dev.adamw_options(torch.device("cpu")))


def _autocast(precision: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _step(module, optimizer, batch, precision: str) -> float:
    start = time.perf_counter()
    with _autocast(precision):
        out = module(batch)
    (out.loss_sum / out.n_targets.clamp(min=1)).float().backward()
    with torch.profiler.record_function("optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def _encoder_step(module, batch, precision: str) -> float:
    """Forward + backward of the student's encoder alone (no head, no loss, no optimizer)."""
    start = time.perf_counter()
    with _autocast(precision):
        hidden = module.student(batch.corrupted_ids, batch.attention_mask)  # (B, T, d)
    hidden.float().sum().backward()
    module.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def _profile(module, optimizer, batch, precision: str) -> dict[str, float]:
    """Self CPU seconds per kind of op over one step; the optimizer step is profiled on its own
    (AdamW on CPU runs per-tensor elementwise ops that would otherwise read as "other")."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with _autocast(precision):
            out = module(batch)
        (out.loss_sum / out.n_targets.clamp(min=1)).float().backward()
    shares: dict[str, float] = defaultdict(float)
    others = []
    for event in prof.key_averages():
        shares[_kind(event.key)] += event.self_cpu_time_total / 1e6
        if _kind(event.key) == "other":
            others.append((event.self_cpu_time_total / 1e6, event.key))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    shares["optimizer"] = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e6
    top = ", ".join(f"{name} {t:.2f} s" for t, name in sorted(others, reverse=True)[:6])
    print(f"{precision}: largest ops of kind 'other': {top}")
    return dict(shares)


def _optimizer_variants(module, batch) -> dict[str, float]:
    """Median seconds of one AdamW step over the same gradients: torch's CPU default (a loop
    over tensors), foreach, and the fused CPU kernel (torch >= 2.4)."""
    (lambda o: (o.loss_sum / o.n_targets.clamp(min=1)).backward())(module(batch))
    params = [p for p in module.parameters() if p.grad is not None]
    out = {}
    for name, kw in (("default", {}), ("foreach", {"foreach": True}), ("fused", {"fused": True})):
        opt = torch.optim.AdamW(params, lr=1e-4, **kw)
        times = []
        for _ in range(4):
            start = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times[1:])
    module.zero_grad(set_to_none=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the encoder, as train.compile=true (round 0 compiles)")
    args = ap.parse_args()
    reason = skip_reason()
    if reason:
        print(f"skipped: {reason}")
        return 0
    torch.set_num_threads(args.threads)
    peaks = measured_peaks()
    with tempfile.TemporaryDirectory() as name:
        store, batches = _setup(Path(name), args)
        module, optimizer = _runner(store, args)
        whole: dict[str, list[float]] = {"fp32": [], "bf16": []}
        enc: dict[str, list[float]] = {"fp32": [], "bf16": []}
        for r, batch in enumerate(batches):  # round 0 warms both precisions up
            for precision in ("fp32", "bf16"):
                t = _step(module, optimizer, batch, precision)
                e = _encoder_step(module, batch, precision)
                if r:
                    whole[precision].append(t)
                    enc[precision].append(e)
                print(f"round {r} {precision}: step {t:.2f} s, encoder fwd+bwd {e:.2f} s",
                      flush=True)
        profiles = {p: _profile(module, optimizer, batches[-1], p) for p in ("fp32", "bf16")}
        flops = _step_flops(module, args)
        adamw = _optimizer_variants(module, batches[-1])
    print("AdamW step alone, median s: " + ", ".join(f"{k} {v:.3f}" for k, v in adamw.items()))
    _report(whole, enc, profiles, peaks, flops, args)
    return 0


def _step_flops(module, args: argparse.Namespace) -> float:
    """Training FLOPs of one MLM step, mlsm's own count (mlsm.train.flops, heads at the selected
    positions), as `mlsm pretrain` and bench_mlm_throughput.py count it."""
    from mlsm.run_config import config_from_dict
    from mlsm.train.flops import flops_for_run

    cfg = config_from_dict({"objective": {"name": "mlm"}, "data": {"max_len": args.seq},
                            "train": {"batch_size": args.batch}})
    rows = flops_for_run(cfg, vocab_size=module.student.config.vocab_size,
                         student_config=module.student.config)
    return float(next(r for r in rows if r.objective == "MLM").total)


def _paired(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def _report(whole, enc, profiles, peaks, flops, args) -> None:
    load = os.getloadavg()
    print(f"\nMLM, BERT {args.layers} x {args.width}, batch {args.batch} x {args.seq}, "
          f"{args.threads} threads, {os.cpu_count()} CPUs, load average {load[0]:.2f}, "
          f"{'compiled' if args.compile else 'eager'} encoder")
    print(f"measured GEMM peaks: fp32 {peaks['fp32'] / 1e9:.0f} GFLOP/s, "
          f"bf16 {peaks['bf16'] / 1e9:.0f} GFLOP/s")
    for p in ("fp32", "bf16"):
        m = statistics.median(whole[p])
        print(f"whole step {p}: median {m:.2f} s, {flops / m / 1e9:.0f} GFLOP/s, "
              f"MFU {flops / m / peaks[p]:.1%} of the {p} peak")
    up_step, up_enc = _paired(whole["fp32"], whole["bf16"]), _paired(enc["fp32"], enc["bf16"])
    print(f"speed-up bf16 vs fp32, whole step (paired rounds): {up_step:.2f}x (goal >= 2x)")
    print(f"speed-up bf16 vs fp32, encoder alone (paired rounds): {up_enc:.2f}x")
    kinds = sorted({k for p in profiles.values() for k in p},
                   key=lambda k: -profiles["fp32"].get(k, 0))
    print("\n| op kind | fp32 s | fp32 share | bf16 s | bf16 share |")
    print("|---|---:|---:|---:|---:|")
    tot = {p: sum(profiles[p].values()) for p in profiles}
    for k in kinds:
        f, b = profiles["fp32"].get(k, 0.0), profiles["bf16"].get(k, 0.0)
        print(f"| {k} | {f:.2f} | {f / tot['fp32']:.0%} | {b:.2f} | {b / tot['bf16']:.0%} |")
    print(f"| total (profiled, self CPU) | {tot['fp32']:.2f} | | {tot['bf16']:.2f} | |")


if __name__ == "__main__":
    sys.exit(main())
