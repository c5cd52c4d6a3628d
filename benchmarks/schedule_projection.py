"""What a study's schedule costs: its measured stage times replayed on N slots (issue #50 goal 5).

A study records every stage's wall seconds in STUDY_OUT/stages.jsonl. This script replays those
durations under the three ways a local study with `eval_jobs` above 1 has scheduled its stages:

- **per arm** (before session 25): at most max(jobs, eval_jobs) arms in progress, each one
  chain: its pre-training, then its probes, BLiMP and readouts at every readiness point one
  stage after another;
- **per point** (session 25): every arm's chain started at once, its pre-training through the
  `jobs` gate, then one chain per readiness point (probe, BLiMP, readout of that checkpoint) and
  one for its fine-tuning grid, a point's probes (its own, each readout control) in one
  subprocess, one after another;
- **per head** (`mlsm.study.runner._chains` now, session 26): as per point, each probe head a
  subprocess of its own, all asked at once, the point's BLiMP after the last of them.

Both on `--slots` slots (max(jobs, eval_jobs)), every subprocess let through in the order it
asked (`FairGate`), each evaluation subprocess paying the start-up the recorded `STAGE-job` rows
show beyond their stages. It prints the three projected walls from the first pre-training step, with
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
SCHEDULES = {"arm": "one chain per arm", "point": "one chain per point",
             "head": "one chain per point, probe heads side by side"}
Chain = list[tuple[float, ...]]  # subprocesses in order; a tuple's members run side by side


def _base(stage: str) -> str:
    """The runner's stage of a recorded one: probe-vocab (a readout control) is a probe."""
    return stage.split("-")[0]


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
        if stage == "pretrain":
            pretrain[arm] = seconds
        elif stage.endswith("-job") and "/" not in arm:  # a job of every head of its point
            jobs[(_base(stage), arm)] = seconds
        elif _base(stage) in EVALUATION:  # probe-HEAD kept: each head is a subprocess per head
            frac = float(point.rstrip("%")) / 100 if point else 1.0
            evaluation[name].append((stage, frac, seconds))
    startups = [seconds - sum(s for st, p, s in evaluation[arm.partition("@")[0]]
                              if _base(st) == stage and _same_point(arm, p))
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


def chains_of(stages: list[tuple[str, float, float]], schedule: str,
              startup: float = 0.0) -> list[Chain]:
    """An arm's evaluation under `schedule` (SCHEDULES) as chains of subprocesses, each with its
    start-up; a chain's steps run in order, the members of one step side by side."""
    def step(runs: list[float], apart: bool) -> tuple[float, ...]:
        return tuple(startup + r for r in runs) if apart else (startup + sum(runs),)

    if schedule == "arm":  # one subprocess per stage, every point inside it
        return [[step([s for st, _, s in stages if _base(st) == stage], False)
                 for stage in EVALUATION if any(_base(st) == stage for st, _, _ in stages)]]
    points = sorted({p for st, p, _ in stages if _base(st) != "finetune"}, reverse=True)
    chains = []
    for point in points:
        runs = {stage: [s for st, p, s in stages if _base(st) == stage and p == point]
                for stage in EVALUATION if stage != "finetune"}
        chains.append([step(r, schedule == "head" and stage == "probe")
                       for stage, r in runs.items() if r])
    finetune = [s for st, _, s in stages if st == "finetune"]
    return chains + ([[step(finetune, False)]] if finetune else [])


def project(pretrain: dict[str, float], evaluation: dict[str, list[tuple[str, float, float]]],
            slots: int, schedule: str = "head", startup: float = 0.0) -> float:
    """The wall from the first pre-training step to the last stage's end: an event replay of the
    runner's gates (first come, first served) on `slots` slots, arms in the study's order; per
    arm (`schedule` "arm") with at most `slots` arms in progress, as that runner had."""
    waiting_arms, clock, asked = list(pretrain), 0.0, 0
    queue: list[tuple[int, int, float]] = []  # (order asked, chain, seconds)
    running: list[tuple[float, int]] = []  # (ends at, chain)
    rest: dict[int, Chain] = {}  # each chain's steps not yet asked
    members: dict[int, int] = {}  # each chain's subprocesses of its current step still running
    owner: dict[int, tuple[str, bool]] = {}  # chain -> (arm, pre-training?)
    chains_open: dict[str, int] = {}  # arm -> its chains not yet finished

    def ask_step(chain: int) -> None:
        nonlocal asked
        group = rest[chain].pop(0)
        members[chain] = len(group)
        for seconds in group:
            queue.append((asked, chain, seconds))
            asked += 1

    def start(arm: str, training: bool, steps: Chain) -> None:
        chain = len(owner)
        owner[chain], rest[chain] = (arm, training), list(steps)
        chains_open[arm] = chains_open.get(arm, 0) + 1
        ask_step(chain)

    while waiting_arms or queue or running:
        while waiting_arms and (schedule != "arm" or len(chains_open) < slots):
            arm = waiting_arms.pop(0)  # run_chains' workers
            start(arm, True, [(pretrain[arm],)])
        queue.sort()
        while queue and len(running) < slots:
            _, chain, seconds = queue.pop(0)
            running.append((clock + seconds, chain))
        running.sort()
        clock, chain = running.pop(0)
        members[chain] -= 1
        if members[chain]:  # a step's other members still run (its BLiMP waits for them)
            continue
        if rest[chain]:
            ask_step(chain)
            continue
        arm, training = owner[chain]
        chains_open[arm] -= 1
        if training:  # its evaluation chains begin, the latest point first
            for steps in chains_of(evaluation.get(arm, []), schedule, startup):
                start(arm, False, steps)
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
    for schedule, name in SCHEDULES.items():
        wall = project(pretrain, evaluation, args.slots, schedule, startup)
        verdict = "" if args.goal_h is None else \
            f"; goal {args.goal_h} h {'met' if wall / 3600 <= args.goal_h else 'not met'}"
        print(f"projected, {name}: {wall:,.0f} s = {wall / 3600:.2f} h from pre-training "
              f"start{verdict}")


if __name__ == "__main__":
    main()
