"""Codes of real teacher states against learned and random dictionaries: the random-atoms control.

    PYTHONPATH=src python benchmarks/bench_random_atoms.py [--states 4000] [--seeds 3]

The MLSM control "random dictionary" keeps k, λ, layer and teacher and replaces the learned atoms
by random unit-norm ones. Which random atoms? This measures, on all-MiniLM-L6-v2 layer-5 states
(ℓ2-normalised, special tokens dropped) of `enwiki_2015_prefix/train.jsonl.gz` in file order,
k = 1536, λ = 0.05, exact codes (`sparse_encode`): the share of all-zero codes (positions that
would carry no target) and the mean nnz for (a) v1's learned dictionary
(docs/results/cpu_replication/dictionaries/minilm_l5_k1536_lam0.05), (b) Gaussian unit-norm atoms
and (c) non-negative ones (|Gaussian| normalised), both made by mlsm's own `random_atoms`, over
--seeds seeds. Skips cleanly without the corpus or the packaged teacher.
"""

from __future__ import annotations

import argparse
import gzip
import json
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import skip_reason

from mlsm.teacher.dictionary import load_dictionary, random_atoms
from mlsm.teacher.sparse_coding import objective, sparse_encode
from mlsm.teacher.teacher import Teacher, load_teacher

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT.parent / "shared/data/corpus/enwiki_2015_prefix/train.jsonl.gz"
LEARNED = ROOT / "docs/results/cpu_replication/dictionaries/minilm_l5_k1536_lam0.05.safetensors"


def states(teacher: Teacher, corpus: Path, n: int, max_len: int = 128) -> torch.Tensor:
    """n ℓ2-normalised teacher states of ordinary tokens, windows of max_len − 2 tokens of each
    document in file order (as bench_sparse_coding.py, on the given corpus)."""
    out, got = [], 0
    with gzip.open(corpus, "rt") as fh:
        for line in fh:
            ids = teacher.tokenizer(json.loads(line)["text"], add_special_tokens=False)["input_ids"]
            windows = [ids[i : i + max_len - 2] for i in range(0, len(ids), max_len - 2)]
            for start in range(0, len(windows), 16):
                batch, mask, content = teacher.batch_from_ids(windows[start : start + 16])
                out.append(F.normalize(teacher.hidden_states(batch, mask)[content], dim=1))
                got += out[-1].shape[0]
            if got >= n:
                break
    return torch.cat(out)[:n]


def code_stats(X: torch.Tensor, D: torch.Tensor, lam: float) -> dict[str, float]:
    """Share of all-zero codes, mean nnz over all codes and over the non-zero ones, mean
    objective, and the largest |⟨atom, x⟩| (a code is zero iff no atom has ⟨d_j, x⟩ > λ)."""
    start = time.perf_counter()
    codes = sparse_encode(X, D, lam)
    nnz = (codes > 0).sum(1).float()
    return {"zero_share": float((nnz == 0).float().mean()), "mean_nnz": float(nnz.mean()),
            "mean_nnz_nonzero": float(nnz[nnz > 0].mean()) if bool((nnz > 0).any()) else 0.0,
            "objective": float(objective(X, D, codes, lam).mean()),
            "max_corr": float((X @ D).max(1).values.mean()), "seconds": time.perf_counter() - start}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--states", type=int, default=4000)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--corpus", type=Path, default=TRAIN)
    args = ap.parse_args()
    reason = skip_reason() or (None if args.corpus.is_file() else f"{args.corpus} is absent")
    if reason or not LEARNED.is_file():
        print(f"skipped: {reason or f'{LEARNED} is absent'}")
        return
    torch.set_num_threads(args.threads)
    learned = load_dictionary(LEARNED)
    teacher = load_teacher(None, learned.layer)
    X = states(teacher, args.corpus, args.states)
    d, k, lam = learned.d, learned.k, learned.lam
    print(f"{X.shape[0]} states of {teacher.name} layer {teacher.layer} ({args.corpus.name}); "
          f"d={d} k={k} lam={lam}; torch {torch.__version__}, {platform.machine()}")
    print(f"mean state: norm {float(X.mean(0).norm()):.3f}, "
          f"mean cosine to the all-ones direction {float(X.sum(1).mean()) / d ** 0.5:.3f}")
    rows = [("learned (v1)", learned.atoms.float())]
    rows += [(f"random seed {s}", random_atoms(d, k, s)) for s in range(args.seeds)]
    rows += [(f"random_nonneg seed {s}", random_atoms(d, k, s, nonneg=True))
             for s in range(args.seeds)]
    print("| atoms | all-zero codes | mean nnz | mean nnz (non-zero codes) | objective "
          "| mean max ⟨d_j, x⟩ | s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, D in rows:
        r = code_stats(X, D, lam)
        print(f"| {name} | {100 * r['zero_share']:.2f} % | {r['mean_nnz']:.1f} | "
              f"{r['mean_nnz_nonzero']:.1f} | {r['objective']:.4f} | {r['max_corr']:.3f} | "
              f"{r['seconds']:.1f} |")


if __name__ == "__main__":
    main()
