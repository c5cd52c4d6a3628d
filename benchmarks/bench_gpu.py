"""GPU benchmark: MLM, MLSM (online teacher and target store) and KD through `mlsm pretrain`.

On a CUDA machine it runs each objective at the Hitchhikers' Guide's student shape
(configs/hitchhiker/*.yaml: DeBERTa-base v1, 12 x 768, ~8.3M parameters per layer), micro-batch
128 x 128, bf16 autocast, with a randomly initialised bert-base-shaped teacher cut at layer 10 and
a k = 3072 dictionary fitted quickly on its states (the GPU machine reaches no hub; FLOPs and
kernel shapes are those of the trained models, the codes' sparsity is not). It prints seconds per
step, tokens/s, achieved FLOP/s and MFU against the device's peak (`mlsm.train.throughput`), and the
MLSM/MLM step-time ratio beside the analytic one (the Hitchhikers' Guide's Table 3 predicts
102.7 % of MLM's FLOPs for MLSM_10).

Before the timed runs it counts one training step on the GPU proxy (torch.profiler on CPU
tensors: every top-level aten operator that is not a view is a kernel launch on a GPU;
`_local_scalar_dense`, `nonzero`, ... are device->host syncs): operators and host syncs of one
step (`mlsm.train.loop._train_step` + optimizer step) and, separately, of one metrics log line.

On a CPU (or with --tiny) the same code runs at a tiny shape in seconds: CI's smoke test.

    python benchmarks/bench_gpu.py [--tiny] [--steps 10] [--warmup 3] [--compile]
        [--objectives mlm mlsm mlsm_store kd] [--precision bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# the leaf operators that wait for a device value (`.item()`, `bool(t)` and `int(t)` end in
# `_local_scalar_dense`; boolean-mask indexing in `nonzero`), as in bench_gpu_proxy.py
SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique2")
VIEW_OPS = ("aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::view",
            "aten::reshape", "aten::expand", "aten::as_strided", "aten::t", "aten::transpose",
            "aten::permute", "aten::alias", "aten::detach", "aten::_unsafe_view", "aten::to",
            "aten::lift_fresh", "aten::split", "aten::narrow", "aten::mT", "aten::empty",
            "aten::_reshape_alias", "aten::contiguous", "aten::view_as", "aten::chunk")
TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
        "intermediate_size": 64}
BERT_BASE = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
             "intermediate_size": 3072}


def _setup(tmp: Path, tiny: bool, n_tokens: int, seq: int, device: str) -> dict[str, str]:
    """Token store, a random teacher (folder), its dictionary and target store; their paths."""
    from transformers import BertConfig, BertForMaskedLM

    from mlsm.data.corpus import TokenStore, prepare_corpus
    from mlsm.data.tokenizer import train_tokenizer
    from mlsm.teacher.dictionary import learn_dictionary
    from mlsm.teacher.targets import build_target_store
    from mlsm.teacher.teacher import load_teacher

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
             for _ in range(200 if tiny else 20000)]
    (tmp / "text").mkdir()
    n_words = int(n_tokens * 0.8) + 1000
    docs = [" ".join(rng.choice(words) for _ in range(200)) + "." for _ in range(n_words // 200)]
    (tmp / "text" / "docs.txt").write_text("\n\n".join(docs) + "\n")
    tok = train_tokenizer(str(tmp / "text"), tmp / "tok", vocab_size=200 if tiny else 28996)
    store = prepare_corpus(str(tmp / "text"), str(tmp / "tok"), tmp / "store")
    shape = TINY if tiny else BERT_BASE
    teacher_cfg = BertConfig(vocab_size=len(tok), max_position_embeddings=512, **shape)
    torch.manual_seed(0)
    BertForMaskedLM(teacher_cfg).save_pretrained(tmp / "teacher")
    tok.save_pretrained(tmp / "teacher")
    layer = 1 if tiny else 10
    teacher = load_teacher(str(tmp / "teacher"), layer, device=device)
    k = 64 if tiny else 3072
    t0 = time.perf_counter()
    learn_dictionary(TokenStore.open(store.path), teacher, k=k, n_vectors=2 * k, max_len=seq,
                     n_iter=2, eval_vectors=k, out=tmp / "dict")
    build_target_store(store.path, tmp / "dict.safetensors", teacher, seq, tmp / "targets")
    print(f"setup: teacher layer {layer}, k = {k}, dictionary + target store in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    return {"store": str(store.path), "teacher": str(tmp / "teacher"), "layer": str(layer),
            "dictionary": str(tmp / "dict.safetensors"), "targets": str(tmp / "targets")}


def _objective(name: str, paths: dict[str, str]) -> dict[str, object]:
    return {"mlm": {"name": "mlm"},
            "mlsm": {"name": "mlsm", "teacher": paths["teacher"], "layer": int(paths["layer"]),
                     "dictionary": paths["dictionary"]},
            # the dictionary too: the FLOPs count takes k from it (not from the store's meta)
            "mlsm_store": {"name": "mlsm", "targets": paths["targets"],
                           "dictionary": paths["dictionary"]},
            "kd": {"name": "kd", "teacher": paths["teacher"]}}[name]


def _config(name: str, paths: dict[str, str], out: Path, a: argparse.Namespace):
    """The run config: configs/hitchhiker/<objective>.yaml's student and optimiser, this shape."""
    import yaml

    from mlsm.run_config import config_from_dict

    base = yaml.safe_load((ROOT / "configs/hitchhiker/mlm.yaml").read_text())
    base["objective"] = _objective(name, paths)
    if a.tiny:
        base["model"]["overrides"].update(TINY)
    base["data"].update(store=paths["store"], max_len=a.seq)
    base["train"].update(steps=a.warmup + a.steps, batch_size=a.batch, micro_batch_size=a.batch,
                         precision=a.precision, out=str(out), log_every=a.warmup,
                         readiness=[1.0], device=a.device, compile=a.compile)
    base["optim"]["warmup"] = 0.0
    return config_from_dict(base)


def _timed(cfg, warmup: int) -> dict[str, float]:
    """Run `pretrain`; time the steps after `warmup` from its metrics lines (each line times the
    steps since the line before it, `train.log_every` = warmup)."""
    from mlsm.train.loop import pretrain

    run = pretrain(cfg)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    tokens_per_step = cfg.train.batch_size * cfg.data.max_len
    steps = seconds = 0.0
    for prev, row in zip(rows, rows[1:], strict=False):
        if prev["step"] >= warmup:
            window = row["step"] - prev["step"]
            steps += window
            seconds += window * tokens_per_step / row["tokens_per_s"]
    last = rows[-1]
    flops_step = last.get("flops_per_step", 0.0)
    flops_s = flops_step * steps / seconds
    peak = last["flops_per_s"] / last["mfu"] if last.get("mfu") else None  # of all devices
    return {"s_step": seconds / steps, "tok_s": tokens_per_step * steps / seconds,
            "flops_step": flops_step, "flops_s": flops_s,
            "mfu": flops_s / peak if peak else float("nan")}


def count_step(cfg, fused: bool = True) -> dict[str, int]:
    """Kernel launches and host syncs (profiler events on CPU tensors) of one training step as
    `pretrain` runs it on CUDA (fused AdamW; fused=False: the for-each AdamW used before), and
    of one metrics log line, after a warm-up step."""
    from mlsm.data.batches import BatchSource
    from mlsm.data.corpus import TokenStore
    from mlsm.models.backbone import build_student
    from mlsm.objectives import Context, TrainModule, build_objective
    from mlsm.train import device as dev
    from mlsm.train import loop
    from mlsm.train.distributed import DistInfo

    device = torch.device("cpu")  # the proxy: what a GPU would launch, counted on the host
    store = TokenStore.open(cfg.data.store)
    tok = store.load_tokenizer()
    ctx = Context(tok, device, cfg.train.steps, str(store.path), cfg.data.max_len, store=store)
    objective = build_objective(cfg.objective, ctx)
    student = build_student(cfg.model, tok, cfg.data.max_len, cfg.train.seed)
    objective.attach(student)
    module = TrainModule(student, objective).train()
    opt = loop._optimizer(module, cfg, torch.device("cuda"))
    for group in opt.param_groups if not fused else []:  # the for-each kernel, as before
        group.update(fused=False, foreach=True)
    scaler = dev.grad_scaler(cfg.train.precision, device)
    info = DistInfo(rank=0, world=1, local_rank=0)
    autocast = dev.autocast_for(cfg.train.precision, device)
    source = BatchSource(store, cfg.data, tok)

    def step(i: int):
        batches = source.micro_batches(i, cfg.train.batch_size, cfg.train.batch_size, 0, 1)
        out = loop._train_step(module, batches, autocast, device, info, cfg.optim.clip,
                               (scaler, opt))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return out

    import mlsm.teacher.sparse_coding as sc
    from mlsm.teacher.active_set_fixed import active_set_fixed

    cpu_solver = sc.active_set  # the lock-step solver CUDA runs (bench_gpu_proxy.py's "after")
    sc.active_set = lambda c, Gp, lam, tol, max_steps, warm=None: active_set_fixed(
        c, Gp, lam, tol, warm=warm)
    try:
        return _count(step)
    finally:
        sc.active_set = cpu_solver


def _count(step) -> dict[str, int]:
    """Profile step(1) and the log line after a warm-up step(0)."""
    from mlsm.train import loop

    step(0)
    counts = {}
    for part in ("step", "log"):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            if part == "step":
                loss, norm, totals = step(1)
            else:
                with tempfile.TemporaryDirectory() as tmp:
                    loop._log(Path(tmp), 2, loss, 0.0, norm, 0.0, totals, 1)
        events = [e for e in prof.events() if e.name.startswith("aten::")]
        top = [e.name for e in events
               if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
        # CPU's fused AdamW reads each parameter's step counter on the host (49 `item`s for the
        # tiny student); CUDA's fused kernel reads them on the device: not a sync there.
        syncs = [e for e in events if e.name in SYNC_OPS and not _under(e, "aten::_fused_adamw_")]
        counts[f"{part}_kernels"] = sum(1 for t in top if t not in VIEW_OPS)
        counts[f"{part}_syncs"] = len(syncs)
        if os.environ.get("BENCH_GPU_SYNCS"):  # where the syncs come from
            print(part, Counter((e.name, e.cpu_parent.name if e.cpu_parent else "")
                                for e in syncs))
    return counts


def _under(event, name: str) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == name:
            return True
        parent = parent.cpu_parent
    return False


def main() -> None:
    from mlsm.provenance import machine_description

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shape (implied without CUDA)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per objective")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile etc.)")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--compile", action="store_true", help="train.compile=true")
    ap.add_argument("--objectives", nargs="+", default=["mlm", "mlsm", "mlsm_store", "kd"],
                    choices=["mlm", "mlsm", "mlsm_store", "kd"])
    a = ap.parse_args()
    a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.device == "cpu" and not a.tiny:
        print("no CUDA device: running the tiny smoke test (--tiny)")
        a.tiny = True
    if a.tiny:
        a.steps, a.warmup, a.batch, a.seq = min(a.steps, 2), min(a.warmup, 1), 8, 32
    print(f"machine: {machine_description()}")
    print(f"device: {a.device}; shape: {'tiny' if a.tiny else 'Hitchhikers Guide student'}; "
          f"batch {a.batch} x {a.seq}; {a.precision}; compile={a.compile}; "
          f"{a.warmup} warm-up + {a.steps} timed steps", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        n_tokens = (a.warmup + a.steps + 4) * a.batch * a.seq * 2
        paths = _setup(Path(tmp), a.tiny, n_tokens, a.seq, a.device)
        print("| objective | s/step | tokens/s | FLOPs/step | FLOP/s | MFU | kernels/step "
              "(for-each AdamW) | host syncs/step | kernels/log | syncs/log |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        res = {}
        for name in a.objectives:
            cfg = _config(name, paths, Path(tmp) / "runs" / name, a)
            small = cfg if a.tiny else _config(name, paths, Path(tmp) / "n", _small(a))
            c = {**count_step(small), "before": count_step(small, fused=False)["step_kernels"]}
            r = res[name] = {**_timed(cfg, a.warmup), **c}
            print(f"| {name} | {r['s_step']:.4f} | {r['tok_s']:,.0f} | {r['flops_step']:.3g} "
                  f"| {r['flops_s']:.3g} | {r['mfu']:.3f} | {r['step_kernels']} ({r['before']}) "
                  f"| {r['step_syncs']} | {r['log_kernels']} | {r['log_syncs']} |", flush=True)
        for name in ("mlsm", "mlsm_store"):
            if name in res and "mlm" in res:
                t = res[name]["s_step"] / res["mlm"]["s_step"]
                f = res[name]["flops_step"] / max(res["mlm"]["flops_step"], 1.0)
                print(f"{name}/mlm: time {100 * t:.1f} %, analytic FLOPs {100 * f:.1f} % "
                      "(Hitchhikers' Guide Table 3: MLSM_10 102.7 %)")


def _small(a: argparse.Namespace) -> argparse.Namespace:
    """The counting shape: operators and syncs do not depend on batch and length, and the
    proxy runs on the host, so the count uses a small batch of the same model."""
    return argparse.Namespace(**{**vars(a), "batch": 4, "seq": a.seq, "device": "cpu",
                                 "precision": "fp32" if a.precision == "fp16" else a.precision})


if __name__ == "__main__":
    main()
