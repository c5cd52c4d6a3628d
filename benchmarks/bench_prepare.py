"""Tokens/s of `mlsm prepare` on 1, 2, ... processes, and the projection to a 10B-token corpus.

Each process count builds a token store of the enwiki prefix (train split, MiniLM tokenizer) from
scratch; the wall-clock time covers the whole command as a user runs it (reading and gunzipping
the source, starting the workers, tokenising, writing and fsyncing the store), not the tokenizer
load. Rounds are interleaved (1, 2, ..., 1, 2, ...) and each count keeps its median. The CPU
seconds of the main process and of its workers (getrusage; workers are counted once the pool has
reaped them) say where the time went: their sum over the one-process CPU is the parallel overhead,
and the main process's share is what the workers cannot overlap. Every store must be
byte-identical to the one-process store (tokens.bin, offsets.bin, meta.json but its creation
time); the script exits 1 if one is not, 0 otherwise, and skips (exit 0) without the corpus.

    PYTHONPATH=src HF_HUB_OFFLINE=1 python benchmarks/bench_prepare.py [--max-procs N]
        [--rounds 2] [--max-docs N]   # --max-docs: only the first N documents (a quick check)
"""

from __future__ import annotations

import argparse
import gzip
import json
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

TRAIN = Path(__file__).resolve().parents[2] / "shared/data/corpus/enwiki_2015_prefix/train.jsonl.gz"
TARGET_TOKENS = 10e9
GOAL = 1.8  # speed-up wanted at 2 processes (issue 21)


def _subset(src: Path, n_docs: int, tmp: Path) -> Path:
    """The first n_docs records of src, gzipped like the original (prepared before timing)."""
    out = tmp / "subset.jsonl.gz"
    with gzip.open(src, "rb") as fin, gzip.open(out, "wb") as fout:
        for i, line in enumerate(fin):
            if i == n_docs:
                break
            fout.write(line)
    return out


def _store_digest(store: Path) -> tuple[bytes, bytes, str]:
    meta = json.loads((store / "meta.json").read_text())
    meta.pop("created")
    return ((store / "tokens.bin").read_bytes(), (store / "offsets.bin").read_bytes(),
            json.dumps(meta, sort_keys=True))


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def _time_one(source: Path, tok, out: Path, n: int) -> tuple[float, int, float, float]:
    """(wall seconds, tokens, CPU seconds of this process, CPU seconds of its workers)."""
    from mlsm.data.corpus import prepare_corpus

    shutil.rmtree(out, ignore_errors=True)
    main0, workers0 = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    store = prepare_corpus(str(source), tok, out, num_proc=n)
    seconds = time.perf_counter() - t0
    return (seconds, store.n_tokens, _cpu(resource.RUSAGE_SELF) - main0,
            _cpu(resource.RUSAGE_CHILDREN) - workers0)


def _report(counts: list[int], times: dict, cpus: dict, n_tokens: int) -> None:
    base = statistics.median(times[1])
    base_cpu = statistics.median(sum(c) for c in cpus[1])
    print("| processes | seconds | tokens/s | speed-up | CPU s main | CPU s workers "
          "| CPU / 1 process | hours for 10B tokens |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in counts:
        sec = statistics.median(times[n])
        main_cpu = statistics.median(c[0] for c in cpus[n])
        workers_cpu = statistics.median(c[1] for c in cpus[n])
        rate = n_tokens / sec
        hours = TARGET_TOKENS / rate / 3600
        print(f"| {n} | {sec:.1f} | {rate:,.0f} | {base / sec:.2f}x | {main_cpu:.1f} "
              f"| {workers_cpu:.1f} | {(main_cpu + workers_cpu) / base_cpu:.2f} | {hours:,.1f} |")
    if 2 in counts:
        ratio = base / statistics.median(times[2])
        verdict = "met" if ratio >= GOAL else "NOT met"
        print(f"2 processes: {n_tokens / statistics.median(times[2]):,.0f} tokens/s against "
              f"{n_tokens / base:,.0f} on 1 = {ratio:.2f}x; goal >= {GOAL}x: {verdict}")


def main() -> int:
    from mlsm.data.corpus import load_tokenizer
    from mlsm.data.shards import default_num_proc
    from mlsm.teacher.teacher import default_teacher_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-procs", type=int, default=default_num_proc())
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-docs", type=int, default=None, help="only the first N documents")
    args = ap.parse_args()
    if not TRAIN.is_file():
        print(f"skipped: {TRAIN} not found")
        return 0
    tok = load_tokenizer(str(default_teacher_path()))
    counts = list(range(1, max(1, args.max_procs) + 1))
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        source = _subset(TRAIN, args.max_docs, tmp) if args.max_docs else TRAIN
        times: dict[int, list[float]] = {n: [] for n in counts}
        cpus: dict[int, list[tuple[float, float]]] = {n: [] for n in counts}
        digests: dict[int, tuple[bytes, bytes, str]] = {}
        for _ in range(args.rounds):
            for n in counts:
                seconds, n_tokens, main_cpu, workers_cpu = _time_one(source, tok,
                                                                    tmp / f"store{n}", n)
                times[n].append(seconds)
                cpus[n].append((main_cpu, workers_cpu))
                digests[n] = _store_digest(tmp / f"store{n}")
        same = all(digests[n] == digests[1] for n in counts)
    print(f"source: {source.name if args.max_docs else TRAIN}, {n_tokens:,} tokens; "
          f"median of {args.rounds} round(s)")
    _report(counts, times, cpus, n_tokens)
    print("stores identical across process counts:", "yes" if same else "NO")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
