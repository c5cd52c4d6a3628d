"""tau-effective rank of token representations per layer, with and without [MASK] in the input.

Meng et al. 2024 ("Representation Deficiency in Masked Language Modeling", §2, Def. 2.1
and Fig. 1): the tau-effective rank of a representation matrix H (n, d) is the smallest k whose
best rank-k approximation keeps a fraction tau of the energy:

    rank_tau(H) = min { k : sum_{i<=k} sigma_i^2 / sum_i sigma_i^2 >= tau },   tau = 0.9,

sigma_1 >= sigma_2 >= ... the singular values of H (equivalently ||H_k||_F^2 >= tau ||H||_F^2,
Eckart-Young). We use squared singular values as written there and do not centre H (option
`center=True` subtracts the mean row first, for a PCA-style count).

Fig. 1 protocol: feed sentences unmasked, and again with 15 % of the (non-special) tokens replaced
by [MASK]; at every layer stack the hidden states of the non-special positions into (n, d) and
take rank_tau. With masked input we also report the [MASK] positions alone and the real (not
masked) positions alone: MLM pretraining spends dimensions on [MASK], which shows as real-token
representations of lower rank.

Memory is bounded: per layer and condition only the Gram matrix H^T H (d, d) is accumulated
(its eigenvalues are sigma_i^2), never H itself.
"""

from __future__ import annotations

import csv
import io
import json
import os
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from mlsm.artifacts.checkpoint import resolve_checkpoint
from mlsm.errors import UserError
from mlsm.fileio import atomic_write, atomic_write_text, files_as_one
from mlsm.hf import first_line
from mlsm.inputs import bounded_lines
from mlsm.limits import MAX_SENTENCE_CHARS

CONDITIONS = ("unmasked", "masked_all", "masked_mask", "masked_real")
# Tolerance on the cumulative energy ratio so that a spectrum reaching tau exactly (up to rounding)
# is counted at the k where it reaches it.
_EPS = 1e-10


def _rank_from_energy(energy: torch.Tensor, tau: float) -> int:
    """energy: squared singular values (r,), any order. Returns rank_tau (0 for a zero matrix)."""
    energy = energy.double().clamp(min=0).sort(descending=True).values
    total = energy.sum()
    if energy.numel() == 0 or total <= 0:
        return 0
    ratio = torch.cumsum(energy, 0) / total  # (r,) non-decreasing, last = 1
    return min(int((ratio < tau - _EPS).sum()) + 1, energy.numel())


def effective_rank(x: torch.Tensor, tau: float = 0.9) -> int:
    """rank_tau of a matrix (n, d): the smallest k with sum_{i<=k} sigma_i^2 >= tau * sum
    sigma^2."""
    if not 0 < tau <= 1:
        raise UserError(f"tau must be in (0, 1], got {tau}")
    if x.dim() != 2:
        raise UserError(f"effective_rank needs a 2-D matrix (n, d), got shape {tuple(x.shape)}")
    return _rank_from_energy(torch.linalg.svdvals(x.double()) ** 2, tau)


def effective_rank_from_gram(gram: torch.Tensor, tau: float = 0.9) -> int:
    """rank_tau from G = H^T H (d, d): its eigenvalues are the squared singular values of H."""
    if not 0 < tau <= 1:
        raise UserError(f"tau must be in (0, 1], got {tau}")
    return _rank_from_energy(torch.linalg.eigvalsh(gram.double()), tau)


RANK_HEADING = "# tau-effective rank per layer"  # rank.md's first line starts with it


@dataclass
class RankTable:
    """Effective rank per layer (0 = embeddings) and condition; n rows behind each column."""

    tau: float
    mask_rate: float
    hidden_size: int
    layers: list[int]
    ranks: dict[str, list[int]]
    counts: dict[str, int]
    center: bool = False
    meta: dict[str, Any] = field(default_factory=dict)

    def rows(self) -> list[dict[str, int]]:
        return [{"layer": layer, **{c: self.ranks[c][i] for c in self.ranks}}
                for i, layer in enumerate(self.layers)]

    def to_csv(self) -> str:
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=["layer", *self.ranks], lineterminator="\n")
        writer.writeheader()
        writer.writerows(self.rows())
        return buf.getvalue()

    def to_markdown(self) -> str:
        cols = list(self.ranks)
        head = [
            f"{RANK_HEADING} (tau = {self.tau}, d = {self.hidden_size})",
            "",
            f"mask rate {self.mask_rate:.0%}; token vectors per column: "
            + ", ".join(f"{c} {self.counts[c]}" for c in cols)
            + ("; rows centred" if self.center else ""),
            "",
            "| layer | " + " | ".join(cols) + " |",
            "| ---: |" + " ---: |" * len(cols),
        ]
        body = [f"| {r['layer']} | " + " | ".join(str(r[c]) for c in cols) + " |"
                for r in self.rows()]
        return "\n".join(head + body) + "\n"


class _GramAccumulator:
    """Sum of x x^T (and of x, for centring) over token vectors, per (condition, layer)."""

    def __init__(self, n_layers: int, d: int):
        self.gram = {c: torch.zeros(n_layers, d, d, dtype=torch.float64) for c in CONDITIONS}
        self.total = {c: torch.zeros(n_layers, d, dtype=torch.float64) for c in CONDITIONS}
        self.count = dict.fromkeys(CONDITIONS, 0)
        self.cut = 0  # sentences longer than max_length tokens, cut there

    def add(self, cond: str, states: Sequence[torch.Tensor], where: torch.Tensor) -> None:
        """states: per layer (B, T, d); where: (B, T) bool, the positions to add."""
        n = int(where.sum())
        if n == 0:
            return
        for layer, h in enumerate(states):
            x = h[where].double().cpu()  # (n, d)
            self.gram[cond][layer] += x.T @ x
            self.total[cond][layer] += x.sum(0)
        self.count[cond] += n

    def ranks(self, cond: str, tau: float, center: bool) -> list[int]:
        out = []
        for gram, total in zip(self.gram[cond], self.total[cond], strict=True):
            if center and self.count[cond] > 0:
                mean = total / self.count[cond]
                gram = gram - self.count[cond] * torch.outer(mean, mean)  # (H - 1 mu^T)^T (...)
            out.append(effective_rank_from_gram(gram, tau))
        return out


def _choose_masks(special: torch.Tensor, rate: float, gen: torch.Generator) -> torch.Tensor:
    """(B, T) bool: round(rate * n) (at least 1) random non-special positions of each row."""
    chosen = torch.zeros_like(special)
    for b in range(special.shape[0]):
        real = torch.nonzero(~special[b]).flatten()
        if rate <= 0 or len(real) == 0:
            continue
        k = min(len(real), max(1, round(rate * len(real))))
        chosen[b, real[torch.randperm(len(real), generator=gen)[:k]]] = True
    return chosen


def _hidden_states(model: Any, ids: torch.Tensor, attention: torch.Tensor) -> tuple:
    encoder = getattr(model, "base_model", model)  # skip an MLM head: only hidden states needed
    out = encoder(input_ids=ids, attention_mask=attention, output_hidden_states=True)
    return out.hidden_states  # (L + 1) x (B, T, d)


def _accumulate(
    model: Any, tokenizer: Any, sentences: Sequence[str], mask_rate: float, seed: int,
    batch_size: int, max_length: int, dev: torch.device,
) -> _GramAccumulator:
    """Run the sentences unmasked and masked; add each condition's token vectors per layer."""
    gen = torch.Generator().manual_seed(seed)
    acc: _GramAccumulator | None = None
    for start in range(0, len(sentences), batch_size):
        batch = list(sentences[start : start + batch_size])
        enc = tokenizer(batch, padding=True, truncation=True, max_length=max_length,
                        return_special_tokens_mask=True, return_tensors="pt")
        ids, attention = enc["input_ids"], enc["attention_mask"]
        special = enc["special_tokens_mask"].bool() | (attention == 0)  # (B, T) never counted
        states = _hidden_states(model, ids.to(dev), attention.to(dev))  # (L + 1) x (B, T, d)
        if acc is None:
            acc = _GramAccumulator(len(states), states[0].shape[-1])
        # how many were cut, for the note the CLI prints (verbose=False: no transformers warning)
        acc.cut += sum(len(full) > max_length
                       for full in tokenizer(batch, verbose=False)["input_ids"])
        acc.add("unmasked", states, ~special)
        if mask_rate > 0:
            masked = _choose_masks(special, mask_rate, gen)  # (B, T)
            masked_ids = ids.masked_fill(masked, tokenizer.mask_token_id)
            states = _hidden_states(model, masked_ids.to(dev), attention.to(dev))
            acc.add("masked_all", states, ~special)
            acc.add("masked_mask", states, masked)
            acc.add("masked_real", states, ~special & ~masked)
    assert acc is not None  # sentences is non-empty
    return acc


def layerwise_effective_rank(
    model: Any,
    tokenizer: Any,
    sentences: Sequence[str],
    mask_rate: float = 0.15,
    seed: int = 0,
    *,
    tau: float = 0.9,
    center: bool = False,
    batch_size: int = 32,
    max_length: int | None = None,
    device: str | torch.device | None = None,
) -> RankTable:
    """rank_tau per layer of token representations, unmasked and with `mask_rate` [MASK] (Fig. 1).

    model: any HF encoder (AutoModel or a *ForMaskedLM; hidden states via output_hidden_states).
    Sentences longer than max_length tokens are truncated (None: the model's positions, at most
    DEFAULT_MAX_LENGTH; more than the model's positions is refused in one line). Masked
    positions are drawn from a generator seeded with `seed`, sentence by sentence, so they do
    not depend on batch_size.
    """
    if not sentences:
        raise UserError("no sentences to compute effective rank on: pass a non-empty text file")
    if not 0 <= mask_rate < 1:
        raise UserError(f"mask_rate must be in [0, 1), got {mask_rate}")
    if mask_rate > 0 and getattr(tokenizer, "mask_token_id", None) is None:
        raise UserError("the tokenizer has no [MASK] token: use mask_rate=0 or a "
                        "masked-LM tokenizer")
    max_length = _max_length(model, tokenizer, max_length)
    dev = torch.device(device) if device is not None else next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            acc = _accumulate(model, tokenizer, sentences, mask_rate, seed, batch_size, max_length,
                              dev)
    finally:
        model.train(was_training)
    conds = CONDITIONS if mask_rate > 0 else ("unmasked",)
    return RankTable(
        tau=tau, mask_rate=mask_rate, hidden_size=acc.gram["unmasked"].shape[-1],
        layers=list(range(acc.gram["unmasked"].shape[0])),
        ranks={c: acc.ranks(c, tau, center) for c in conds},
        counts={c: acc.count[c] for c in conds}, center=center,
        meta={"n_sentences": len(sentences), "seed": seed, "max_length": max_length,
              "n_cut": acc.cut},
    )


DEFAULT_MAX_LENGTH = 128  # tokens with the special ones, where the model takes as many


def _max_length(model: Any, tokenizer: Any, asked: int | None) -> int:
    """The truncation length: `asked`, refused beyond the model's positions (a longer sentence
    indexed past its position embeddings: a traceback); None: as many as it takes, <= 128."""
    from mlsm.evaluate.zeroshot.pll import _model_max_len

    limit = _model_max_len(tokenizer, model)
    if asked is None:
        return DEFAULT_MAX_LENGTH if limit is None else min(DEFAULT_MAX_LENGTH, limit)
    if limit is not None and asked > limit:
        raise UserError(f"--max-length {asked} is more than the model's {limit} positions; "
                        f"pass --max-length {limit} or less (longer sentences are cut there)")
    return asked


def load_encoder(path: str, device: str | torch.device | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) of an HF encoder folder (AutoModel), eval mode; UserError if unreadable.

    ``path`` may also be a run directory, ``RUN@50%`` or ``RUN@step-N``."""
    from transformers import AutoModel

    from mlsm.hf import load_model, load_tokenizer, quiet_head_mismatch

    path = str(resolve_checkpoint(path))
    with quiet_head_mismatch(path, with_head=False):  # a masked-LM folder's head is not used here
        model, tokenizer = load_model(AutoModel, path), load_tokenizer(path)
    return (model.to(device) if device is not None else model).eval(), tokenizer


def read_sentences(path: str | os.PathLike, limit: int | None = None) -> list[str]:
    """Non-empty lines of a .txt or .txt.gz file (one sentence or short text per line)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"text file {p} not found: pass --text FILE with one sentence per line")
    lines: list[str] = []
    try:  # each line read up to MAX_SENTENCE_CHARS only: a gzip of one 400 MB line took 17 GB
        for _, line in bounded_lines(p, "a sentence", MAX_SENTENCE_CHARS,
                                     "mlsm.limits.MAX_SENTENCE_CHARS"):
            if limit is not None and len(lines) >= limit:
                break
            if line.strip():
                lines.append(line.strip())
    except (UnicodeDecodeError, OSError, EOFError, zlib.error) as err:  # OSError: gzip.BadGzipFile
        raise UserError(f"{p} is not readable UTF-8 text ({first_line(err)}): pass "
                        "a .txt or .txt.gz") from None
    if not lines:
        raise UserError(f"{p} has no non-empty lines: pass a text file with one sentence per line")
    return lines[:limit]


def plot_rank(table: RankTable, path: str | os.PathLike) -> Path:
    """Line plot: effective rank against layer, one line per condition (PNG, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(path)
    fig, ax = plt.subplots(figsize=(6, 4))
    for cond, ranks in table.ranks.items():
        ax.plot(table.layers, ranks, marker="o", label=cond)
    ax.axhline(table.hidden_size, color="grey", linestyle="--", linewidth=1,
               label=f"d = {table.hidden_size}")
    ax.set(xlabel="layer (0 = embeddings)", ylabel=f"{table.tau}-effective rank",
           title=f"Effective rank of token representations ({table.mask_rate:.0%} [MASK])")
    ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    try:
        atomic_write(out, lambda tmp: fig.savefig(tmp, format="png", dpi=120))
    finally:
        plt.close(fig)
    return out


RANK_FILES = ("rank.md", "rank.csv", "rank.json", "rank.png")
"""The files `mlsm rank --out` writes."""


def write_rank_report(table: RankTable, out_dir: str | os.PathLike) -> dict[str, Path]:
    """Write rank.csv, rank.md, rank.json and rank.png into out_dir; return the paths."""
    out = Path(out_dir)
    with files_as_one(out, RANK_FILES.__contains__) as stage:  # the figure of the same table
        atomic_write_text(stage / "rank.md", table.to_markdown())
        atomic_write_text(stage / "rank.csv", table.to_csv())
        atomic_write_text(stage / "rank.json", json.dumps(asdict(table), indent=2) + "\n")
        plot_rank(table, stage / "rank.png")
    return {"csv": out / "rank.csv", "markdown": out / "rank.md", "json": out / "rank.json",
            "png": out / "rank.png"}
