"""Evaluation stages under bf16 vs fp32 on a CPU (#50 goal 4): PLL scoring and frozen features.

Goal 4 asks the evaluation after pre-training (PLL for BLiMP, `mlsm score` and the held-out masked
tokens; mean-pooled features for the GLUE linear probes) to run >= 2x faster under the same
precision rules as training, with the scores of a fixed checkpoint within 1e-3 of fp32, or else the
precision kept out of those stages with the measured reason. This script measures both sides on
one model, in one process, at one thread count, with the machine's fp32 and bf16 GEMM peaks
measured in the same run:

- PLL of BLiMP sentences (`score_pll`, the path `mlsm blimp`/`score` take): wall seconds of each
  precision (median of --rounds), the ratio, max and mean |delta PLL| per sentence, and how many
  BLiMP pairs change their decision (good > bad);
- `linear_probes.encode` of the same sentences (the readouts' features): wall, ratio, and the max
  |delta| of a feature relative to its row's norm.

bf16 here is `torch.autocast("cpu", dtype=torch.bfloat16)` around the same call, as
`train.precision=bf16` does for training (weights stay fp32; log_softmax runs in fp32 under
autocast). Probe fitting is a training loop and takes `train.precision`'s numbers
(bench_precision.py); it is not re-measured here.

    PYTHONPATH=src HF_HUB_OFFLINE=1 python benchmarks/bench_eval_precision.py \\
        [--model RUN_OR_CHECKPOINT] [--pairs 5] [--rounds 3] [--threads 2]

--model takes anything `mlsm blimp` scores (an MLM run or checkpoint, an MLSM run through its
probe, an HF masked-LM folder); without it, a randomly initialised BertForMaskedLM shaped like
MiniLM-L6-H384 with the packaged tokenizer (bench_pll.build_model): the time ratio does not depend
on the weights, the score deltas do, so quote deltas from a trained model.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_pll import DEFAULT_BLIMP, blimp_sentences, build_model  # noqa: E402

GOAL_RATIO = 2.0  # issue #50 goal 4: evaluation stages >= 2x faster
SCORE_TOL = 1e-3  # ... with the scores of a fixed checkpoint within 1e-3 of fp32


def _autocast(precision: str):
    import torch

    return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else nullcontext()


def _timed(fn, rounds: int) -> tuple[object, float]:
    """fn's result and the median wall seconds of `rounds` calls, after one warm-up call."""
    out = fn()
    walls = []
    for _ in range(rounds):
        start = time.perf_counter()
        out = fn()
        walls.append(time.perf_counter() - start)
    return out, statistics.median(walls)


def measure(path: str, sentences: list[str], rounds: int) -> dict:
    """Both precisions of PLL (through `load_scorer`, as `mlsm blimp`) and encode (through
    `rank.load_encoder`, as `mlsm readout`) of `path` on `sentences` (good, bad, good, ...)."""
    import numpy as np

    from mlsm.evaluate.probe.probe import load_scorer
    from mlsm.evaluate.zeroshot.linear_probes import encode
    from mlsm.evaluate.zeroshot.pll import score_pll
    from mlsm.evaluate.zeroshot.rank import load_encoder

    model, tokenizer = load_scorer(path)
    encoder, enc_tokenizer = load_encoder(path)
    out: dict = {}
    for precision in ("fp32", "bf16"):
        def pll(p=precision):
            with _autocast(p):
                return np.asarray(score_pll(model, tokenizer, sentences))

        def features(p=precision):
            with _autocast(p):
                return encode(encoder, enc_tokenizer, sentences)

        out[precision] = {"pll": _timed(pll, rounds), "encode": _timed(features, rounds)}
    return out


def glue_scores(path: str, task: str, data_dir: Path) -> None:
    """The frozen-feature linear probe of `task` (`linear_probes.probe_task`, as `mlsm readout`)
    with its features encoded in fp32 and under bf16: each metric's value both ways and the
    difference (goal 4 asks the scores, not only the features, within 1e-3)."""
    from mlsm.evaluate.zeroshot.linear_probes import probe_task
    from mlsm.evaluate.zeroshot.rank import load_encoder

    encoder, tokenizer = load_encoder(path)
    rows = {}
    for precision in ("fp32", "bf16"):
        with _autocast(precision):
            rows[precision] = {r["metric"]: r["value"]
                               for r in probe_task(encoder, tokenizer, task, data_dir)}
    print(f"\n| {task} linear probe | fp32 | bf16 | abs difference | within 1e-3 |")
    print("|---|---:|---:|---:|---|")
    for metric, value in rows["fp32"].items():
        delta = abs(value - rows["bf16"][metric])
        print(f"| {metric} | {value:.4f} | {rows['bf16'][metric]:.4f} | {delta:.4f} | "
              f"{_verdict(delta)} |")


def _verdict(delta: float) -> str:
    return "holds" if delta <= SCORE_TOL else "does not hold"


def report(res: dict, n_sentences: int, model_name: str, peaks: dict, threads: int) -> None:
    import numpy as np

    from mlsm.provenance import machine_description

    (a, ta), (b, tb) = res["fp32"]["pll"], res["bf16"]["pll"]
    delta = np.abs(a - b)
    flips = int(np.sum((a[0::2] > a[1::2]) != (b[0::2] > b[1::2])))
    acc = {p: float(np.mean(s[0::2] > s[1::2])) for p, s in (("fp32", a), ("bf16", b))}
    print(f"\nmachine: {machine_description()}; {threads} threads; model: {model_name}")
    print(f"peaks measured in this run: fp32 {peaks['fp32'] / 1e9:,.0f} GFLOP/s, "
          f"bf16 {peaks['bf16'] / 1e9:,.0f} GFLOP/s\n")
    print("| stage | fp32 (s) | bf16 (s) | bf16 speed-up | goal >= 2x | max abs delta | "
          "within 1e-3 |")
    print("|---|---:|---:|---:|---|---:|---|")
    ratio = ta / tb
    print(f"| PLL, {n_sentences} BLiMP sentences | {ta:.2f} | {tb:.2f} | {ratio:.2f}x | "
          f"{'met' if ratio >= GOAL_RATIO else 'not met'} | {delta.max():.4f} nats "
          f"(mean {delta.mean():.4f}) | {_verdict(delta.max())} |")
    (fa, ea), (fb, eb) = res["fp32"]["encode"], res["bf16"]["encode"]
    rel = np.max(np.abs(fa - fb).max(1) / np.maximum(np.linalg.norm(fa, axis=1), 1e-12))
    ratio = ea / eb
    print(f"| features (linear probes), same sentences | {ea:.2f} | {eb:.2f} | {ratio:.2f}x | "
          f"{'met' if ratio >= GOAL_RATIO else 'not met'} | {rel:.4f} of the row norm | "
          f"{_verdict(rel)} |")
    print(f"\nBLiMP pairs: {flips} of {len(a) // 2} change their decision under bf16 "
          f"(accuracy fp32 {acc['fp32']:.4f}, bf16 {acc['bf16']:.4f}).")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="run, checkpoint or HF masked-LM folder (default: random "
                                    "MiniLM-shaped BertForMaskedLM)")
    ap.add_argument("--blimp", type=Path, default=DEFAULT_BLIMP)
    ap.add_argument("--pairs", type=int, default=5, help="pairs per BLiMP phenomenon")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--glue", nargs="*", default=[], metavar="TASK",
                    help="also fit these GLUE tasks' linear probes on fp32 and bf16 features "
                         "(scores only; from --glue-dir)")
    ap.add_argument("--glue-dir", type=Path, default=DEFAULT_BLIMP.parent)
    args = ap.parse_args()
    if not args.blimp.is_dir():
        print(f"skipped: {args.blimp} is absent (pass --blimp DIR)")
        return 0
    import torch
    from common import measured_peaks

    torch.set_num_threads(args.threads)
    peaks = measured_peaks()
    sentences = blimp_sentences(args.blimp, args.pairs)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None:
            path = str(Path(tmp) / "model")
            build_model(Path(path), seed=0)
        res = measure(path, sentences, args.rounds)
        report(res, len(sentences), args.model or "random MiniLM-L6-H384 (BertForMaskedLM)",
               peaks, args.threads)
        for task in args.glue:
            glue_scores(path, task, args.glue_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
