"""benchmarks/schedule_projection.py: the replay of a study's stage times on N slots, checked
against what must hold of any schedule and against the schedule a published study ran."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "schedule_projection.py"
SEED_PAIR = ROOT / "benchmarks" / "results" / "seed_pair" / "bf16-online-s0.stages.jsonl"


def _module():
    spec = importlib.util.spec_from_file_location("schedule_projection", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _study(n_arms: int, seed: int) -> tuple[dict, dict]:
    """Random stage times: arms with pre-training, probes (some arms), BLiMP and readouts at three
    points, a fine-tuning grid on one arm."""
    import random

    rng = random.Random(seed)
    pretrain = {f"a{i}": rng.uniform(100, 1000) for i in range(n_arms)}
    evaluation = {}
    for i, arm in enumerate(pretrain):
        stages = [(s, p, rng.uniform(5, 300)) for p in (0.25, 0.5, 1.0)
                  for s in (("probe", "blimp", "readout") if i % 2 else ("blimp", "readout"))]
        evaluation[arm] = stages + ([("finetune", 1.0, rng.uniform(50, 200))] if i == 0 else [])
    return pretrain, evaluation


@pytest.mark.parametrize("seed", range(5))
def test_bounds_every_schedule_obeys(seed: int) -> None:
    """One slot: every second of work in a row. Slots for everything: the longest arm's
    pre-training plus its longest chain. Two slots: between work / 2 and the one-slot wall, and
    chains per point never worse than one per arm's serial order on the critical arm."""
    sp = _module()
    pretrain, evaluation = _study(4, seed)
    work = sum(pretrain.values()) + sum(s for v in evaluation.values() for _, _, s in v)
    for schedule in sp.SCHEDULES:
        assert sp.project(pretrain, evaluation, 1, schedule) == pytest.approx(work)
        two = sp.project(pretrain, evaluation, 2, schedule)
        assert work / 2 - 1e-6 <= two <= work + 1e-6
    for schedule in ("point", "head"):  # slots for all: a chain's steps, each its longest member
        many = sp.project(pretrain, evaluation, 100, schedule)
        longest = max(pretrain[a] + max(sum(max(step) for step in c) for c in
                                        sp.chains_of(evaluation[a], schedule)) for a in pretrain)
        assert many == pytest.approx(longest)
    serial = max(pretrain[a] + sum(s for _, _, s in evaluation[a]) for a in pretrain)
    assert sp.project(pretrain, evaluation, 100, "arm") == pytest.approx(serial)


def test_probe_heads_side_by_side_join_before_blimp() -> None:
    """A point's three probes (own, vocab, factored) then BLiMP: per point they run in a row in
    one subprocess; per head side by side, BLiMP after the longest; on one slot both are the
    whole work plus each subprocess's start-up."""
    sp = _module()
    pretrain = {"a": 10.0}
    evaluation = {"a": [("probe", 1.0, 5.0), ("probe-vocab", 1.0, 2.0),
                        ("probe-factored", 1.0, 7.0), ("blimp", 1.0, 3.0)]}
    assert sp.project(pretrain, evaluation, 3, "point", startup=1.0) == pytest.approx(10 + 15 + 4)
    assert sp.project(pretrain, evaluation, 3, "head", startup=1.0) == pytest.approx(10 + 8 + 4)
    # two slots: factored, asked last, waits for vocab's slot (3 s), then runs its 8 s
    assert sp.project(pretrain, evaluation, 2, "head", startup=1.0) == pytest.approx(10 + 11 + 4)
    assert sp.project(pretrain, evaluation, 1, "head", startup=1.0) == pytest.approx(10 + 17 + 4)


def test_start_up_is_paid_per_subprocess() -> None:
    """Per point, an arm with three points and three stages starts nine subprocesses, per arm
    three: on one slot the start-up adds 9 s and 3 s per arm at 1 s each."""
    sp = _module()
    pretrain = {"a": 10.0}
    evaluation = {"a": [(s, p, 1.0) for p in (0.25, 0.5, 1.0) for s in ("probe", "blimp",
                                                                         "readout")]}
    assert sp.project(pretrain, evaluation, 1, "point", startup=1.0) == pytest.approx(10 + 9 + 9)
    assert sp.project(pretrain, evaluation, 1, "head", startup=1.0) == pytest.approx(10 + 9 + 9)
    assert sp.project(pretrain, evaluation, 1, "arm", startup=1.0) == pytest.approx(10 + 9 + 3)


def test_replay_of_the_published_seed_pair_matches_its_measured_wall() -> None:
    """The seed pair of benchmarks/README.md ran one chain per arm; replaying its stage times
    that way gives the wall it measured (to 1 %), and the script prints both schedules."""
    sp = _module()
    measured = sp.measured_wall(SEED_PAIR)
    pretrain, evaluation, startup = sp.read_stages(SEED_PAIR)
    assert set(pretrain) == {"mlm-s0", "mlsm_l5-s0"}
    assert sum(len(v) for v in evaluation.values()) == 15
    replay = sp.project(pretrain, evaluation, 2, "arm", startup)
    assert replay == pytest.approx(measured, rel=0.01)
    out = subprocess.run([sys.executable, str(SCRIPT), str(SEED_PAIR), "--goal-h", "1.35"],
                         capture_output=True, text=True, check=True).stdout
    assert all(name in out for name in sp.SCHEDULES.values()) and "goal 1.35 h" in out
    rows = [json.loads(x) for x in SEED_PAIR.read_text().splitlines()]
    assert any(r["stage"] == "probe-job" for r in rows)  # the start-up is read from job rows
