"""Held-out masked-token readouts: loss, top-1 and pseudo-perplexity beside the unigram baseline.

A masked LM that ignores context can still reach the unigram distribution's loss and top-1 (always
the most frequent token); what it learned from context is the distance below that plateau. Both
are computed on the same targets: the positions a run's own masking selects in held-out chunks (a
store of held-out documents, or the chunks right after the run's last batch). MLSM models are read
through their k -> |V| probe (`mlsm.evaluate.probe.probe.ProbeScorer`).

PPPL (Salazar et al. 2020, §2.3): exp(−(1/N) Σ_t log P(w_t | W∖t)) over the N non-special tokens
of held-out chunks, each token masked in turn; the unigram's PPPL on the same tokens is
exp(−mean log p(w)).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mlsm.artifacts.checkpoint import COMPLETE, Checkpoint
from mlsm.errors import UserError


def heldout_steps(checkpoint: Path | Checkpoint, batch_size: int, n: int) -> list[int]:
    """Steps (of a run with `batch_size` sequences a step) whose batches hold only samples after
    the last one the checkpoint's pre-training run consumed: held-out chunks (within one epoch)."""
    ck = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint.at(checkpoint)
    cfg = ck.section("train")
    if not ck.is_checkpoint or "steps" not in cfg or "batch_size" not in cfg:
        raise UserError(f"{ck.folder / COMPLETE} has no train config; pass an intact "
                        "checkpoints/step-* folder")
    # ceil(samples seen / batch_size)
    first = -(-int(cfg["steps"]) * int(cfg["batch_size"]) // batch_size)
    return [first + j for j in range(n)]


def binomial_p(k: int, n: int, p: float) -> float:
    """Two-sided exact binomial test of k successes in n trials against rate p (SciPy's
    binomtest): how surprising a top-1 count would be at the unigram's rate. NaN when there is
    nothing to test."""
    from scipy.stats import binomtest

    if n <= 0 or not 0 < p < 1:
        return float("nan")
    return float(binomtest(int(k), int(n), p).pvalue)


def masked_token_scores(scorer: Any, source: Any, steps: list[int], batch_size: int,
                        unigram: torch.Tensor) -> dict[str, Any]:
    """Loss (nats) and top-1 of `scorer` on the selected positions of batches `steps` of a
    `BatchSource`, and of the unigram log-probabilities (V,) on the same targets."""
    from mlsm.evaluate.zeroshot.pll import as_scorer

    scorer = as_scorer(scorer)
    loss, correct, uni_loss, uni_correct, n = 0.0, 0, 0.0, 0, 0
    best = int(unigram.argmax())
    for step in steps:
        b = source.micro_batches(step, batch_size, batch_size, 0, 1)[0]
        with torch.no_grad():
            logits = scorer.logits_at(b.corrupted_ids, b.attention_mask,
                                      b.selected).float()  # (N, V)
        y = b.input_ids[b.selected]  # (N,)
        loss += F.cross_entropy(logits, y, reduction="sum").item()
        correct += int((logits.argmax(-1) == y).sum())
        uni_loss -= unigram[y].sum().item()
        uni_correct += int((y == best).sum())
        n += y.numel()
    m = max(n, 1)
    return {"loss": loss / m, "top1": correct / m, "n": n, "correct": correct,
            "unigram_loss": uni_loss / m, "unigram_top1": uni_correct / m,
            "p_vs_unigram": binomial_p(correct, n, uni_correct / m)}


def pppl(scorer: Any, source: Any, steps: list[int], batch_size: int, unigram: torch.Tensor,
         mask_id: int, copies_per_pass: int = 128) -> dict[str, float]:
    """Pseudo-perplexity of the non-special tokens of batches `steps` (each masked in turn, one
    copy of its sequence per token) and the unigram's perplexity on the same tokens."""
    from mlsm.evaluate.zeroshot.pll import as_scorer

    scorer = as_scorer(scorer)
    total, uni, n = 0.0, 0.0, 0
    for step in steps:
        b = source.micro_batches(step, batch_size, batch_size, 0, 1)[0]
        rows, cols = torch.nonzero(~b.special_mask & b.attention_mask.bool(), as_tuple=True)
        for start in range(0, len(rows), copies_per_pass):
            r, c = rows[start:start + copies_per_pass], cols[start:start + copies_per_pass]
            ids = b.input_ids[r].clone()  # (C, T): one copy per scored token
            target = ids[torch.arange(len(r)), c]  # (C,)
            ids[torch.arange(len(r)), c] = mask_id
            select = torch.zeros_like(ids, dtype=torch.bool)
            select[torch.arange(len(r)), c] = True
            with torch.no_grad():
                logits = scorer.logits_at(ids, b.attention_mask[r], select).float()  # (C, V)
            total -= F.cross_entropy(logits, target, reduction="sum").item()
            uni += unigram[target].sum().item()
            n += len(r)
    m = max(n, 1)
    return {"pppl": math.exp(-total / m), "unigram_ppl": math.exp(-uni / m), "n": n}


def heldout_masked_tokens(scorer: Any, checkpoint: Path, n_batches: int, batch_size: int,
                          store: str | None = None) -> dict[str, Any]:
    """Masked-token loss and top-1 of a scorer on held-out text, with the run's own masking, next
    to the unigram distribution of the tokens the run trains on, on the same targets (the plateau
    an MLM sits on before it uses context) and a binomial test of top-1 against the unigram's rate.

    store: a token store of held-out documents (batches 0, 1, ... of it); None = the chunks right
    after the pre-training run's last batch, which are held out only while the run stays within
    its first epoch of the corpus."""
    from mlsm.evaluate.zeroshot.unigram import unigram_log_probs

    source, steps, _ = heldout_source(checkpoint, n_batches, batch_size, store)
    unigram = unigram_log_probs(checkpoint)  # (V,): of the run's own tokens; by target ids only
    return {**masked_token_scores(scorer, source, steps, batch_size, unigram),
            "text": "held-out store" if store else "chunks after the run"}


def heldout_source(checkpoint: Path, n_batches: int, batch_size: int,
                   store: str | None = None) -> tuple[Any, list[int], Any]:
    """(BatchSource with the run's data config, held-out steps, the run's training TokenStore)."""
    from mlsm.artifacts.checkpoint import Checkpoint
    from mlsm.data.batches import BatchSource
    from mlsm.data.corpus import TokenStore
    from mlsm.run_config import config_from_dict

    ck = Checkpoint.at(checkpoint)
    if not isinstance(ck.info.get("config"), dict):
        raise UserError(f"checkpoint file {ck.folder / 'checkpoint.json'} has no config; restore "
                        "it from a copy of the checkpoint")
    cfg = config_from_dict(ck.config)
    train = TokenStore.open(cfg.data.store)
    source_store = TokenStore.open(store) if store else train
    source = BatchSource(source_store, cfg.data, source_store.load_tokenizer())
    steps = list(range(n_batches)) if store else heldout_steps(ck, batch_size, n_batches)
    return source, steps, train
