"""GPU-cost proxy of the lock-step sparse-coding solvers, measured on CPU with torch.profiler.

No GPU is at hand, yet GPU users run the lock-step path of `mlsm.teacher.active_set` (every
device but the CPU). What a GPU pays for, besides arithmetic, is one kernel launch per operator
and a pipeline stall at every device→host synchronisation; both can be counted on CPU. Per
`encode_with_gram` call (solver + KKT check + fallback), forced onto each lock-step solver, on
real all-MiniLM-L6-v2 layer-5 states (k = 1536 atoms sampled from states of other documents,
λ = 0.05, tol 1e-5), this prints one table row per solver and row count:

    top-level ops | top level without views | aten events | host syncs | rows to fallback |
    CPU s | rows whose support equals the CPU kernel's (the reference)

"before" is `active_set_batched` (data-dependent exits, shrinking batch), "after" is
`active_set_fixed` (fixed-shape steps, what CUDA runs now). Host syncs are the operators that
need a value on the host: `_local_scalar_dense` (`.item()`, `bool(t)`, `int(t)`, linalg error
checks), `nonzero` (boolean-mask indexing), `masked_select`, `_unique2`. Op and sync counts are
exact and do not depend on the load; CPU seconds do.

    python benchmarks/bench_gpu_proxy.py [--rows 1024 4096 16384] [--solvers before after]
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from collections import Counter

import torch
import torch.nn.functional as F
from common import CORPUS

# operators that only make a view (no kernel on a GPU)
VIEW_OPS = {"aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::view",
            "aten::reshape", "aten::diagonal", "aten::expand", "aten::as_strided", "aten::t",
            "aten::transpose", "aten::permute", "aten::alias", "aten::detach", "aten::_unsafe_view",
            "aten::lift_fresh", "aten::split", "aten::narrow", "aten::numpy_T", "aten::mT",
            "aten::matrix_H", "aten::adjoint", "aten::to"}
SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique2")


def teacher_states(docs: list[str], n: int) -> torch.Tensor:
    """Up to n ℓ2-normalised layer-5 states (n, 384) of the packaged teacher: each document cut
    into 126-token chunks, coded with [CLS] … [SEP], special tokens left out."""
    from mlsm.teacher.teacher import load_teacher

    teacher = load_teacher(None, 5)
    tok = teacher.tokenizer
    chunks = [ids[i : i + 126] for doc in docs
              for ids in [tok(doc, add_special_tokens=False)["input_ids"]]
              for i in range(0, len(ids), 126)]
    out, got = [], 0
    for b in range(0, len(chunks), 16):
        seqs = [[tok.cls_token_id, *ch, tok.sep_token_id] for ch in chunks[b : b + 16]]
        width = max(map(len, seqs))
        ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
        mask = (torch.arange(width) < torch.tensor([len(s) for s in seqs])[:, None]).long()
        with torch.no_grad():
            h = teacher.hidden_states(ids, mask)  # (B, T, d)
        body = mask.bool() & (ids != tok.cls_token_id) & (ids != tok.sep_token_id)
        out.append(F.normalize(h[body].float(), dim=1))
        got += out[-1].shape[0]
        if got >= n:
            break
    return torch.cat(out)[:n]


def solver(name: str):
    """The lock-step solver `name` with `active_set`'s signature."""
    if name == "before":
        from mlsm.teacher.active_set import active_set_batched

        return lambda c, Gp, lam, tol, max_steps, warm=None: active_set_batched(
            c, Gp, lam, tol, max_steps, warm=warm)
    from mlsm.teacher.active_set_fixed import active_set_fixed

    return lambda c, Gp, lam, tol, max_steps, warm=None: active_set_fixed(
        c, Gp, lam, tol, warm=warm)


def profile_call(X: torch.Tensor, D: torch.Tensor, lam: float, name: str,
                 ref: torch.Tensor) -> dict:
    """Ops, syncs, fallback rows, CPU time and parity of one `encode_with_gram` call."""
    import mlsm.teacher.sparse_coding as sc
    from mlsm.teacher.slots import padded_gram

    Gp = padded_gram(D=D)
    real, inner, calls = sc.active_set, solver(name), []

    def forced(c, Gp, lam, tol, max_steps, warm=None):  # what `active_set` runs off the CPU
        calls.append((inner(c, Gp, lam, tol, max_steps, warm), c, tol))
        return calls[-1][0]

    sc.active_set = forced
    try:
        sc.encode_with_gram(X[:64], D, Gp, lam)  # warm-up
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            start = time.process_time()
            codes = sc.encode_with_gram(X, D, Gp, lam)
            cpu = time.process_time() - start
    finally:
        sc.active_set = real
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    sol, c, tol = calls[-1]
    fallback = int((sc._checked(sol, c, Gp, lam)[1] > tol).sum())  # rows the homotopy re-solved
    names = Counter(e.name for e in events)
    top = [e.name for e in events
           if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    return {"ops": len(events), "top": len(top),
            "kernels": sum(1 for t in top if t not in VIEW_OPS),
            "syncs": sum(names[s] for s in SYNC_OPS), "fallback": fallback, "cpu": cpu,
            "same": int(((codes > 0) == (ref > 0)).all(1).sum())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--solvers", nargs="+", default=["before", "after"],
                    choices=["before", "after"])
    ap.add_argument("--k", type=int, default=1536)
    ap.add_argument("--lam", type=float, default=0.05)
    a = ap.parse_args()
    if not CORPUS.is_file():
        print(f"skipped: {CORPUS} not found")
        return
    from mlsm.teacher.sparse_coding import sparse_encode

    with gzip.open(CORPUS, "rt", encoding="utf-8") as fh:
        docs = [json.loads(line)["text"] for line in fh]
    torch.manual_seed(0)
    pool = teacher_states(docs[-8:][::-1], 4 * a.k)  # other text than the coded rows
    D = pool[torch.randperm(pool.shape[0])[: a.k]].T.contiguous()  # (d, k) atoms: sampled states
    X = teacher_states(docs[:-8], max(a.rows))
    print("| solver | rows | top-level ops | top level, no views | aten events | host syncs "
          "| rows to fallback | CPU s (loaded) | support = CPU kernel's |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in a.rows:
        ref = sparse_encode(X[:n], D, a.lam)  # the compiled CPU kernel: the reference
        for name in a.solvers:
            r = profile_call(X[:n], D, a.lam, name, ref)
            print(f"| {name} | {n:,} | {r['top']:,} | {r['kernels']:,} | {r['ops']:,} "
                  f"| {r['syncs']:,} | {r['fallback']:,} | {r['cpu']:,.1f} "
                  f"| {r['same']:,} of {n:,} |", flush=True)


if __name__ == "__main__":
    main()
