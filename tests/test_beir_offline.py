"""MTEB-style retrieval offline, on a local BEIR folder (docs/export.md): sentence-transformers'
`InformationRetrievalEvaluator` fed by `mlsm.evaluate.finetune.beir.read_beir`, and mlsm's own
zero-shot retrieval (`--tasks beir:NAME_zeroshot --data-dir`), give the same nDCG@10 for the same
mean-pooled encoder."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("sentence_transformers")

from sentence_transformers import SentenceTransformer  # noqa: E402

try:  # sentence-transformers 6 moved it (the old path warns)
    from sentence_transformers.sentence_transformer.evaluation import (
        InformationRetrievalEvaluator,
    )
except ImportError:  # sentence-transformers < 6
    from sentence_transformers.evaluation import InformationRetrievalEvaluator

from mlsm.artifacts.results_file import read_results  # noqa: E402
from mlsm.evaluate.finetune.beir import read_beir  # noqa: E402
from mlsm.evaluate.finetune.finetune import finetune  # noqa: E402
from mlsm.integrations.sentence_transformers import write_modules  # noqa: E402
from tests.test_retrieval import _beir, _model  # noqa: E402


def st_ndcg_at_10(model_folder: Path, beir_folder: Path, split: str = "test") -> float:
    """The route docs/export.md gives: a local BEIR split through sentence-transformers'
    evaluator (cosine similarity, as MTEB's retrieval tasks score)."""
    data = read_beir(beir_folder, split)
    evaluator = InformationRetrievalEvaluator(
        queries=data.queries, corpus=dict(zip(data.doc_ids, data.doc_texts, strict=True)),
        relevant_docs={q: set(docs) for q, docs in data.qrels.items()}, ndcg_at_k=[10],
        name=beir_folder.name, show_progress_bar=False)
    model = SentenceTransformer(str(model_folder), device="cpu", local_files_only=True)
    scores = evaluator(model)
    return scores[f"{beir_folder.name}_cosine_ndcg@10"]


def test_sentence_transformers_route_equals_mlsm_zero_shot_retrieval(tokenizer_dir: Path,
                                                                      tmp_path: Path) -> None:
    folder = _beir(tmp_path / "data")
    model = _model(tokenizer_dir, tmp_path / "st", positions=64)
    write_modules(model, hidden_size=32, max_seq_length=64, normalize=False)
    results = tmp_path / "r.jsonl"
    finetune([f"st={model}"], ["beir:toy_zeroshot"], results=results, seeds=(0,),
             data_dir=folder.parent, device="cpu")
    (ours,) = [r["value"] for r in read_results(results) if r["metric"] == "ndcg@10"]
    assert 0 < ours < 1  # a ranking with hits and misses: the comparison can tell them apart
    assert st_ndcg_at_10(model, folder) == pytest.approx(ours, abs=1e-6)
