"""The artifacts layer: one module per kind of folder or file mlsm writes, each the only place that
writes it, reads it, verifies it and guards it, plus the fingerprints every reuse compares.

It stands above the file helpers (`mlsm.fileio`, `mlsm.inputs`, `mlsm.locking`) and below the
models, teacher, objectives and everything that trains or evaluates: a reader of a checkpoint or a
run folder never needs to import an objective to understand it.
"""
