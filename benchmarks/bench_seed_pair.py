"""The lab's unit (#50 goal 5): one v2 seed pair, pre-training plus evaluation, end to end.

Issue #50 prices a unit of evidence as one seed of v2's two arms (MLM and MLSM l = 5, 2,500 steps
each, then the plateau probe, BLiMP and the readouts at every readiness point): about 2.7 h on the
2-core machine when the issue was filed, with a goal of at most 1.35 h. This script runs exactly
that with `mlsm study` on studies/cpu_replication_v2.yaml, restricted to one seed's two arms and
written to its own folder, in two timed commands:

1. `--stages store dictionary`: what every seed of the study shares and builds once: the token
   store, the dictionary (with --reuse-dictionary, v1's published one is copied in instead of
   learning it for ~48 min, as the study file's notes suggest) and the MLSM arm's target store
   (its dictionary's codes of every token, ~40 min);
2. every remaining stage of the two arms: **the unit**, timed against the anchor and the goal.

The preparation is not the unit, so it need not run on idle cores: `--prepare-only` runs it
alone (beside a background study, say), and a later run on the same --out finds it done (the
study skips finished stages by their fingerprints) and measures the unit alone, on idle cores
(pause any background study: `kill -STOP -- -PGID`, then `kill -CONT -- -PGID`).

It prints the fp32 and bf16 GEMM peaks measured in the same run, each stage's wall and CPU seconds
as the study folder records them, and the unit against the anchor (2.7 h) and the goal (1.35 h).
The study trains in its own precision (v2: fp32); `--precision bf16` runs the same study with
`train.precision: bf16` for every arm, as a new study on a CPU with native bf16 would (the
evaluation stages score in fp32 either way: benchmarks/README.md, "Evaluation stages under
bf16"). `--online-targets` has the MLSM arm code its targets online, as v3 does: nothing to
prepare beyond the token store and dictionary, and the unit pays every step's teacher and coding
(MLSM online / MLM 1.05 per step, against 0.87 from the store: benchmarks/README.md, "Step
time"), so its figure bounds the unit with a target store from above. Such a copy of the study
file is written beside it, so its relative paths hold, and removed after.

    PYTHONPATH=src HF_HUB_OFFLINE=1 python benchmarks/bench_seed_pair.py --out /tmp/seed-pair \\
        [--seed 0] [--reuse-dictionary] [--precision bf16] [--online-targets] [--prepare-only]

Only a unit run into a folder where no arm has started is the measurement: the script refuses a
folder where one has unless --resume is given, and then says the figure is not end to end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import measured_peaks  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ANCHOR_H = 2.7  # issue #50: a v2 seed pair on the 2-core machine when the issue was filed
GOAL_H = 1.35  # issue #50 goal 5
V1_DICTIONARY = ROOT / "docs/results/cpu_replication/dictionaries/minilm_l5_k1536_lam0.05"
PREPARATION = ("store", "dictionary")


def _study(args: argparse.Namespace, stages: list[str] | None) -> tuple[float, float]:
    """Run `mlsm study` on the chosen arms (and stages); its wall and CPU seconds (children)."""
    arms = [f"{a}-s{args.seed}" for a in args.arms]
    cmd = [sys.executable, "-m", "mlsm", "study", str(args.study), "--out", str(args.out),
           "--arms", *arms] + (["--stages", *stages] if stages else [])
    print("$ " + " ".join(cmd[1:]), flush=True)
    before, start = os.times(), time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT)
    after = os.times()
    cpu = (after.children_user - before.children_user) + (after.children_system
                                                          - before.children_system)
    return time.perf_counter() - start, cpu


@contextmanager
def _variant(study: Path, precision: str | None, online: bool) -> Iterator[Path]:
    """The study file, or a copy of it beside it (its relative paths hold) whose base trains in
    `precision` and whose arms code their targets online; removed when the measurement ends,
    a SIGTERM included (a stopped copy is ignored by git: studies/.*.bench.yaml)."""
    if precision is None and not online:
        yield study
        return
    raw = yaml.safe_load(study.read_text())
    if precision is not None:
        raw.setdefault("base", {}).setdefault("train", {})["precision"] = precision
    if online:
        for arm in raw["arms"].values():
            if arm.get("dictionary"):
                arm["dictionary"]["targets"] = False
    tag = ".".join(filter(None, [precision, "online" if online else ""]))
    copy = study.with_name(f".{study.stem}.{tag}.bench.yaml")
    copy.write_text(yaml.safe_dump(raw, sort_keys=False))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` runs
    try:
        yield copy
    finally:
        copy.unlink(missing_ok=True)


def _stage_rows(args: argparse.Namespace) -> list[dict]:
    from mlsm.study.folder import Study
    from mlsm.study.spec import load_study

    return Study(load_study(args.study, str(args.out)), log=lambda s: None).stage_runs()


def _print_stages(rows: list[dict]) -> None:
    print(f"{'stage':<34} {'wall s':>9} {'CPU s':>9}  state")
    for r in rows:
        name = r["stage"] + (f":{r['arm']}" if r.get("arm") else "")
        cpu = r.get("cpu_seconds")
        print(f"{name:<34} {r['seconds']:>9.0f} {'' if cpu is None else f'{cpu:>9.0f}'}  "
              f"{r.get('state', '')}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="an empty folder for the study")
    p.add_argument("--study", type=Path, default=ROOT / "studies/cpu_replication_v2.yaml")
    p.add_argument("--arms", nargs="+", default=["mlm", "mlsm_l5"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reuse-dictionary", action="store_true",
                   help="copy v1's published layer-5 dictionary in instead of learning it")
    p.add_argument("--precision", choices=["fp32", "bf16"],
                   help="train every arm in this precision (default: the study's own)")
    p.add_argument("--online-targets", action="store_true",
                   help="the MLSM arm codes its targets online (no target store to prepare)")
    p.add_argument("--prepare-only", action="store_true",
                   help="build what every seed shares and stop (need not be on idle cores)")
    p.add_argument("--resume", action="store_true",
                   help="continue a stopped measurement (then it is not end to end)")
    args = p.parse_args()
    args.out, args.study = args.out.resolve(), args.study.resolve()  # the study runs from ROOT
    if _started(args.out) and not args.resume:
        sys.exit(f"{args.out} holds runs already: pass an empty --out, or one where only "
                 "--prepare-only ran (or --resume)")
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    measured_peaks()
    if args.reuse_dictionary:
        (args.out / "dictionaries").mkdir(parents=True, exist_ok=True)
        for suffix in (".json", ".safetensors"):
            # not with_suffix: the name's "0.05" holds a dot of its own
            name = V1_DICTIONARY.name + suffix
            shutil.copy(V1_DICTIONARY.parent / name, args.out / "dictionaries" / name)
    with _variant(args.study, args.precision, args.online_targets) as args.study:
        prep_wall, prep_cpu = _study(args, list(PREPARATION))
        shared = "store, dictionary" + ("" if args.online_targets else ", target store")
        print(f"preparation ({shared}; shared by every seed): "
              f"{prep_wall:,.0f} s wall, {prep_cpu:,.0f} s CPU", flush=True)
        if args.prepare_only:
            return
        unit_wall, unit_cpu = _study(args, None)
        _print_stages(_stage_rows(args))
    unit_h = unit_wall / 3600
    print(f"the unit (seed {args.seed}: {', '.join(args.arms)}, pre-training + evaluation, "
          f"trained in {args.precision or 'its own precision'}"
          f"{', targets coded online' if args.online_targets else ''}): {unit_wall:,.0f} s wall = "
          f"{unit_h:.2f} h, {unit_cpu:,.0f} s CPU")
    print(f"against the anchor ({ANCHOR_H} h): {ANCHOR_H / unit_h:.2f}x faster; goal <= {GOAL_H} "
          f"h: {'met' if unit_h <= GOAL_H else 'not met'}"
          + (" (resumed: not end to end)" if args.resume else ""))


def _started(out: Path) -> bool:
    """Whether any arm of a study in `out` has begun (its run folder exists)."""
    return (out / "runs").is_dir() and any((out / "runs").iterdir())


if __name__ == "__main__":
    main()
