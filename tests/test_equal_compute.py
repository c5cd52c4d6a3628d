"""Pre-registered comparisons read at equal training FLOPs (mlsm.study.equal_compute)."""

from __future__ import annotations

import math

import pytest
import scipy.stats

from mlsm.study.equal_compute import (
    arm_flops,
    equal_compute,
    equal_compute_lines,
    equal_flops_point,
)
from mlsm.study.hypotheses import Hypothesis


def test_equal_flops_point_is_the_largest_checkpoint_within_the_budget() -> None:
    fracs = [0.25, 0.5, 0.69, 0.7, 1.0]
    assert equal_flops_point(1.44, 1.0, 1.0, fracs) == 0.69  # 0.7 x 1.44 = 1.008 > 1
    assert equal_flops_point(1.0, 1.0, 1.0, fracs) == 1.0
    assert equal_flops_point(4.5, 1.0, 1.0, fracs) is None  # even 25 % costs more
    assert equal_flops_point(1.44, 1.0, 0.5, fracs) == 0.25


def test_a_hypothesis_is_tested_again_with_the_costlier_arm_at_equal_flops() -> None:
    compute = [{"arm": f"{arm}-s{s}", "flops_per_batch": f, "steps": 100}
               for s in range(4) for arm, f in (("mlsm", 1.44e9), ("mlm", 1.0e9))]
    flops = arm_flops(compute, seeded=True)
    assert flops == {"mlsm": 1.44e11, "mlm": 1.0e11}
    a69, a100, b100 = [0.30, 0.28, 0.31, 0.27], [0.40, 0.41, 0.39, 0.42], [0.25, 0.26, 0.27, 0.24]
    rows = [{"model": f"{m}-s{s}@{p}", "kind": "masked", "task": "heldout", "metric": "top1",
             "value": v[s]} for m, p, v in (("mlsm", "69%", a69), ("mlsm", "100%", a100),
                                            ("mlm", "100%", b100)) for s in range(4)]
    h = Hypothesis(id="H1", a="mlsm@100%", b="mlm@100%", kind="masked", task="heldout",
                   metric="top1", direction="greater")
    (got,) = equal_compute([h], rows, flops, [0.69, 1.0], seeded=True)
    assert got["ratio"] == pytest.approx(1.44)
    e = got["equal"]
    assert (e["a"], e["b"]) == ("mlsm@69%", "mlm@100%") and e["n"] == 4
    assert e["ratio"] == pytest.approx(0.69 * 1.44)
    assert e["mean_diff"] == pytest.approx(sum(a69) / 4 - sum(b100) / 4)
    ref = scipy.stats.ttest_rel(a69, b100, alternative="greater").pvalue
    assert e["p"] == pytest.approx(ref)
    lines = equal_compute_lines([got], store_seconds=1234.0)
    assert any("mlsm@69% vs mlm@100%" in x for x in lines) and "1,234 s" in lines[-2]


def test_equal_arms_need_no_second_reading() -> None:
    h = Hypothesis(id="H", a="x@100%", b="y@100%", kind="masked", task="heldout", metric="top1")
    (got,) = equal_compute([h], [], {"x": 2.0, "y": 2.0}, [0.5, 1.0], seeded=True)
    assert got["ratio"] == 1.0 and "equal" not in got
    (got,) = equal_compute([h], [], {"x": 2.0}, [0.5, 1.0], seeded=True)
    assert math.isnan(got["ratio"])


def test_a_checkpoint_far_below_the_budget_is_not_called_equal_compute() -> None:
    """Arms 0.7 % apart are at equal compute already; a point at 69 % of a 1.007x arm (0.69x the
    other's FLOPs) is not an equal-FLOPs reading."""
    h = Hypothesis(id="H", a="x@100%", b="y@100%", kind="masked", task="heldout", metric="top1")
    (got,) = equal_compute([h], [], {"x": 1.007, "y": 1.0}, [0.69, 1.0], seeded=True)
    assert "equal" not in got
    assert "equal already" in equal_compute_lines([got])[-2]
    (got,) = equal_compute([h], [], {"x": 1.2, "y": 1.0}, [0.69, 1.0], seeded=True)
    assert "equal" not in got  # 0.69 x 1.2 = 0.83 of the other's FLOPs: too far below
    assert "no checkpoint within 5 %" in equal_compute_lines([got])[-2]


def test_a_study_scoring_at_the_equal_flops_point_tests_held_out_rows_there(
    corpus_dir, tokenizer_dir, teacher_dir, tmp_path
) -> None:
    """End to end: a study whose `blimp.readiness` lists the point where the costlier arm's
    training FLOPs reach the other's scores held-out masked tokens there (through MLSM's probe,
    fitted at each of those points, or MLM's head), and its report reads the held-out hypothesis
    again between that checkpoint and the other arm's final one (what v3 did by hand: its file
    lists 1.0 only). Here the tiny MLM, whose |V|-wide head dominates, is the costlier arm."""
    import json

    from mlsm.study.cost_report import arm_compute
    from mlsm.study.folder import Study
    from mlsm.study.runner import run_study
    from mlsm.study.spec import load_study, readiness_label
    from tests.test_study import _raw, _tiny_tasks, _write

    _, blimp = _tiny_tasks(tmp_path)
    raw = _raw(corpus_dir, tokenizer_dir, teacher_dir, tmp_path / "study")
    raw["base"]["train"]["steps"] = 20
    per_batch = {c["arm"]: c["flops_per_batch"]
                 for c in arm_compute(Study(load_study(_write(tmp_path, raw)), log=print))}
    dear, cheap = sorted(per_batch, key=per_batch.get, reverse=True)
    ratio = per_batch[dear] / per_batch[cheap]
    point = math.floor(100 / ratio) / 100  # the last percent within the cheaper arm's budget
    assert ratio > 1.05 and 0.1 <= point < 0.95
    raw.update(readiness=[point, 1.0],
               blimp={"data": [str(blimp)], "readiness": [point, 1.0]},
               probe={"max_steps": 20, "eval_every": 10, "select_steps": 10,
                      "heldout_batches": 1, "batch_size": 8, "min_delta": 1e-4},
               hypotheses=[{"id": "H", "statement": "one reads held-out tokens better",
                            "a": "mlsm@100%", "b": "mlm@100%", "kind": "masked",
                            "task": "heldout", "metric": "top1"}])
    spec = load_study(_write(tmp_path, raw))
    run_study(spec, stages=["store", "dictionary", "pretrain", "probe", "blimp", "report"],
              log=lambda s: None)
    moved = {dear: f"{dear}@{readiness_label(point)}", cheap: f"{cheap}@100%"}
    (got,) = json.loads((spec.root / "summary.json").read_text())["hypotheses"]
    equal = got["equal_compute"]["equal"]
    assert (equal["a"], equal["b"], equal["n"]) == (moved["mlsm"], moved["mlm"], 1)

    def top1(model: str) -> float:
        name = model.replace("%", "pct")
        return json.loads((spec.root / "blimp" / f"{name}.json").read_text())["heldout"]["top1"]

    assert equal["mean_diff"] == pytest.approx(top1(moved["mlsm"]) - top1(moved["mlm"]))
    assert f"{moved['mlsm']} vs {moved['mlm']}" in (spec.root / "report.md").read_text()
