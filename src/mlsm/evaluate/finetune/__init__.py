"""The fine-tuning suite: tasks and their metrics, one cell (classification, token
classification, extractive QA, retrieval), the cell key and its reuse, presets, and the grid
`finetune()` runs. Imports only `mlsm.evaluate.compare` of the other wings."""
