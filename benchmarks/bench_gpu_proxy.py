"""GPU-cost proxy of the batched sparse-coding solver, measured on CPU with torch.profiler.

No GPU is at hand, yet GPU users run `active_set_batched` (every device but the CPU). What a GPU
pays for, besides arithmetic, is one kernel launch per operator and a pipeline stall at every
device→host synchronisation; both can be counted on CPU. Per `sparse_encode` call, forced onto
the batched torch path, on real all-MiniLM-L6-v2 layer-5 states (k = 1536, λ = 0.05), this prints

    rows | aten ops (all events, top level, top level without views) | host syncs | rows to fallback | CPU ms

Host syncs are the operators that need a value on the host: `aten::_local_scalar_dense`
(`.item()`, `bool(t)`, `int(t)`, `.tolist()`), `aten::nonzero` (boolean-mask indexing, `nonzero`),
`aten::masked_select`, `aten::_unique2`. Op and sync counts are exact; times depend on the load.

    python benchmarks/bench_gpu_proxy.py [--rows 1024 4096 16384]
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from collections import Counter

import torch
from common import CORPUS

TRAIN = CORPUS.with_name("train.jsonl.gz")  # valid.jsonl.gz has too few documents

# operators that only make a view (no kernel on a GPU)
VIEW_OPS = {"aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::view", "aten::reshape",
            "aten::diagonal", "aten::expand", "aten::as_strided", "aten::t", "aten::transpose", "aten::permute",
            "aten::alias", "aten::detach", "aten::_unsafe_view", "aten::lift_fresh", "aten::split", "aten::narrow",
            "aten::numpy_T", "aten::mT", "aten::matrix_H", "aten::adjoint", "aten::to"}
SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique2")


def teacher_states(n: int, skip_docs: int = 0, batch: int = 32) -> torch.Tensor:
    """n ℓ2-normalised layer-5 states (n, 384) of the packaged teacher on corpus documents."""
    from mlsm.teacher.teacher import load_teacher

    teacher = load_teacher(None, 5)
    tok = teacher.tokenizer
    out, got = [], 0
    with gzip.open(TRAIN, "rt") as fh:
        docs = (json.loads(line)["text"] for i, line in enumerate(fh) if i >= skip_docs)
        while got < n:
            texts = [next(docs) for _ in range(batch)]
            enc = tok(texts, truncation=True, max_length=128, padding=True, return_tensors="pt",
                      return_special_tokens_mask=True)
            with torch.no_grad():
                h = teacher.hidden_states(enc["input_ids"], enc["attention_mask"])  # (B, T, d)
            keep = enc["attention_mask"].bool() & ~enc["special_tokens_mask"].bool()
            out.append(torch.nn.functional.normalize(h[keep].float(), dim=1))
            got += out[-1].shape[0]
    return torch.cat(out)[:n]


def profile_call(X: torch.Tensor, D: torch.Tensor, lam: float) -> dict[str, float]:
    """Ops, syncs and time of one `encode_with_gram` call with the batched solver forced."""
    import mlsm.teacher.sparse_coding as sc
    from mlsm.teacher.active_set import active_set_batched

    try:
        from mlsm.teacher.active_set import BATCHED_STEPS
    except ImportError:  # the solver before the bounded loop: it stops by itself
        BATCHED_STEPS = 10**9
    from mlsm.teacher.slots import padded_gram

    Gp = padded_gram(D=D)
    real, calls = sc.active_set, []

    def forced(c, Gp, lam, tol, max_steps, warm=None):  # what `active_set` runs off the CPU
        calls.append(active_set_batched(c, Gp, lam, tol, min(max_steps, BATCHED_STEPS), warm=warm))
        return calls[-1]

    sc.active_set = forced
    try:
        sc.encode_with_gram(X[:64], D, Gp, lam)  # warm-up
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            codes = sc.encode_with_gram(X, D, Gp, lam)
            ms = 1000 * (time.perf_counter() - start)
    finally:
        sc.active_set = real
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    names = Counter(e.name for e in events)
    top = [e.name for e in events if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    viol = sc.kkt_violation(X.double(), D.double(), codes.double(), lam)
    return {"ops": len(events), "top": len(top), "kernels": sum(1 for t in top if t not in VIEW_OPS),
            "fallback": int(calls[-1][2].sum()), "syncs": sum(names[s] for s in SYNC_OPS), "ms": ms,
            "max_kkt": float(viol.max())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--k", type=int, default=1536)
    ap.add_argument("--lam", type=float, default=0.05)
    a = ap.parse_args()
    if not TRAIN.is_file():
        print(f"skipped: {TRAIN} not found")
        return
    torch.manual_seed(0)
    pool = teacher_states(4 * a.k, skip_docs=5_000)  # other text than the coded rows
    D = pool[torch.randperm(pool.shape[0])[: a.k]].T.contiguous()  # (d, k) atoms: sampled states
    X = teacher_states(max(a.rows))
    print("| rows | aten ops (all events) | top level | top level, no views | host syncs | rows to fallback | CPU ms | max KKT violation |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in a.rows:
        r = profile_call(X[:n], D, a.lam)
        print(f"| {n:,} | {r['ops']:,} | {r['top']:,} | {r['kernels']:,} | {r['syncs']:,} | {r['fallback']:,} | "
              f"{r['ms']:,.0f} | {r['max_kkt']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
