"""How much of a token's identity a teacher's states and their sparse codes carry: an exploratory
diagnostic for v3's random-teacher arm (docs/results/cpu_replication_v3/README.md).

v3's seed 0 found that MLSM on the codes of a *randomly initialised* teacher (mlsm_l5_randteacher)
keeps most of MLSM's held-out lead over MLM. One reading: a random teacher's layer-5 state is
still mostly a function of the token at that position (its random embedding, mixed by random
attention), so its codes are a code of the masked token itself, and predicting them is a
smoothed MLM. This measures that reading directly, on the same positions for every target:

- 1-NN token identity: for each position whose token occurs at least twice among the sampled
  positions, is its nearest other position (cosine) the same token? For the teacher's states and
  for their non-negative sparse codes under each of the study's dictionaries;
- the chance level of that figure: the rate at which a position drawn at random among the others
  has the same token.

It reads a study folder written by `mlsm study` (its token store and dictionaries), loads each
dictionary's teacher as the dictionary records it, and prints one row per target. Nothing is
written. An exploratory figure of one sample, not a test of a hypothesis fixed in advance.

    PYTHONPATH=src HF_HUB_OFFLINE=1 python benchmarks/code_token_identity.py \\
        [--study runs/studies/cpu_replication_v3] [--sequences 48] [--max-len 128]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from mlsm.data.corpus import TokenStore
from mlsm.teacher.dictionary import load_dictionary
from mlsm.teacher.sparse_coding import sparse_encode
from mlsm.teacher.teacher import load_teacher


def sample_windows(store: TokenStore, n: int, length: int, seed: int = 0) -> np.ndarray:
    """n windows of `length` token ids from documents at least that long, (n, length)."""
    rng = np.random.default_rng(seed)
    long_docs = np.flatnonzero(np.diff(store.offsets) >= length)
    rows = []
    for j in rng.choice(long_docs, size=n, replace=False):
        doc = store.document(int(j))
        start = int(rng.integers(0, len(doc) - length + 1))
        rows.append(np.asarray(doc[start:start + length], dtype=np.int64))
    return np.stack(rows)


def nn_identity(x: torch.Tensor, tokens: np.ndarray) -> float:
    """Share of positions (whose token occurs twice or more) whose nearest other row (cosine)
    holds the same token; rows of all zeros (an empty code) never match."""
    x = torch.nn.functional.normalize(x.float(), dim=1)
    sims = x @ x.T  # (n, n)
    sims.fill_diagonal_(-2.0)
    nearest = sims.argmax(dim=1).numpy()
    _, inverse, counts = np.unique(tokens, return_inverse=True, return_counts=True)
    repeated = counts[inverse] >= 2
    empty = (x.abs().sum(dim=1) == 0).numpy()
    hit = (tokens[nearest] == tokens) & ~empty
    return float(hit[repeated].mean())


def chance(tokens: np.ndarray) -> float:
    """P(another position drawn at random has the same token), over repeated-token positions."""
    _, inverse, counts = np.unique(tokens, return_inverse=True, return_counts=True)
    repeated = counts[inverse] >= 2
    return float(((counts[inverse] - 1) / (len(tokens) - 1))[repeated].mean())


def states_of(teacher, windows: np.ndarray, cls: int, sep: int) -> torch.Tensor:
    """Layer-l states of the windows' tokens (the [CLS]/[SEP] around each left out), (n, d)."""
    ids = torch.as_tensor(windows)
    ids = torch.cat([torch.full((len(ids), 1), cls), ids, torch.full((len(ids), 1), sep)], 1)
    with torch.no_grad():
        h = teacher.hidden_states(ids)[:, 1:-1]  # (B, T, d)
    return h.reshape(-1, h.shape[-1]).cpu()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--study", type=Path, default=Path("runs/studies/cpu_replication_v3"))
    p.add_argument("--sequences", type=int, default=48)
    p.add_argument("--max-len", type=int, default=128)
    args = p.parse_args()
    store = TokenStore.open(args.study / "store")
    tok = store.load_tokenizer()
    windows = sample_windows(store, args.sequences, args.max_len - 2)
    tokens = windows.reshape(-1)
    print(f"{len(tokens):,} positions of {args.sequences} windows; chance that another "
          f"position has the same token: {100 * chance(tokens):.1f} %")
    print(f"{'target':<66} {'1-NN token identity':>20} {'mean nnz':>9}")
    seen = set()
    for path in sorted((args.study / "dictionaries").glob("*.safetensors")):
        d = load_dictionary(path)
        meta = d.meta
        teacher_key = (meta.get("teacher_init", "pretrained"), meta.get("teacher_seed", 0))
        teacher = load_teacher(None, int(meta["layer"]), init=teacher_key[0],
                               seed=int(teacher_key[1]))
        h = states_of(teacher, windows, tok.cls_token_id, tok.sep_token_id)
        if teacher_key not in seen:
            seen.add(teacher_key)
            name = f"states, layer {meta['layer']}, {teacher_key[0]} teacher"
            print(f"{name:<66} {100 * nn_identity(h, tokens):>19.1f} % {'':>9}")
        x = torch.nn.functional.normalize(h, dim=1)
        codes = sparse_encode(x, d.atoms, float(meta.get("lam", 0.05)))
        nnz = float((codes > 0).sum(dim=1).float().mean())
        print(f"{'codes, ' + path.stem + f' ({teacher_key[0]} teacher)':<66} "
              f"{100 * nn_identity(codes, tokens):>19.1f} % {nnz:>9.1f}")


if __name__ == "__main__":
    main()
