"""Dictionary learning for MLSM: D ∈ R^{d×k} whose sparse codes are the student's targets.

    min_{D ∈ C, α_i ≥ 0} Σ_i ½‖x_i − Dα_i‖² + λ‖α_i‖₁,   C = {D : ‖d_j‖₂ ≤ 1}      (Berend 2023)

learned by online dictionary learning (Mairal, Bach, Ponce & Sapiro 2009, "Online dictionary
learning for sparse coding", Alg. 1–2 with the mini-batch extension of §3.4): for each mini-batch
the codes are computed exactly (`sparse_encode`), the sufficient statistics
A = Σ ααᵀ (k, k) and B = Σ xαᵀ (d, k) are accumulated with a forgetting factor, and every column
is updated once by block-coordinate descent u_j = (b_j − D a_j)/A_jj + d_j, d_j = u_j/max(1, ‖u_j‖)
(Alg. 2). Atoms that no code ever used are re-drawn from the data (§3.4, "purging").
The x_i are ℓ2-normalised layer-l teacher states of non-special tokens of a token-store sample.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from threadpoolctl import threadpool_limits
from tqdm.auto import tqdm

from mlsm.errors import UserError
from mlsm.fileio import atomic_write
from mlsm.teacher.sparse_coding import objective, sparse_encode
from mlsm.teacher.teacher import Teacher

DICT_FORMAT = "mlsm-dictionary"


@dataclass
class Dictionary:
    """Atoms (d, k) as columns plus the meta that says how they were made."""

    atoms: torch.Tensor  # (d, k)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def d(self) -> int:
        return int(self.atoms.shape[0])

    @property
    def k(self) -> int:
        return int(self.atoms.shape[1])

    @property
    def lam(self) -> float:
        return float(self.meta["lam"])

    def check_teacher(self, teacher: Teacher) -> None:
        """The dictionary must live in the teacher's hidden space (same d, same layer)."""
        if self.d != teacher.hidden_size:
            raise UserError(f"the dictionary has d={self.d} but the teacher's hidden size is {teacher.hidden_size}; learn a dictionary with this teacher (`mlsm dictionary --teacher ...`)")
        layer = self.meta.get("layer")
        if layer is not None and int(layer) != teacher.layer:
            raise UserError(f"the dictionary was learned on layer {layer} but the teacher stops at layer {teacher.layer}; use --layer {layer} or learn a new dictionary")


def _check_options(k: int, lam: float) -> None:
    if k < 1:
        raise UserError(f"the dictionary size k must be >= 1 (got {k}); use e.g. --k 1536 (4 × hidden size)")
    if not lam > 0:
        raise UserError(f"lambda must be > 0 (got {lam}); use e.g. --lam 0.05")


# --------------------------------------------------------------------------- data


def collect_vectors(teacher: Teacher, store: Any, n: int, max_len: int = 128, seed: int = 0,
                    batch_size: int = 32) -> torch.Tensor:
    """n ℓ2-normalised layer-l teacher states (n, d) of random windows of a token store.

    Windows of up to max_len − 2 tokens start at uniformly drawn token positions and stop at
    their document's end; the teacher sees them with its own special tokens, whose states (and
    padding) are excluded. Uses only store.tokens, store.offsets and store.load_tokenizer().
    """
    if n < 1:
        raise UserError(f"need at least 1 vector (got n={n}); pass a positive --n-vectors")
    if store.load_tokenizer().get_vocab() != teacher.tokenizer.get_vocab():
        raise UserError("the token store was made with another tokenizer than the teacher's; prepare a store with the teacher's tokenizer (`mlsm prepare --tokenizer <teacher>`)")
    tokens, offsets = store.tokens, np.asarray(store.offsets)
    n_tokens = int(offsets[-1])
    if n_tokens == 0:
        raise UserError("the token store is empty; prepare it from a non-empty corpus")
    rng = np.random.default_rng(seed)
    width = max(1, max_len - 2)  # room for the teacher's [CLS] … [SEP]
    out: list[torch.Tensor] = []
    got, empty = 0, 0
    bar = tqdm(total=n, desc=f"teacher layer {teacher.layer}", unit="vec", disable=None)
    while got < n:
        starts = rng.integers(0, n_tokens, size=batch_size)
        ends = np.minimum(starts + width, offsets[np.searchsorted(offsets, starts, side="right")])
        seqs = [np.asarray(tokens[s:e]) for s, e in zip(starts, ends, strict=True)]
        ids, mask, content = teacher.batch_from_ids(seqs)
        h = teacher.hidden_states(ids, mask)[content.to(teacher.device)].float()  # (m, d)
        if not bool(torch.isfinite(h).all()):
            raise UserError("the teacher produced NaN/inf states; load it in float32 (omit --dtype) or check the checkpoint")
        norms = h.norm(dim=1, keepdim=True)
        h = (h / norms.clamp(min=1e-12))[norms.squeeze(1) > 0]
        empty = empty + 1 if h.shape[0] == 0 else 0
        if empty >= 20:  # nothing but special/unknown tokens: the loop would never end
            raise UserError("the token store yields no ordinary tokens for this teacher; check that it was prepared with the teacher's tokenizer")
        out.append(h[: n - got].cpu())
        got += out[-1].shape[0]
        bar.update(out[-1].shape[0])
    bar.close()
    return torch.cat(out)


# --------------------------------------------------------------------------- learning


def learn_atoms(X: torch.Tensor, k: int, lam: float = 0.05, *, n_iter: int | None = None,
                batch_size: int = 512, forget: float = 1.0, seed: int = 0,
                init: torch.Tensor | None = None, progress: bool = True) -> torch.Tensor:
    """Online dictionary learning on rows of X (n, d); returns D (d, k) on X's device/dtype.

    n_iter mini-batches (default: one pass over X). forget = ρ of the forgetting factor
    β_t = (1 − 1/t)^ρ (Mairal et al. 2009 §3.4); ρ > 1 forgets codes of early dictionaries faster.
    init: optional starting dictionary (d, k); default k random data vectors.
    """
    _check_options(k, lam)
    if X.dim() != 2 or X.shape[0] == 0:
        raise UserError("dictionary learning needs a non-empty (n, d) matrix of vectors")
    if not bool(torch.isfinite(X).all()):
        raise UserError("training vectors contain NaN or inf; check the teacher outputs")
    n, d = X.shape
    gen = torch.Generator().manual_seed(seed)
    D = _init_atoms(X, k, gen) if init is None else init.to(X).clone()
    A = X.new_zeros(k, k)  # Σ ααᵀ
    B = X.new_zeros(d, k)  # Σ xαᵀ
    n_iter = n_iter if n_iter is not None else max(1, math.ceil(n / batch_size))
    order = torch.randperm(n, generator=gen)
    pos = 0
    for t in tqdm(range(1, n_iter + 1), desc="dictionary", unit="batch", disable=None if progress else True):
        if pos + batch_size > n:
            order, pos = torch.randperm(n, generator=gen), 0
        idx = order[pos : pos + batch_size].to(X.device)
        pos += batch_size
        Xb = X[idx]  # (b, d)
        codes = sparse_encode(Xb, D, lam)  # (b, k), exact codes
        beta = (1.0 - 1.0 / t) ** forget
        A.mul_(beta).add_(_gram_of_sparse(codes), alpha=1.0 / len(idx))
        B.mul_(beta).add_(Xb.T @ codes / len(idx))
        _update_atoms(D, A, B, X, gen)
    return D


def _gram_of_sparse(codes: torch.Tensor) -> torch.Tensor:
    """codesᵀ codes (k, k) from the supports alone: Σ_i α_i α_iᵀ over ~30 non-zeros per row,
    instead of a dense (k × b × k) GEMM."""
    k = codes.shape[1]
    vals, idx = codes.topk(max(1, int((codes > 0).sum(1).max())), dim=1)  # (b, s)
    outer = vals[:, :, None] * vals[:, None, :]  # (b, s, s), 0 where a value is padding
    flat = (idx[:, :, None] * k + idx[:, None, :]).reshape(-1)
    return codes.new_zeros(k * k).index_add_(0, flat, outer.reshape(-1)).view(k, k)


def _init_atoms(X: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """k distinct random data vectors as unit columns (repeats only when n < k)."""
    n = X.shape[0]
    idx = torch.randperm(n, generator=gen)[:k] if n >= k else torch.randint(0, n, (k,), generator=gen)
    D = X[idx.to(X.device)].T.clone()  # (d, k)
    if n < k:
        D += 0.01 * torch.randn(D.shape, generator=gen).to(D)
    return D / D.norm(dim=0, keepdim=True).clamp(min=1e-12)


def _update_atoms(D: torch.Tensor, A: torch.Tensor, B: torch.Tensor, X: torch.Tensor,
                  gen: torch.Generator, block: int = 64) -> None:
    """One block-coordinate pass over the columns, in place (Mairal et al. 2009, Alg. 2).

    Column j: u = (b_j − D a_j)/A_jj + d_j, d_j = u / max(1, ‖u‖), in order. D a_j would
    cost a (d × k) read per column; instead D A[:, J] is computed once per block J of columns
    (one GEMM) and corrected by the changes of the block's earlier columns, which is the same
    sequential pass in exact arithmetic. On CPU the per-column work runs in NumPy, whose
    per-call overhead is a few times lower than torch's for these tiny vectors.
    Atoms no code has used yet are re-drawn from distinct random rows of X: duplicated atoms
    would be wasted and make the active sets of the next codes singular.
    """
    diag = A.diagonal()
    used = (diag > 1e-12 * diag.max().clamp(min=1e-30)).nonzero().squeeze(1)
    Dt, Bt = D.T.contiguous(), B.T.contiguous()  # atoms as rows (k, d); A is symmetric
    # NumPy's BLAS gets one thread: OpenBLAS workers spin after each call and would slow the
    # torch threads of the next sparse coding ~2× (measured: 180 → 80 ms per mini-batch).
    with threadpool_limits(limits=1, user_api="blas"):
        _column_pass(Dt, A, Bt, diag, used, block)
    D.copy_(Dt.T)
    dead = (diag <= 1e-12 * diag.max().clamp(min=1e-30)).nonzero().squeeze(1)
    if dead.numel():  # re-draw never-used atoms from the data (§3.4)
        D[:, dead] = _init_atoms(X, dead.numel(), gen)


def _column_pass(Dt: torch.Tensor, A: torch.Tensor, Bt: torch.Tensor, diag: torch.Tensor, used: torch.Tensor,
                 block: int) -> None:
    """The sequential column updates of `_update_atoms` on the rows of Dt (k, d), in place.

    The block GEMM runs in torch; on CPU the per-column work runs on NumPy views of the same
    memory, whose per-call overhead is a few times lower than torch's for these tiny vectors.
    """
    cpu = Dt.device.type == "cpu"
    Dt_, A_, Bt_, diag_ = (t.numpy() for t in (Dt, A, Bt, diag)) if cpu else (Dt, A, Bt, diag)
    for J in used.split(block):
        P = A[J] @ Dt  # (b, d): row i = D a_j for j = J[i], before this block's updates
        J_, P_ = (J.numpy(), P.numpy()) if cpu else (J, P)
        old = Dt_[J_].copy() if cpu else Dt_[J_].clone()
        for i, j in enumerate(J.tolist()):
            Da_j = P_[i] + A_[j, J_[:i]] @ (Dt_[J_[:i]] - old[:i])  # (d,) with earlier updates
            u = (Bt_[j] - Da_j) / diag_[j] + Dt_[j]
            Dt_[j] = u / max(1.0, float((u * u).sum()) ** 0.5)


def dictionary_objective(X: torch.Tensor, D: torch.Tensor, lam: float, batch_size: int = 4096) -> float:
    """Mean of ½‖x − Dα*‖² + λ‖α*‖₁ over rows of X with exact codes α*."""
    G = D.T @ D
    total = 0.0
    for Xb in X.split(batch_size):
        total += float(objective(Xb, D, sparse_encode(Xb, D, lam, gram=G), lam).sum())
    return total / max(1, X.shape[0])


def learn_dictionary(store: Any, teacher: Teacher, *, k: int | None = None, lam: float = 0.05,
                     n_vectors: int = 2_000_000, max_len: int = 128, batch_size: int = 512,
                     n_iter: int | None = None, forget: float = 1.0, eval_vectors: int = 20_000,
                     seed: int = 0, out: str | Path | None = None) -> Dictionary:
    """Collect n_vectors teacher states from a token store and learn a dictionary on them.

    k defaults to 4 × the teacher's hidden size. The final objective is the mean over up to
    eval_vectors of the collected vectors. When `out` is given the result is saved there.
    """
    k = 4 * teacher.hidden_size if k is None else k
    _check_options(k, lam)
    X = collect_vectors(teacher, store, n_vectors, max_len=max_len, seed=seed).to(teacher.device)
    start = time.perf_counter()
    D = learn_atoms(X, k, lam, n_iter=n_iter, batch_size=batch_size, forget=forget, seed=seed)
    seconds = time.perf_counter() - start
    sample = X[torch.randperm(X.shape[0], generator=torch.Generator().manual_seed(seed + 1))[:eval_vectors]]
    meta = _meta(teacher, store, k=k, lam=lam, n=X.shape[0], max_len=max_len, batch_size=batch_size,
                 n_iter=n_iter or math.ceil(X.shape[0] / batch_size), seed=seed, seconds=seconds,
                 objective=dictionary_objective(sample, D, lam), n_eval=sample.shape[0])
    result = Dictionary(D.cpu(), meta)
    if out is not None:
        save_dictionary(result, out)
    return result


def _meta(teacher: Teacher, store: Any, **values: Any) -> dict[str, Any]:
    from mlsm.data.corpus import tokenizer_hash  # corpus pulls in the tokenizers stack

    return {
        "format": DICT_FORMAT, "version": 1,
        "teacher": teacher.name, "teacher_tokenizer_hash": tokenizer_hash(teacher.tokenizer),
        "layer": teacher.layer, "d": teacher.hidden_size,
        "store": str(getattr(store, "path", "")), **values,
    }


# --------------------------------------------------------------------------- files


def _paths(path: str | Path) -> tuple[Path, Path]:
    path = Path(path)
    if path.suffix != ".safetensors":
        path = path.with_name(path.name + ".safetensors")
    return path, path.with_suffix(".json")


def save_dictionary(dictionary: Dictionary, path: str | Path) -> Path:
    """Write atoms to PATH.safetensors and meta to PATH.json, each atomically; returns the former."""
    weights, meta_path = _paths(path)
    meta = {**dictionary.meta, "d": dictionary.d, "k": dictionary.k}
    text = json.dumps(meta, indent=2, sort_keys=True)
    atoms = dictionary.atoms.detach().cpu().float().contiguous()
    atomic_write(weights, lambda p: save_file({"atoms": atoms}, p, metadata={"meta": text}))
    atomic_write(meta_path, lambda p: Path(p).write_text(text + "\n"))
    return weights


def load_dictionary(path: str | Path, device: str | torch.device = "cpu") -> Dictionary:
    """Read a dictionary written by `save_dictionary` (PATH or PATH.safetensors)."""
    weights, meta_path = _paths(path)
    if not weights.is_file():
        raise UserError(f"no dictionary at {weights}; learn one with `mlsm dictionary --out {weights}`")
    atoms = load_file(str(weights), device=str(device))["atoms"]
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    return Dictionary(atoms, meta)
