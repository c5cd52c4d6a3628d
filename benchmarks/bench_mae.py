"""Encoder tokens per step and training step time of MAE-LM vs MLM, same model, data and CPU.

MAE-LM (Meng et al. 2024) removes the selected positions from the encoder input, so the encoder
should process ≈ (1 - mask_rate) of MLM's tokens; a shallow full-length decoder is added on top.
Both objectives train the same 6-layer d=384 BERT (MAE-LM with a 2-layer decoder) on batches of
real text (enwiki prefix, MiniLM tokenizer) at each mask rate, in interleaved rounds; medians are
printed, in wall-clock seconds and in process CPU seconds (both threads; robust to other jobs on
a shared machine). Encoder tokens are counted at the word embeddings (what the encoder really
receives): `padded` = B x K after left-aligned gathering, `real` = tokens with attention_mask 1.

    python benchmarks/bench_mae.py [--rates 0.15 0.4 --rounds 3 --steps 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
from common import CORPUS, corpus_store
from transformers import BertConfig, BertForMaskedLM

from mlsm.config import DataConfig
from mlsm.data.batches import BatchSource
from mlsm.models.backbone import Student
from mlsm.objectives import Context, TrainModule, build_objective


class Runner:
    """One student + objective + optimizer; counts what enters the encoder's embeddings."""

    def __init__(self, name: str, args: argparse.Namespace, tok, source: BatchSource):
        torch.manual_seed(0)
        cfg = BertConfig(vocab_size=len(tok), hidden_size=args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         intermediate_size=4 * args.hidden, max_position_embeddings=512)
        self.student = Student(BertForMaskedLM(cfg)).train()
        spec = {"name": name,
                **({"decoder_layers": args.decoder_layers} if name == "mae_lm" else {})}
        self.objective = build_objective(spec,
                                         Context(tok, torch.device("cpu"), 1, max_len=args.seq))
        self.objective.attach(self.student)
        self.module = TrainModule(self.student, self.objective).train()
        self.opt = torch.optim.AdamW(self.module.parameters(), lr=1e-4)
        self.source, self.batch = source, args.batch
        self.padded: list[int] = []
        self.real: list[int] = []
        self.student.backbone.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs) -> None:
        self.padded.append(kwargs["input_ids"].numel())
        self.real.append(int(kwargs["attention_mask"].sum()))

    def step_times(self, start: int, steps: int) -> list[tuple[float, float]]:
        """(wall, CPU) seconds of each training step."""
        times = []
        for step in range(start, start + steps):
            batch = self.source.batch(np.arange(step * self.batch, (step + 1) * self.batch), step)
            t, c = time.perf_counter(), time.process_time()
            out = self.module(batch)
            (out.loss_sum / out.n_targets).backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            times.append((time.perf_counter() - t, time.process_time() - c))
        return times


def bench_rate(rate: float, store, tok, args: argparse.Namespace) -> dict[str, float]:
    data = DataConfig(store=str(store.path), max_len=args.seq, mask_rate=rate,
                      exact_count=args.exact_count)
    source = BatchSource(store, data, tok)
    runners = {name: Runner(name, args, tok, source) for name in ("mlm", "mae_lm")}
    for r in runners.values():  # warm-up step, not timed
        r.step_times(0, 1)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in runners}
    for k in range(args.rounds):  # interleaved, so drifts in machine load hit both
        for name, r in runners.items():
            times[name] += r.step_times(1 + k * args.steps, args.steps)
        print(f"  rate {rate} round {k}: "
              + "  ".join(f"{n} {t[-1][0]:.2f}s wall {t[-1][1]:.2f}s CPU"
                          for n, t in times.items()), flush=True)
    wall = {n: statistics.median(w for w, _ in t) for n, t in times.items()}
    cpu = {n: statistics.median(c for _, c in t) for n, t in times.items()}
    mlm, mae = runners["mlm"], runners["mae_lm"]
    return {"rate": rate, "mlm_s": wall["mlm"], "mae_s": wall["mae_lm"], "mlm_cpu": cpu["mlm"],
            "mae_cpu": cpu["mae_lm"], "mlm_tokens": statistics.mean(mlm.real),
            "mae_padded": statistics.mean(mae.padded), "mae_real": statistics.mean(mae.real)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--decoder-layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rates", type=float, nargs="+", default=[0.15, 0.4])
    ap.add_argument("--steps", type=int, default=2, help="steps per objective per timed round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--exact-count", action="store_true",
                    help="data.exact_count: same kept length in every row")
    args = ap.parse_args()
    if not CORPUS.is_file():
        sys.exit(f"skipped: {CORPUS} not found")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        store, tok = corpus_store(tmp)
        rows = [bench_rate(rate, store, tok, args) for rate in args.rates]
    print(f"\nencoder: BERT {args.layers} layers d={args.hidden}, "
          f"MAE decoder {args.decoder_layers} layers, "
          f"|V|={len(tok)}, batch {args.batch} x {args.seq}, exact_count={args.exact_count}, "
          f"{args.threads} threads, "
          f"torch {torch.__version__}")
    print("| mask rate | MLM enc. tokens/step | MAE-LM enc. tokens/step real (padded) "
          "| real ratio (1 - rate) "
          "| MLM step s wall / CPU | MAE-LM step s wall / CPU | ratio wall / CPU |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rate']} | {r['mlm_tokens']:,.0f} "
              f"| {r['mae_real']:,.0f} ({r['mae_padded']:,.0f}) "
              f"| {r['mae_real'] / r['mlm_tokens']:.3f} ({1 - r['rate']:.2f}) "
              f"| {r['mlm_s']:.2f} / {r['mlm_cpu']:.2f} "
              f"| {r['mae_s']:.2f} / {r['mae_cpu']:.2f} "
              f"| {r['mae_s'] / r['mlm_s']:.2f} / {r['mae_cpu'] / r['mlm_cpu']:.2f} |")


if __name__ == "__main__":
    main()
