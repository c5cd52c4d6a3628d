"""What a study's schedule costs: its measured stage times replayed on N slots (issue #50 goal 5).

A study records every stage's wall seconds in STUDY_OUT/stages.jsonl. This script replays those
durations under the two ways a local study with `eval_jobs` above 1 has scheduled its stages:

- **per arm** (before session 25): at most max(jobs, eval_jobs) arms in progress, each one
  chain: its pre-training, then its probes, BLiMP and readouts at every readiness point one
  stage after another;
- **per point** (`mlsm.study.runner._chains` now): every arm's chain started at once, its
  pre-training through the `jobs` gate, then one chain per readiness point (probe, BLiMP,
  readout of that checkpoint) and one for its fine-tuning grid.

Both on `--slots` slots (max(jobs, eval_jobs)), every subprocess let through in the order it
asked (`FairGate`), each evaluation subprocess paying the start-up the recorded `STAGE-job` rows
show beyond their stages. It prints both projected walls from the first pre-training step, with
the wall the study itself measured (under the schedule it ran). A projection, not a
measurement: a stage is assumed to take as long as it did, whoever ran beside it (true of
1-thread stages on separate cores, less so of memory-bound ones).

    python benchmarks/schedule_projection.py STUDY_OUT/stages.jsonl [--slots 2] [--goal-h H]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from datetime import datetime
from pathlib import Path

EVALUATION = ("probe", "finetune", "blimp", "readout")  # the runner's order within a chain


def read_stages(path: Path) -> tuple[dict[str, float], dict[str, list[tuple[str, float, float]]],
                                     float]:
    """(pre-training seconds per arm, each arm's evaluation stages as (stage, point, seconds),
    the mean start-up of one evaluation subprocess)."""
    pretrain: dict[str, float] = {}
    evaluation: dict[str, list[tuple[str, float, float]]] = defaultdict(list)
    jobs: dict[tuple[str, str], float] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        stage, arm, seconds = row["stage"], row.get("arm"), float(row["seconds"])
        if row.get("state") != "done" or arm is None:
            continue
        name, _, point = arm.partition("@")
        base = stage.split("-")[0]  # probe-vocab (a readout control) is a probe
        if stage == "pretrain":
            pretrain[arm] = seconds
        elif stage.endswith("-job"):
            jobs[(base, arm)] = seconds
        elif base in EVALUATION:
            frac = float(point.rstrip("%")) / 100 if point else 1.0
            evaluation[name].append((base, frac, seconds))
    startups = [seconds - sum(s for st, p, s in evaluation[arm.partition("@")[0]]
                              if st == stage and _same_point(arm, p))
                for (stage, arm), seconds in jobs.items()]
    return pretrain, evaluation, statistics.mean(startups) if startups else 0.0


def measured_wall(path: Path) -> float | None:
    """The study's own wall from the first pre-training start to the last evaluation stage's
    end (rows' `finished` minus `seconds`); None if the file has no pre-training row."""
    spans = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row.get("state") == "done" and row["stage"].split("-")[0] in ("pretrain", *EVALUATION):
            end = datetime.fromisoformat(row["finished"].replace("Z", "+00:00")).timestamp()
            spans.append((row["stage"], end - float(row["seconds"]), end))
    starts = [start for stage, start, _ in spans if stage == "pretrain"]
    return max(end for _, _, end in spans) - min(starts) if starts else None


def _same_point(job_arm: str, frac: float) -> bool:
    point = job_arm.partition("@")[2]
    return not point or abs(float(point.rstrip("%")) / 100 - frac) < 1e-9


def chains_of(stages: list[tuple[str, float, float]], per_point: bool,
              startup: float = 0.0) -> list[list[float]]:
    """An arm's evaluation as chains of subprocess durations (each with its start-up), each
    chain run in order."""
    if not per_point:  # one subprocess per stage, every point inside it
        return [[startup + sum(s for st, _, s in stages if st == stage)
                 for stage in EVALUATION if any(st == stage for st, _, _ in stages)]]
    points = sorted({p for st, p, _ in stages if st != "finetune"}, reverse=True)
    chains = [[startup + s for stage in EVALUATION if stage != "finetune" for st, p, s in stages
               if st == stage and p == point] for point in points]
    finetune = [s for st, _, s in stages if st == "finetune"]
    return chains + ([[startup + sum(finetune)]] if finetune else [])


def project(pretrain: dict[str, float], evaluation: dict[str, list[tuple[str, float, float]]],
            slots: int, per_point: bool, startup: float = 0.0) -> float:
    """The wall from the first pre-training step to the last stage's end: an event replay of the
    runner's gates (first come, first served) on `slots` slots, arms in the study's order; per
    arm (`per_point` False) with at most `slots` arms in progress, as that runner had."""
    waiting_arms, clock, asked = list(pretrain), 0.0, 0
    queue: list[tuple[int, str, bool, list[float]]] = []  # (order asked, arm, pre-training?, left)
    running: list[tuple[float, str, bool, list[float]]] = []  # (ends at, arm, pre-training?, next)
    chains_open: dict[str, int] = {}  # arm -> its chains not yet finished

    def ask(arm: str, training: bool, chain: list[float]) -> None:
        nonlocal asked
        queue.append((asked, arm, training, chain))
        asked += 1

    while waiting_arms or queue or running:
        while waiting_arms and (per_point or len(chains_open) < slots):  # run_chains' workers
            arm = waiting_arms.pop(0)
            chains_open[arm] = 1
            ask(arm, True, [pretrain[arm]])
        queue.sort()
        while queue and len(running) < slots:
            _, arm, training, chain = queue.pop(0)
            running.append((clock + chain[0], arm, training, chain[1:]))
        running.sort()
        clock, arm, training, rest = running.pop(0)
        if rest:
            ask(arm, training, rest)
            continue
        chains_open[arm] -= 1
        if training:  # its evaluation chains begin, the latest point first
            for chain in chains_of(evaluation.get(arm, []), per_point, startup):
                chains_open[arm] += 1
                ask(arm, False, chain)
        if not chains_open[arm]:
            del chains_open[arm]
    return clock


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stages", type=Path, help="a study's stages.jsonl")
    parser.add_argument("--slots", type=int, default=2, help="max(jobs, eval_jobs) (default 2)")
    parser.add_argument("--goal-h", type=float, default=None,
                        help="a goal to print met or not against (issue #50 goal 5: 1.35 h)")
    args = parser.parse_args()
    pretrain, evaluation, startup = read_stages(args.stages)
    print(f"{args.stages}: {len(pretrain)} arms, {sum(len(v) for v in evaluation.values())} "
          f"evaluation stages, subprocess start-up {startup:.1f} s (mean over STAGE-job rows)")
    wall = measured_wall(args.stages)
    if wall is not None:
        print(f"measured in that study: {wall:,.0f} s = {wall / 3600:.2f} h from pre-training "
              "start (the schedule it ran)")
    for per_point in (False, True):
        wall = project(pretrain, evaluation, args.slots, per_point, startup)
        verdict = "" if args.goal_h is None else \
            f"; goal {args.goal_h} h {'met' if wall / 3600 <= args.goal_h else 'not met'}"
        print(f"projected, one chain per {'point' if per_point else 'arm'}: {wall:,.0f} s = "
              f"{wall / 3600:.2f} h from pre-training start{verdict}")


if __name__ == "__main__":
    main()
