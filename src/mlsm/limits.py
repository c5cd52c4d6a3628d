"""Bounds on the work a small input may ask for, each checked before memory is allocated.

A 285 KB gzip can hold one 200 MB line, a config.json can claim 20,000 layers, a flag can ask for
two billion vectors: each used to run for minutes, or abort deep inside a library, before any
check. Each limit here is generous for real use, refused in one line that names it and the flag
(or key) that raises it, and torch-free so that the CLI's defaults and `--help` stay fast.
docs/reliability.md ("Bounded inputs") lists them with their tests.
"""

from __future__ import annotations

MAX_DOC_BYTES = 16 << 20
"""The longest document read from a corpus source, in bytes of UTF-8 (`prepare` /
`train-tokenizer --max-doc-bytes`): a line of a .jsonl or text file, a text document without a
blank line for that long past its unit, a record of an hf: dataset. A 200 MB line took 8.5 GB in
the tokeniser. Evaluation data is held to it too, in characters: a line of a BEIR file (a
document, a query), a SQuAD context or question."""

MAX_JSON_FILE_BYTES = 1 << 30
"""The largest JSON document read whole (a SQuAD train/dev file: the official ones are 30-40 MB),
in bytes, checked before it is read (gzipped: as it is decompressed): every JSON file read whole
(`mlsm.inputs.read_json`) is held to it."""

MAX_MODEL_JSON_BYTES = 256 << 20
"""The largest JSON file of a model folder read whole (config.json, tokenizer.json, ...), in bytes,
checked before it is read: a real tokenizer.json is a few MB (tens for the largest vocabularies);
a hand-made one of hundreds of MB was read whole (and parsed) by the vocabulary check."""

MAX_ROW_BYTES = 16 << 20
"""The longest line of a JSON-lines file mlsm appends to and reads back (results.jsonl,
readouts, metrics.jsonl, stages.jsonl, `mlsm score` rows), in bytes, read that far only: mlsm's
rows are under a few KB, and a corrupted or hand-made file of one giant line was read whole."""

MAX_QRELS_GRADE = 1_000
"""The largest relevance grade (in absolute value) of a qrels line: BEIR's are 0-2, TREC's up to
4; a grade of 1e30 reached pytrec_eval's C int and died in SystemError."""

MAX_SENTENCE_CHARS = 20_000
"""The longest sentence PLL scores, in characters (`mlsm blimp --max-sentence-chars`), checked
before tokenising (a 100 MB "sentence" took gigabytes there); a sentence must also fit the
model's positions, which is checked after."""

MAX_MODEL_PARAMS = 20_000_000_000
"""The most parameters of a model mlsm builds or loads, estimated from its config.json before
anything is built (a config claiming 20,000 layers built for a minute before it was refused): the
default of `model.max_params` for a from-scratch student, and the bound on every model folder
loaded (`hf.check_parts_agree`)."""

def transformer_params(vocab_size: int, hidden: int, layers: int, intermediate: int,
                       positions: int) -> int:
    """Parameters of a BERT-style encoder, from its config's sizes: embeddings (tokens and
    positions) plus, per layer, attention (4 d^2 + 4 d), feed-forward (2 d i + d + i) and two
    layer norms (4 d). An estimate for the size check, exact for BERT without the pooler."""
    per_layer = 4 * hidden * hidden + 4 * hidden + 2 * hidden * intermediate + hidden \
        + intermediate + 4 * hidden
    return (vocab_size + positions) * hidden + layers * per_layer

MAX_YAML_BYTES = 4 << 20
"""The largest YAML file read (a recipe, a study file, a run's config.yaml; mlsm's are a few KB),
in bytes, checked before it is read: PyYAML parses in pure Python, megabytes a second."""

MAX_YAML_NODES = 1_000_000
"""The most values a YAML document may hold once its aliases are expanded: nine nested lists of
nine aliases each (`&a [x, ...]`, `&b [*a, ...]`, ...), a few hundred bytes, stand for 387 million
values; the first reader that walked them (a type check printing the value) died in MemoryError
after 47 s."""
