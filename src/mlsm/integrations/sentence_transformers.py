"""`mlsm export --format sentence-transformers`: the files that make an exported HF folder a
sentence-transformers model (encoder -> mean pooling -> optional L2 normalisation).

The folder keeps the Hub layout of `mlsm export` (config, weights, tokenizer at its root) and adds
the module description every sentence-transformers release reads (`modules.json`,
`sentence_bert_config.json`, `1_Pooling/config.json`, `2_Normalize/`), written as plain JSON so the
export itself needs no sentence-transformers; `SentenceTransformer(folder)` then loads it offline.
Mean pooling averages the last hidden states over the real tokens (attention mask 1), special
tokens included, as sentence-transformers and the retrieval evaluation of Gisserot-Boukhlef et
al. (2025) do.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FORMAT = "sentence-transformers"


def write_modules(folder: Path, *, hidden_size: int, max_seq_length: int,
                  normalize: bool) -> dict[str, Any]:
    """Write the module files into `folder` (an exported HF folder); returns what the card and
    mlsm.json record."""
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
        (folder / "2_Normalize").mkdir()
    (folder / "modules.json").write_text(json.dumps(modules, indent=2))
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": max_seq_length, "do_lower_case": False}, indent=2))
    (folder / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": hidden_size, "pooling_mode_cls_token": False,
               "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False,
               "pooling_mode_mean_sqrt_len_tokens": False}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))
    (folder / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": {}, "default_prompt_name": None,
                    "similarity_fn_name": "cosine"}, indent=2))
    return {"format": FORMAT, "pooling": "mean", "normalize": normalize,
            "max_seq_length": max_seq_length, "dimension": hidden_size}


def card_header(header: dict[str, Any]) -> dict[str, Any]:
    """The Hub metadata of a sentence-transformers model."""
    return {**header, "library_name": "sentence-transformers",
            "pipeline_tag": "sentence-similarity",
            "tags": [*header.get("tags", []), "sentence-transformers", "feature-extraction"]}


def card_section(st: dict[str, Any]) -> str:
    """How to embed with it, and how to run MTEB on it."""
    norm = "L2-normalised " if st["normalize"] else ""
    return "\n".join([
        "## Sentence embeddings", "",
        f"A sentence-transformers model: the encoder, mean pooling over the real tokens, "
        f"{norm}{st['dimension']}-dimensional embeddings, inputs cut at "
        f"{st['max_seq_length']} tokens. The encoder was pre-trained only (no contrastive "
        "fine-tuning): fine-tune it for retrieval before comparing with trained embedders.", "",
        "```python", "from sentence_transformers import SentenceTransformer", "",
        'model = SentenceTransformer("REPO")  # or a local folder',
        'embeddings = model.encode(["A sentence.", "Another one."])', "```", "",
        "Evaluate it on MTEB (`pip install mteb`):", "",
        "```python", "import mteb", "from sentence_transformers import SentenceTransformer", "",
        'model = SentenceTransformer("LOCAL_FOLDER")',
        'tasks = mteb.get_tasks(tasks=["SciFact", "STSBenchmark"])',
        'results = mteb.evaluate(model, tasks=tasks)  # older mteb: '
        'mteb.MTEB(tasks=tasks).run(model)', "```", ""])
