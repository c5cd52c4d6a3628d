"""Dense retrieval with a bi-encoder: mean pooling, InfoNCE, exact search, IR metrics.

The protocol of Gisserot-Boukhlef et al. 2025 ("Should we still pretrain encoders with MLM?"):
one shared encoder embeds queries and documents by **mean pooling** its last hidden states over
the attention mask; training minimises **InfoNCE with in-batch negatives** (each query's positive
document, the other queries' positives as negatives); evaluation ranks the whole corpus by exact
search and reports nDCG@10 (plus Recall@100 and MRR@10).

Similarity is the **cosine** (embeddings are L2-normalised) divided by a temperature τ = 0.05,
the setting of sentence-transformers' ``MultipleNegativesRankingLoss`` (scale 20 = 1/τ with
cosine similarity) and of SimCSE (Gao et al. 2021). Metrics come from ``pytrec_eval`` (the
trec_eval C code), never hand-written. Corpus embeddings are cached per checkpoint *content*: a
fingerprint of the weights, the tokenizer, ``max_len`` and the corpus; a cache file whose
fingerprint differs is never read.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytrec_eval
import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from mlsm.evaluate.finetune.beir import BeirSplit, Qrels
from mlsm.fileio import atomic_write
from mlsm.progress import Progress

TEMPERATURE = 0.05  # τ: sentence-transformers MultipleNegativesRankingLoss (scale 20), SimCSE
TOP_K = 100  # documents kept per query: enough for Recall@100
METRICS = ("ndcg@10", "recall@100", "mrr@10")  # result-row metric names


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of the hidden states over the tokens the attention mask keeps.

    hidden (B, T, d), mask (B, T) of 0/1 -> (B, d)."""
    m = mask.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)


def embed(backbone: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """L2-normalised mean-pooled embeddings (B, d) of a padded batch."""
    hidden = backbone(**inputs).last_hidden_state  # (B, T, d)
    return F.normalize(mean_pool(hidden, inputs["attention_mask"]).float(), dim=-1)


def info_nce(q: torch.Tensor, d: torch.Tensor, temperature: float = TEMPERATURE,
             doc_keys: Sequence[str] | None = None) -> torch.Tensor:
    """InfoNCE with in-batch negatives: cross-entropy of (q_i · d_j / τ) over j, target j = i.

    q, d: (B, d) embeddings (already normalised for cosine similarity). ``doc_keys``: the id of
    each positive; when two queries of a batch share a positive document, that document is not
    a negative for either (its other copies are masked out of the row), so a batch never asks
    the model to push a query away from its own relevant document."""
    logits = q @ d.T / temperature  # (B, B)
    if doc_keys is not None:
        keys = list(doc_keys)
        same = torch.tensor([[a == b for b in keys] for a in keys], device=logits.device)
        same.fill_diagonal_(False)
        logits = logits.masked_fill(same, float("-inf"))
    target = torch.arange(len(q), device=q.device)
    return F.cross_entropy(logits, target)


# ----------------------------------------------------------------------------- encoding


def tokenize(tokenizer: Any, texts: Sequence[str], max_len: int) -> list[dict[str, list[int]]]:
    """Token ids per text, truncated to ``max_len``, not padded."""
    if not texts:  # a zero-shot task's training set
        return []
    enc = tokenizer(list(texts), truncation=True, max_length=max_len)
    return [{k: enc[k][i] for k in enc} for i in range(len(texts))]


def pad(tokenizer: Any, feats: Sequence[dict[str, list[int]]],
        device: torch.device) -> dict[str, torch.Tensor]:
    """A padded batch (B, T) on ``device``."""
    batch = tokenizer.pad(list(feats), return_tensors="pt")
    return {k: v.to(device) for k, v in batch.items()}


@torch.no_grad()
def encode(backbone: torch.nn.Module, tokenizer: Any, texts: Sequence[str], max_len: int,
           device: torch.device, batch_size: int = 64) -> torch.Tensor:
    """Normalised embeddings (N, d), float32 on CPU, in input order.

    Batches are formed from length-sorted texts, so a batch pads to similar lengths."""
    backbone.eval()
    feats = tokenize(tokenizer, texts, max_len)
    order = sorted(range(len(feats)), key=lambda i: len(feats[i]["input_ids"]))
    out: torch.Tensor | None = None
    bar = Progress(len(texts), "encode", "text", leave=False)  # a large corpus takes a while
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        vecs = embed(backbone, pad(tokenizer, [feats[i] for i in idx], device)).cpu()
        if out is None:
            out = torch.empty(len(texts), vecs.shape[1])
        out[torch.tensor(idx)] = vecs
        bar.update(len(idx))
    bar.close()
    assert out is not None  # a BeirSplit's corpus is never empty
    return out


def fingerprint(backbone: torch.nn.Module, tokenizer: Any, texts: Sequence[str],
                ids: Sequence[str], max_len: int) -> str:
    """sha256 of what decides the corpus embeddings: weights, tokenizer, max_len, the corpus."""
    from mlsm.data.corpus import tokenizer_hash

    h = hashlib.sha256()
    for name, tensor in sorted(backbone.state_dict().items()):
        h.update(name.encode())
        h.update(str(tensor.dtype).encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    h.update(f"{type(backbone).__name__}|{tokenizer_hash(tokenizer)}|{max_len}|mean|cos".encode())
    for key, text in zip(ids, texts, strict=True):
        h.update(f"{len(key)}:{key}{len(text)}:{text}".encode())
    return h.hexdigest()


def encode_corpus(backbone: torch.nn.Module, tokenizer: Any, split: BeirSplit, max_len: int,
                  device: torch.device, cache_dir: str | Path | None = None) -> torch.Tensor:
    """The corpus embeddings (N, d), read from ``cache_dir/<fingerprint>.safetensors`` when a
    cache of this very checkpoint and corpus is there, else encoded (and cached)."""
    if cache_dir is None:
        return encode(backbone, tokenizer, split.doc_texts, max_len, device)
    key = fingerprint(backbone, tokenizer, split.doc_texts, split.doc_ids, max_len)
    path = Path(cache_dir) / f"{key}.safetensors"
    cached = _read_cache(path, key, len(split.doc_ids))
    if cached is not None:
        return cached
    vecs = encode(backbone, tokenizer, split.doc_texts, max_len, device)
    atomic_write(path, lambda tmp: save_file({"embeddings": vecs}, tmp,
                                             metadata={"fingerprint": key}))
    return vecs


def _read_cache(path: Path, key: str, n_docs: int) -> torch.Tensor | None:
    """The cached embeddings, or None when absent, torn, or not this fingerprint's."""
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), "pt") as f:
            if (f.metadata() or {}).get("fingerprint") != key:
                return None
        vecs = load_file(str(path))["embeddings"]
    except (SafetensorError, OSError, KeyError):
        return None  # a damaged cache is recomputed and replaced
    return vecs if vecs.ndim == 2 and vecs.shape[0] == n_docs else None


# ----------------------------------------------------------------------------- search, metrics


def search(queries: torch.Tensor, docs: torch.Tensor, k: int = TOP_K, query_chunk: int = 256,
           doc_chunk: int = 65536) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k by inner product (cosine for normalised rows): scores and indices (Q, k').

    k' = min(k, N). Works in (query_chunk × doc_chunk) blocks, merging each block's top-k with
    the running best, so memory stays bounded on large corpora."""
    k = min(k, len(docs))
    all_scores, all_idx = [], []
    for qs in range(0, len(queries), query_chunk):
        q = queries[qs:qs + query_chunk]  # (Qc, d)
        best_s = torch.full((len(q), 0), float("-inf"))
        best_i = torch.zeros((len(q), 0), dtype=torch.long)
        for ds in range(0, len(docs), doc_chunk):
            s = q @ docs[ds:ds + doc_chunk].T  # (Qc, Dc)
            top_s, top_i = torch.topk(s, min(k, s.shape[1]), dim=1)
            best_s, pick = torch.topk(torch.cat([best_s, top_s], 1), min(k, best_s.shape[1]
                                                                             + top_s.shape[1]), 1)
            best_i = torch.cat([best_i, top_i + ds], 1).gather(1, pick)
        all_scores.append(best_s)
        all_idx.append(best_i)
    return torch.cat(all_scores), torch.cat(all_idx)


def ir_metrics(qrels: Qrels, run: dict[str, dict[str, float]]) -> dict[str, float]:
    """nDCG@10, Recall@100 and MRR@10 by ``pytrec_eval``, averaged over the queries of ``qrels``.

    MRR@10 is trec_eval's reciprocal rank on each query's top 10 (a relevant document first
    found below rank 10 counts 0). A query of ``qrels`` missing from ``run`` scores 0."""
    if not qrels:
        return dict.fromkeys(METRICS, 0.0)
    full = {q: run.get(q, {}) for q in qrels}
    top10 = {q: dict(sorted(docs.items(), key=lambda kv: (-kv[1], kv[0]))[:10])
             for q, docs in full.items()}
    per_q = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10", "recall.100"}).evaluate(full)
    rr = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"}).evaluate(top10)
    n = len(qrels)
    return {"ndcg@10": sum(per_q.get(q, {}).get("ndcg_cut_10", 0.0) for q in qrels) / n,
            "recall@100": sum(per_q.get(q, {}).get("recall_100", 0.0) for q in qrels) / n,
            "mrr@10": sum(rr.get(q, {}).get("recip_rank", 0.0) for q in qrels) / n}


def to_run(query_ids: Sequence[str], doc_ids: Sequence[str], scores: torch.Tensor,
           idx: torch.Tensor) -> dict[str, dict[str, float]]:
    """A trec run {query: {document: score}} from search output; a document whose id equals the
    query's is left out (BEIR's ``ignore_identical_ids``: ArguAna and Quora hold the queries in
    the corpus)."""
    run: dict[str, dict[str, float]] = {}
    for q, row_s, row_i in zip(query_ids, scores.tolist(), idx.tolist(), strict=True):
        run[q] = {doc_ids[i]: s for s, i in zip(row_s, row_i, strict=True) if doc_ids[i] != q}
    return run


def evaluate_split(backbone: torch.nn.Module, tokenizer: Any, split: BeirSplit, max_len: int,
                   device: torch.device, cache_dir: str | Path | None = None,
                   docs: torch.Tensor | None = None) -> dict[str, float]:
    """Encode the corpus (cached) and the queries, search exactly, score with pytrec_eval.
    ``docs``: the corpus embeddings, when this encoder has encoded this corpus already."""
    if docs is None:
        docs = encode_corpus(backbone, tokenizer, split, max_len, device, cache_dir)
    qids = list(split.queries)
    queries = encode(backbone, tokenizer, [split.queries[q] for q in qids], max_len, device)
    scores, idx = search(queries, docs, TOP_K + 1)  # one spare for an identical id dropped
    run = to_run(qids, split.doc_ids, scores, idx)
    return ir_metrics(split.qrels, {q: dict(list(d.items())[:TOP_K]) for q, d in run.items()})
