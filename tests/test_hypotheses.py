"""Pre-registered hypotheses and pre-training seeds: the paired statistics against SciPy and
statsmodels, the study file's checks, the pre-registration record and the evaluation over rows."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import scipy.stats

from mlsm.errors import UserError
from mlsm.evaluate.compare.paired import (
    detectable_dz,
    holm,
    mean_ci,
    min_detectable_effect,
    paired_p,
    t_power,
)
from mlsm.study.hypotheses import (
    Hypothesis,
    evaluate,
    hypotheses_hash,
    preregistration_problems,
    record_preregistration,
)
from mlsm.study.spec import study_from_dict


def test_holm_matches_statsmodels(monkeypatch: pytest.MonkeyPatch) -> None:
    multitest = pytest.importorskip("statsmodels.stats.multitest")
    # multipletests calls gc.collect() on every call: 0.3-0.5 s each in a full suite's heap (49 s
    # for this test); its adjusted p-values do not depend on it
    monkeypatch.setattr("gc.collect", lambda *args: 0)
    rng = np.random.default_rng(0)
    for m in (1, 2, 3, 5, 8):
        for _ in range(20):
            p = rng.uniform(0, 0.2, m) ** rng.uniform(0.5, 3)
            expected = multitest.multipletests(p, method="holm")[1]
            np.testing.assert_allclose(holm(p), expected, rtol=1e-12)


def test_holm_counts_an_untested_hypothesis_in_the_family() -> None:
    # Holm (1979) by hand: sorted p 0.01, 0.04 with m = 3 -> 0.03, max(0.03, 0.08)
    assert holm([0.04, math.nan, 0.01])[0] == pytest.approx(0.08)
    assert holm([0.04, math.nan, 0.01])[2] == pytest.approx(0.03)
    assert math.isnan(holm([0.04, math.nan, 0.01])[1])


def test_paired_t_and_ci_match_scipy_and_statsmodels() -> None:
    rng = np.random.default_rng(1)
    a, b = rng.normal(0.5, 0.02, 4), rng.normal(0.49, 0.02, 4)
    for alt in ("greater", "less", "two-sided"):
        assert paired_p(a, b, "paired-t", alt) == pytest.approx(
            scipy.stats.ttest_rel(a, b, alternative=alt).pvalue, rel=1e-12)
        assert paired_p(a, b, "wilcoxon", alt) == pytest.approx(
            scipy.stats.wilcoxon(a - b, alternative=alt).pvalue, rel=1e-12)
    weightstats = pytest.importorskip("statsmodels.stats.weightstats")
    mean, low, high = mean_ci(a - b)
    assert mean == pytest.approx(float(np.mean(a - b)))
    np.testing.assert_allclose((low, high), weightstats.DescrStatsW(a - b).tconfint_mean(0.05))


def test_power_matches_the_textbook_and_statsmodels() -> None:
    # Cohen (1988) / G*Power: a paired t-test at dz = 0.5, alpha 0.05 two-sided needs 34 pairs
    # for 80 % power (power 0.8078 at n = 34, below 0.8 at n = 33)
    assert t_power(0.5, 34, 0.05, "two-sided") == pytest.approx(0.8078, abs=5e-4)
    assert t_power(0.5, 33, 0.05, "two-sided") < 0.8
    power = pytest.importorskip("statsmodels.stats.power")
    for n in (3, 5, 10):
        for alt, sm_alt in (("two-sided", "two-sided"), ("greater", "larger")):
            expected = power.TTestPower().solve_power(nobs=n, alpha=0.05, power=0.8,
                                                      alternative=sm_alt)
            assert detectable_dz(n, 0.05, alt) == pytest.approx(expected, rel=1e-5)
    # the detectable difference is dz times the measured SD of the differences
    assert min_detectable_effect(0.004, 3, 0.05, "paired-t", "greater") == pytest.approx(
        0.004 * detectable_dz(3, 0.05, "greater"))


def test_wilcoxon_over_three_seeds_can_detect_nothing() -> None:
    # its smallest two-sided p over 3 pairs is 0.25, one-sided 0.125: no effect reaches 0.05
    assert min_detectable_effect(0.01, 3, 0.05, "wilcoxon", "two-sided") == math.inf
    assert min_detectable_effect(0.01, 4, 0.05, "wilcoxon", "greater") == math.inf
    assert math.isfinite(min_detectable_effect(0.01, 5, 0.05, "wilcoxon", "greater"))
    # two-sided the smallest p doubles: 2 / 32 = 0.0625 at 5 seeds, 2 / 64 at 6
    assert min_detectable_effect(0.01, 5, 0.05, "wilcoxon", "two-sided") == math.inf
    assert math.isfinite(min_detectable_effect(0.01, 6, 0.05, "wilcoxon", "two-sided"))
    assert paired_p([3, 4, 5], [1, 2, 3], "wilcoxon", "two-sided") == pytest.approx(0.25)


def _study(**extra: object) -> dict:
    raw = {"arms": {"mlm": {}, "mlsm": {"objective": {"name": "mlm"}}},
           "readiness": [0.5, 1.0]}
    raw.update(extra)
    return raw


H1 = {"id": "H1", "statement": "mlsm beats mlm", "a": "mlsm@100%", "b": "mlm@100%",
      "kind": "masked", "task": "heldout", "metric": "top1"}


def test_seeds_name_runs_and_set_data_and_init_seeds() -> None:
    from mlsm.study.runner import _only_arms
    from mlsm.study.spec import arm_base

    plain = study_from_dict(_study())
    assert list(plain.arms) == ["mlm", "mlsm"]  # no `seeds`: the runs are named as before
    spec = study_from_dict(_study(seeds=[3, 7]))
    assert list(spec.arms) == ["mlm-s3", "mlsm-s3", "mlm-s7", "mlsm-s7"]
    for run in spec.arms:
        seed = int(run.rpartition("-s")[2])
        cfg = arm_base(spec, run)
        assert cfg["data"]["seed"] == seed and cfg["train"]["seed"] == seed
    assert list(_only_arms(spec, ["mlsm"]).arms) == ["mlsm-s3", "mlsm-s7"]
    assert list(_only_arms(spec, ["mlm-s7"]).arms) == ["mlm-s7"]
    with pytest.raises(UserError, match="ends like a seeded run's"):
        study_from_dict({"arms": {"mlm-s1": {}}, "seeds": [0, 1]})
    with pytest.raises(UserError, match="study.seeds must be distinct"):
        study_from_dict(_study(seeds=[1, 1]))


def test_bad_hypotheses_are_one_line_errors() -> None:
    assert study_from_dict(_study(hypotheses=[H1])).hypotheses[0].metric == "top1"
    for change, message in (({"a": "kd@100%"}, "names no arm of the study"),
                            ({"b": "mlm@25%"}, "25% is not a readiness point"),
                            ({"b": "mlm"}, "must be ARM@P%"),
                            ({"test": "sign"}, "hypotheses.test must be one of"),
                            ({"oops": 1}, "unknown key hypotheses.oops"),
                            ({"task": ""}, "set task")):
        with pytest.raises(UserError, match=message):
            study_from_dict(_study(hypotheses=[{**H1, **change}]))
    with pytest.raises(UserError, match="its own id"):
        study_from_dict(_study(hypotheses=[H1, H1]))
    with pytest.raises(UserError, match="same alpha"):
        study_from_dict(_study(hypotheses=[H1, {**H1, "id": "H2", "alpha": 0.01}]))


def _rows(rng: np.random.Generator, seeds: list[int]) -> list[dict]:
    """Readout and fine-tuning rows of a seeded study (runs ARM-s<seed>)."""
    rows = []
    for s in seeds:
        for arm, shift in (("mlm", 0.0), ("mlsm", 0.01)):
            top1 = 0.30 + shift + rng.normal(0, 0.003)
            rows.append({"model": f"{arm}-s{s}@100%", "kind": "masked", "task": "heldout",
                         "metric": "top1", "value": top1, "control": 0.05})
            rows.append({"model": f"{arm}-s{s}@100%", "kind": "pairs", "task": "blimp",
                         "phenomenon": "uid_a", "metric": "accuracy", "value": 0.0})
            rows.append({"model": f"{arm}-s{s}@100%", "kind": "pairs", "task": "blimp",
                         "metric": "accuracy", "value": 0.6 + shift + rng.normal(0, 0.002)})
            for task in ("rte", "sst2"):
                for ft_seed in range(3):  # fine-tuning seeds average within a pre-training seed
                    rows.append({"model": f"{arm}-s{s}@100%", "task": task, "metric": "acc",
                                 "seed": ft_seed, "value": 0.6 + shift + rng.normal(0, 0.01)})
            for metric, v in (("acc", 0.7), ("f1", 0.8)):  # a task with two metrics
                rows.append({"model": f"{arm}-s{s}@100%", "kind": "probe", "task": "mrpc",
                             "metric": metric, "value": v + shift + rng.normal(0, 0.01)})
            rows.append({"model": f"{arm}-s{s}@100%", "kind": "probe", "task": "sst2",
                         "metric": "acc", "value": 0.8 + shift + rng.normal(0, 0.01)})
    return rows


def test_evaluation_pairs_by_pretraining_seed_and_matches_scipy() -> None:
    rng = np.random.default_rng(2)
    rows = _rows(rng, [0, 1, 2, 3])
    hyps = [Hypothesis(**H1),
            Hypothesis(id="H2", statement="ft", a="mlsm@100%", b="mlm@100%", task="*",
                       metric="acc"),
            Hypothesis(id="H3", statement="over control", a="mlm@100%", b="control",
                       kind="masked", task="heldout", metric="top1", direction="two-sided")]
    got = evaluate(hyps, rows, seeded=True)
    a = [np.mean([r["value"] for r in rows if r["model"] == f"mlsm-s{s}@100%"
                  and r.get("kind") is None and r["task"] == t]) for s in range(4)
         for t in ("rte", "sst2")]
    b = [np.mean([r["value"] for r in rows if r["model"] == f"mlm-s{s}@100%"
                  and r.get("kind") is None and r["task"] == t]) for s in range(4)
         for t in ("rte", "sst2")]
    a, b = np.reshape(a, (4, 2)).mean(1), np.reshape(b, (4, 2)).mean(1)  # equal task weights
    np.testing.assert_allclose(got[1]["a_values"], a)
    assert got[1]["p"] == pytest.approx(scipy.stats.ttest_rel(a, b, alternative="greater").pvalue)
    assert got[0]["seeds"] == [0, 1, 2, 3] and got[0]["n"] == 4
    top1 = {r["model"]: r["value"] for r in rows if r.get("metric") == "top1"}
    assert got[2]["a_values"] == [top1[f"mlm-s{s}@100%"] for s in range(4)]
    assert got[2]["b_values"] == [0.05] * 4
    np.testing.assert_allclose([g["p_holm"] for g in got], holm([g["p"] for g in got]))
    assert got[0]["decision"] == ("supported" if got[0]["p_holm"] < 0.05 else "not supported")
    sd = float(np.std(np.array(got[0]["a_values"]) - got[0]["b_values"], ddof=1))
    assert got[0]["mde80"] == pytest.approx(min_detectable_effect(sd, 4, 0.05, "paired-t",
                                                                  "greater"))
    probe = evaluate([Hypothesis(id="H4", statement="probe average", a="mlsm@100%",
                                 b="mlm@100%", kind="probe", task="*", metric="*")], rows, True)
    cell = {(r["model"], r["task"], r["metric"]): r["value"] for r in rows if r.get("kind")}
    expect = [(cell["mlsm-s0@100%", "mrpc", "acc"] + cell["mlsm-s0@100%", "mrpc", "f1"]) / 4
              + cell["mlsm-s0@100%", "sst2", "acc"] / 2]  # tasks weigh equally, not metrics
    assert probe[0]["a_values"][0] == pytest.approx(expect[0])
    pairs = evaluate([Hypothesis(id="H5", statement="pairs", a="mlsm@100%", b="mlm@100%",
                                 kind="pairs", task="blimp", metric="accuracy")], rows, True)
    # the phenomenon's row (0.0) is left out
    assert pairs[0]["a_values"] == [r["value"] for r in rows if r.get("kind") == "pairs"
                                    and "phenomenon" not in r and r["model"].startswith("mlsm")]
    one = evaluate(hyps[:1], [r for r in rows if "-s0@" in r["model"]], seeded=True)[0]
    assert one["decision"].startswith("not tested") and one["n"] == 1
    # fewer paired seeds than the study plans: p shown, the decision waits for the planned test
    early = evaluate(hyps, rows, seeded=True, planned=5)
    assert [g["p"] for g in early] == [g["p"] for g in got]
    assert all(g["decision"] == "interim: 4 of 5 seeds, decided at 5" for g in early)
    assert [g["decision"] for g in evaluate(hyps, rows, True, planned=4)] == \
        [g["decision"] for g in got]


def test_preregistration_record_flags_changes_and_late_records(tmp_path) -> None:
    hyps = [Hypothesis(**H1)]
    record_preregistration(tmp_path, hyps, "abc")
    assert preregistration_problems(tmp_path, hyps) == []
    record_preregistration(tmp_path, [], "abc")  # written once: a later call changes nothing
    assert json.loads((tmp_path / "preregistration.json").read_text())["hash"] == \
        hypotheses_hash(hyps)
    changed = [Hypothesis(**{**H1, "direction": "two-sided"})]
    assert any("PRE-REGISTRATION BROKEN" in p for p in preregistration_problems(tmp_path, changed))
    late = tmp_path / "late"
    late.mkdir()
    (late / "results.jsonl").write_text('{"model": "mlm@100%"}\n')
    record_preregistration(late, hyps, "abc")
    assert any("not pre-registered" in p for p in preregistration_problems(late, hyps))
    assert any("never recorded" in p for p in preregistration_problems(tmp_path / "none", hyps))


def test_v2_study_loads_and_its_power_figures_are_computed_ones() -> None:
    """studies/cpu_replication_v2.yaml: arms x seeds paired runs, three hypotheses, and the
    detectable effects its notes (and docs/study.md) quote are what detectable_dz gives."""
    from pathlib import Path

    from mlsm.study.spec import load_study

    root = Path(__file__).resolve().parents[1]
    spec = load_study(root / "studies" / "cpu_replication_v2.yaml")
    assert spec.seeds == [0, 1, 2, 3, 4] and len(spec.arms) == 10
    assert [h.id for h in spec.hypotheses] == ["H1", "H2", "H3"]
    quoted = ", ".join(f"{detectable_dz(n, 0.05, 'greater'):.2f} at {n}" for n in (3,))
    assert quoted in spec.notes  # "2.30 at 3"
    for n in (3, 4, 5, 6):
        for alpha in (0.05, 0.05 / 3):
            figure = f"{detectable_dz(n, alpha, 'greater'):.2f}"
            assert figure in spec.notes and figure in (root / "docs" / "study.md").read_text()
    for n, bound in ((3, "0.44"), (5, "0.74")):
        assert f"{1 / detectable_dz(n, 0.05, 'greater'):.2f}" == bound and bound in spec.notes


def test_report_prints_a_tiny_p_value_as_a_number_not_as_zero() -> None:
    """p = 8.2e-6 is printed with 3 significant digits in both tables; four decimals showed it
    as 0.0000, which reads as p = 0."""
    from mlsm.study.hypotheses import comparison_lines, report_lines

    h = Hypothesis(id="H1", a="x@100%", b="y@100%", kind="masked", task="heldout", metric="top1")
    row = {"id": "H1", "a": h.a, "b": h.b, "kind": h.kind, "task": h.task, "metric": h.metric,
           "n": 5, "a_values": [0.2] * 5, "b_values": [0.1] * 5, "mean_diff": 0.1,
           "ci95": [0.09, 0.11], "sd_diff": 0.003, "p": 8.164e-6, "p_holm": 2.449e-5,
           "decision": "supported", "mde80": 0.004, "mde80_first_step": 0.006, "note": ""}
    table = "\n".join(report_lines([h], [row], []))
    assert "| 8.16e-06 | 2.45e-05 | supported |" in table and "0.0000" not in table
    assert "| 0.1000 [0.0900, 0.1100] | 0.0030 | 8.16e-06 |" in "\n".join(comparison_lines([row]))
