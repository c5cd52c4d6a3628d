"""The artifacts layer: one module per kind of folder or file mlsm writes, each the only place that
writes it, reads it, verifies it and guards it, plus the fingerprints every reuse compares.

It stands above the file helpers (`mlsm.fileio`, `mlsm.inputs`, `mlsm.locking`) and below the
models, teacher, objectives and everything that trains or evaluates: a reader of a checkpoint or a
run folder never needs to import an objective to understand it.

- `fingerprint`: content fingerprints and the one rule of reuse (`require_same`).
- `checkpoint`: a checkpoint folder (`Checkpoint.open(SPEC)`: FOLDER, RUN, RUN@50%, RUN@step-N or
  any HF folder), its atomic write, verification, listing and removal.
- `run_spec`: what RUN, RUN@50% and RUN@step-N name among a run's checkpoints (no file read).
- `rundir`: a run directory (`RunDir`): run.json, config.yaml, metrics.jsonl, pruning, the same-run
  check and the input fingerprints a resume compares.
- `probe_record`: a probe run's probe.json (which checkpoint holds the probe, how good it is).
- `outputs`, `jsonl`: the one output-folder guard and lock; the one JSON-lines reader and appender.
- `legacy`: which older forms of mlsm 0.1.0's folders are still read, where, and until when.
"""
