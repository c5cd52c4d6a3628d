"""mlsm inside the libraries users already train and serve with.

- `mlsm.integrations.transformers`: `MLSMTrainer`, a `transformers.Trainer` that trains with an mlsm
  objective (MLSM, KD, MTL, MLM) and writes checkpoints mlsm's evaluation verbs read
  (docs/huggingface.md).
- `mlsm.integrations.export`: `mlsm export`, a checkpoint or any HF encoder folder to a folder for
  the Hub, with its model card (`mlsm.integrations.model_card`; docs/export.md).
- `mlsm.integrations.sentence_transformers`: `mlsm export --format sentence-transformers`, a folder
  that `SentenceTransformer(path)` loads (docs/export.md).
"""
