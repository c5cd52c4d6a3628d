"""Is a bf16 run's loss curve within the seed-to-seed spread of fp32 runs of the same config?

Issue #50's parity check before `train.precision=auto` may pick bf16 on a CPU: one run in bf16
(the candidate) against several fp32 seeds of the same config (the reference: e.g. the published
v2 MLM arm, `docs/results/cpu_replication_v2/seeds0-4/metrics/mlm-s*.jsonl`). The candidate
shares its batches and initial weights with one reference seed (same `train.seed`, checked by
the logged `batch_digest`), so the script prints two figures:

1. the spread: at each logged step the loss averaged over a window of `--window` logged rows
   (single steps are noisy), and whether the candidate lies within [min, max] of the reference
   seeds there; the share of steps where it does;
2. the paired difference: candidate minus its own fp32 seed, over the last `--tail` logged rows,
   against the seed-to-seed standard deviation of that tail's mean (the noise a precision change
   has to stay under).

Usage: python benchmarks/precision_parity.py CANDIDATE/metrics.jsonl REF_SEED0.jsonl REF_SEED1.jsonl
       ... [--window 10] [--tail 25]
(the first reference must be the candidate's own seed).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def _losses(path: Path) -> tuple[list[int], list[float], list[int]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if isinstance(r.get("loss"), (int, float))]
    return ([r["step"] for r in rows], [float(r["loss"]) for r in rows],
            [r.get("batch_digest") for r in rows])


def _smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over `window` values (fewer at the start)."""
    return [statistics.fmean(values[max(0, i + 1 - window):i + 1]) for i in range(len(values))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("candidate", type=Path)
    ap.add_argument("references", type=Path, nargs="+")
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--tail", type=int, default=25)
    args = ap.parse_args()
    steps, cand, digests = _losses(args.candidate)
    refs = [_losses(p) for p in args.references]
    n = min(len(steps), *(len(r[0]) for r in refs))
    if any(r[0][:n] != steps[:n] for r in refs):
        raise SystemExit("the runs logged different steps; compare runs with the same log_every")
    same = digests[:n] == refs[0][2][:n]
    print(f"candidate {args.candidate}: {n} logged rows compared (steps {steps[0]}..{steps[n - 1]})"
          f"; batches {'identical to' if same else 'DIFFERENT from'} the first reference's")
    smooth_c = _smooth(cand[:n], args.window)
    smooth_r = [_smooth(r[1][:n], args.window) for r in refs]
    columns = list(zip(*smooth_r, strict=True))  # per logged step: the reference seeds' values
    inside = [min(col) <= c <= max(col) for c, col in zip(smooth_c, columns, strict=True)]
    print("\n| step | candidate | reference min | reference mean | reference max | inside |")
    print("|---:|---:|---:|---:|---:|:---:|")
    marks = sorted({*range(args.window - 1, n, max(1, n // 10)), n - 1})
    for i in marks:
        col = [r[i] for r in smooth_r]
        print(f"| {steps[i]} | {smooth_c[i]:.4f} | {min(col):.4f} | {statistics.fmean(col):.4f} |"
              f" {max(col):.4f} | {'yes' if inside[i] else 'no'} |")
    print(f"\nsmoothed loss inside the fp32 seeds' [min, max]: {sum(inside)}/{n} logged steps "
          f"({100 * sum(inside) / n:.0f} %)")
    tail = slice(n - args.tail, n)
    tails = [statistics.fmean(r[1][tail]) for r in refs]
    sd = statistics.stdev(tails) if len(tails) > 1 else float("nan")
    paired = statistics.fmean(cand[tail]) - tails[0]
    print(f"last {args.tail} logged rows, mean loss: candidate {statistics.fmean(cand[tail]):.4f}; "
          f"its own fp32 seed {tails[0]:.4f} (paired difference {paired:+.4f}); fp32 seeds "
          f"{statistics.fmean(tails):.4f} ± {sd:.4f} (SD over {len(tails)} seeds); "
          f"|difference| / SD = {abs(paired) / sd:.2f}")


if __name__ == "__main__":
    main()
