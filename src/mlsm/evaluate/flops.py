"""Training FLOPs per batch: moved to `mlsm.flops`, below `mlsm.throughput` (which counts a run's
FLOP/s from it) so no arrow runs back up from throughput into evaluate. These names stay importable
from here for code written against the old place; new code imports `mlsm.flops`."""

from __future__ import annotations

from mlsm.flops import (
    ACCOUNTING_LABELS,
    ACCOUNTINGS,
    KNOWN_SHAPES,
    PAPER_BATCH,
    FlopRow,
    Shape,
    encoder_flops,
    fista_flops,
    flops_for_run,
    flops_table,
    format_table,
    latent_head_flops,
    naive_head_flops,
    relative_attention_flops,
    shape_of,
    sparse_coding_flops,
    teacher_shape_config,
    vocab_head_flops,
)

__all__ = ["ACCOUNTINGS", "ACCOUNTING_LABELS", "KNOWN_SHAPES", "PAPER_BATCH", "FlopRow", "Shape",
           "encoder_flops", "fista_flops", "flops_for_run", "flops_table", "format_table",
           "latent_head_flops", "naive_head_flops", "relative_attention_flops", "shape_of",
           "sparse_coding_flops", "teacher_shape_config", "vocab_head_flops"]
