"""compare_runs against an exact Wilcoxon by enumeration and known win counts; report PNGs."""

from __future__ import annotations

import csv
import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from mlsm.artifacts.results_file import append_results, read_results
from mlsm.evaluate.compare.report import make_report
from mlsm.evaluate.compare.stats import compare_runs, wilcoxon_p

CELLS = [(task, metric, seed) for task, metric in (("sst2", "acc"), ("mrpc", "acc"), ("mrpc", "f1"))
         for seed in range(3)]  # 9 paired cells
BASE = np.array([0.80, 0.81, 0.79, 0.70, 0.72, 0.71, 0.75, 0.77, 0.74])
UP = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9]) * 1e-3  # A beats B everywhere
MIXED = np.array([15, 18, -16, -9, 7, -24, 17, 3, 20]) * 1e-3  # C beats B in 6 of 9; no tied |d|


def _exact_null(d: np.ndarray) -> tuple[float, np.ndarray]:
    """Observed T+ and its null distribution over all 2^n sign patterns (no ties, no zeros)."""
    ranks = np.argsort(np.argsort(np.abs(d))) + 1
    dist = np.array([sum(r for r, s in zip(ranks, signs, strict=True) if s)
                     for signs in itertools.product([0, 1], repeat=len(d))])
    return ranks[d > 0].sum(), dist


def exact_wilcoxon_p(d: np.ndarray) -> float:
    """Two-sided exact signed-rank p-value by enumeration."""
    t_obs, dist = _exact_null(d)
    return min(1.0, 2 * min(np.mean(dist <= t_obs), np.mean(dist >= t_obs)))


def exact_greater_p(d: np.ndarray) -> float:
    """One-sided exact p-value of "the differences d are shifted above 0": P(T+ >= observed)."""
    t_obs, dist = _exact_null(d)
    return float(np.mean(dist >= t_obs))


def _row(model: str, cell: tuple[str, str, int], value: float, **extra: object) -> dict:
    task, metric, seed = cell
    row = {
        "model": model,
        "task": task,
        "metric": metric,
        "seed": seed,
        "value": float(value),
        "lr": 2e-5,
        "epochs": 3,
        "batch_size": 32,
        "max_len": 128,
        "n_train": 100,
        "step": None,
        "readiness": None,
        "objective": None,
        "run": None,
    }
    row.update(extra)
    return row


@pytest.fixture
def results(tmp_path: Path) -> Path:
    path = tmp_path / "results.jsonl"
    rows = [
        _row("B", c, v, run="r", readiness=0.5, step=50) for c, v in zip(CELLS, BASE, strict=True)
    ]
    rows += [
        _row("A", c, v, run="r", readiness=1.0, step=100)
        for c, v in zip(CELLS, BASE + UP, strict=True)
    ]
    rows += [_row("C", c, v) for c, v in zip(CELLS, BASE + MIXED, strict=True)]
    rows.append(_row("A", CELLS[0], 0.99, lr=1e-4))  # no partner at this lr: must not be paired
    append_results(path, rows[:10])
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"model": "A", "task": "ss')  # a writer killed mid-line
    append_results(path, rows[10:])
    return path


def test_exact_enumeration_matches_known_values() -> None:
    # n = 3, all positive: T+ = 6 is the single most extreme of 8 patterns -> p = 2/8
    assert exact_wilcoxon_p(np.array([1.0, 2.0, 3.0])) == pytest.approx(0.25)
    assert exact_wilcoxon_p(UP) == pytest.approx(2 / 2**9)


def test_compare_pvalues_and_wins(results: Path) -> None:
    rows = read_results(results)
    assert len(rows) == 28  # the torn line is skipped
    cmp = compare_runs(results)
    a, b, c = (cmp.models.index(m) for m in "ABC")
    two = cmp.pvalues_two_sided
    assert two[a, b] == pytest.approx(exact_wilcoxon_p(UP))
    assert two[c, b] == pytest.approx(exact_wilcoxon_p(MIXED))
    assert two[b, c] == pytest.approx(two[c, b])  # two-sided: symmetric
    assert two[a, c] == pytest.approx(exact_wilcoxon_p(UP - MIXED))
    assert math.isnan(cmp.pvalues[a, a]) and math.isnan(two[a, a])
    assert (cmp.wins[a, b], cmp.wins[b, a]) == (9, 0)
    assert (cmp.wins[c, b], cmp.wins[b, c]) == (6, 3)
    assert cmp.n_pairs[a, b] == 9 and cmp.n_pairs[a, c] == 9


def test_significance_is_directional(results: Path, tmp_path: Path) -> None:
    """The Hitchhikers' Guide's Fig. 2b/3b: a * at (i, j) means i is significantly better than j, so
    of the pair (A beats B on all 9 cells) only (A, B) carries a star, and p is the one-sided exact
    p."""
    cmp = compare_runs(results, tmp_path / "out")
    a, b, c = (cmp.models.index(m) for m in "ABC")
    assert cmp.pvalues[a, b] == pytest.approx(exact_greater_p(UP)) == pytest.approx(1 / 2**9)
    assert cmp.pvalues[b, a] == pytest.approx(exact_greater_p(-UP)) == pytest.approx(1.0)
    assert cmp.pvalues[c, b] == pytest.approx(exact_greater_p(MIXED))
    assert cmp.pvalues[b, c] == pytest.approx(exact_greater_p(-MIXED))
    table = cmp.pvalue_table()
    assert table[a][b].endswith("*") and not table[b][a].endswith("*")
    for i in range(3):  # never both cells of a pair
        for j in range(3):
            assert not (table[i][j].endswith("*") and table[j][i].endswith("*"))
    with open(tmp_path / "out" / "pvalues_two_sided.csv", encoding="utf-8") as f:
        two = {r["model"]: r for r in csv.DictReader(f)}
    assert (
        float(two["A"]["B"])
        == pytest.approx(exact_wilcoxon_p(UP))
        == pytest.approx(float(two["B"]["A"]))
    )


def test_means_and_markdown(results: Path, tmp_path: Path) -> None:
    cmp = compare_runs(results, tmp_path / "out")
    b = cmp.models.index("B")
    col = cmp.columns.index(("mrpc", "f1"))
    assert cmp.mean[b, col] == pytest.approx(np.mean(BASE[6:9]))
    assert cmp.std[b, col] == pytest.approx(np.std(BASE[6:9], ddof=1))
    assert (
        cmp.count[cmp.models.index("A"), cmp.columns.index(("sst2", "acc"))] == 4
    )  # + the other-lr run
    md = (tmp_path / "out" / "comparison.md").read_text(encoding="utf-8")
    assert f"{1 / 2**9:.3g}*" in md  # A better than B at p < 0.01 (one-sided)
    assert f"{exact_greater_p(MIXED):.3g} |" in md
    assert "9/9" in md and "6/9" in md and "3/9" in md
    assert f"{100 * np.mean(BASE[6:9]):.2f} ± {100 * np.std(BASE[6:9], ddof=1):.2f}" in md
    with open(tmp_path / "out" / "wins.csv", encoding="utf-8") as f:
        wins = {r["model"]: r for r in csv.DictReader(f)}
    assert wins["A"]["B"] == "9" and wins["C"]["B"] == "6"
    assert (tmp_path / "out" / "pvalues.csv").is_file() and (
        tmp_path / "out" / "means.csv"
    ).is_file()


def test_wilcoxon_edge_cases() -> None:
    x = np.array([0.5, 0.6, 0.7])
    assert wilcoxon_p(x, x) == 1.0
    assert math.isnan(wilcoxon_p(np.array([]), np.array([])))


def test_append_is_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "r.jsonl"
    append_results(path, [_row("A", CELLS[0], 0.5)])
    append_results(path, [])
    append_results(path, [_row("B", CELLS[0], 0.6), _row("B", CELLS[1], 0.7)])
    lines = path.read_text(encoding="utf-8").splitlines()
    assert [json.loads(x)["model"] for x in lines] == ["A", "B", "B"]


def test_report_writes_valid_pngs(results: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    md_path = make_report(results, out)
    text = md_path.read_text(encoding="utf-8")
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["paired_mrpc.png", "paired_sst2.png", "readiness.png", "wilcoxon.png"]
    for name in pngs:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        img = imread(out / name)
        assert img.ndim == 3 and img.shape[0] > 50 and img.shape[1] > 50
        assert f"]({name})" in text
    assert "Wilcoxon" in text and "9/9" in text
    assert not list(out.glob("*.tmp*"))


def test_report_per_run_pairs_runs_not_metrics(results: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """`mlsm report --per-run`: the report's tables are compare_runs(per_run=True)'s (MRPC's acc
    and F1 one pair per run: 6 pairs of the fixture's 9 cells), and it says which pairing it is."""
    from mlsm.cli import main

    assert main(["report", str(results), "--per-run", "--out", str(tmp_path / "r")]) == 0
    assert "report.md" in capsys.readouterr().out
    text = (tmp_path / "r" / "report.md").read_text(encoding="utf-8")
    assert "one pair per fine-tuning run, its metrics averaged" in text
    expected = compare_runs(results, per_run=True)
    c, b = expected.models.index("C"), expected.models.index("B")
    assert expected.n_pairs[c, b] == 6 and f"{int(expected.wins[c, b])}/6" in text
    with open(tmp_path / "r" / "means.csv", encoding="utf-8") as f:
        assert {r["metric"] for r in csv.DictReader(f)} == {"run_mean"}
    assert "one pair per fine-tuning run and metric" in make_report(
        results, tmp_path / "m").read_text(encoding="utf-8")


def test_select_best_lr_on_validation_then_pair(tmp_path: Path) -> None:
    """Per model and task the lr with the best mean *validation* score is kept (a test metric that
    favours another lr never chooses), and models tuned to different lrs still pair by seed."""
    path = tmp_path / "r.jsonl"
    rows = []
    for seed in range(4):
        for model, good_lr in (("A", 1e-5), ("B", 5e-5)):
            for lr in (1e-5, 5e-5):
                val = (
                    0.8
                    + 0.01 * seed
                    + (0.05 if lr == good_lr else 0.0)
                    + (0.01 if model == "A" else 0.0)
                )
                rows.append(_row(model, ("mrpc", "acc", seed), val, lr=lr))
                rows.append(
                    _row(model, ("mrpc", "acc_test", seed), 0.9 if lr != good_lr else 0.1, lr=lr)
                )
    append_results(path, rows)
    plain = compare_runs(path)
    cmp = compare_runs(path, tmp_path / "out", select_lr=True)
    assert cmp.info["A"]["best_lr"] == {"mrpc": 1e-5} and cmp.info["B"]["best_lr"] == {"mrpc": 5e-5}
    a, b = cmp.models.index("A"), cmp.models.index("B")
    col = cmp.columns.index(("mrpc", "acc"))
    assert cmp.mean[a, col] == pytest.approx(0.8 + 0.015 + 0.05 + 0.01)
    assert cmp.mean[b, col] == pytest.approx(0.8 + 0.015 + 0.05)
    assert cmp.mean[a, cmp.columns.index(("mrpc", "acc_test"))] == pytest.approx(
        0.1
    )  # the chosen lr's test
    assert (
        cmp.n_pairs[a, b] == 4 and cmp.wins[a, b] == 4
    )  # 4 seeds × acc, paired across lrs (acc_test is reported, never paired)
    assert plain.count[a, col] == 8 and cmp.count[a, col] == 4


def test_bootstrap_ci_of_mean_differences(results: Path, tmp_path: Path) -> None:
    cmp = compare_runs(results, tmp_path / "out", bootstrap=2000)
    a, b, c = (cmp.models.index(m) for m in "ABC")
    assert cmp.ci[a, b, 0] == pytest.approx(UP.mean())
    assert (
        0 < cmp.ci[a, b, 1] < UP.mean() < cmp.ci[a, b, 2] < UP.max()
    )  # A better everywhere: CI > 0
    assert cmp.ci[c, b, 1] < MIXED.mean() < cmp.ci[c, b, 2]
    np.testing.assert_allclose(cmp.ci[b, a], -cmp.ci[a, b][[0, 2, 1]])  # same resamples, mirrored
    assert np.isnan(cmp.ci[a, a]).all()
    with open(tmp_path / "out" / "mean_diff_ci.csv", encoding="utf-8") as f:
        ci = {(r["model"], r["other"]): r for r in csv.DictReader(f)}
    assert (
        float(ci[("A", "B")]["mean_diff"]) == pytest.approx(UP.mean())
        and ci[("A", "B")]["n"] == "9"
    )
    assert "bootstrap CI" in (tmp_path / "out" / "comparison.md").read_text(encoding="utf-8")
    assert compare_runs(results).ci is None


def exact_wilcoxon_p_ties(d: np.ndarray, alternative: str = "two-sided") -> float:
    """Exact signed-rank p by enumeration, zero differences dropped (Wilcoxon 1945) and tied |d|
    given their mid-rank; the statistic T+ is compared over all 2^n sign patterns."""
    d = d[d != 0]
    order = np.abs(d)
    ranks = np.array([np.sum(order < v) + (np.sum(order == v) + 1) / 2 for v in order])  # mid-ranks
    t_obs = ranks[d > 0].sum()
    dist = np.array([sum(r for r, s in zip(ranks, signs, strict=True) if s)
                     for signs in itertools.product([0, 1], repeat=len(d))])
    upper, lower = np.mean(dist >= t_obs - 1e-9), np.mean(dist <= t_obs + 1e-9)
    return {"greater": upper, "less": lower, "two-sided": min(1.0, 2 * min(upper, lower))}[
        alternative
    ]


def test_pairing_survives_shuffles_dropped_seeds_ties_and_zeros(tmp_path: Path) -> None:
    # dyadic values (k/128) so that tied differences are exactly tied in floating point
    cells = [(task, "acc", seed) for task in ("sst2", "mrpc") for seed in range(6)]  # 12 cells
    base = np.array([90, 95, 93, 88, 91, 97, 70, 72, 75, 71, 74, 73]) / 128
    diff = np.array([2, 2, -1, 0, 3, -2, 1, 2, 0, 4, 2, -3]) / 128  # ties (|d| = 2, 1) and zeros
    rows = [_row("Y", c, v) for c, v in zip(cells, base, strict=True)]
    rows += [_row("X", c, v) for c, v in zip(cells, base + diff, strict=True)]
    rng = np.random.default_rng(0)
    rows = [rows[i] for i in rng.permutation(len(rows))]  # any row order
    rows = [
        r for r in rows if not (r["model"] == "X" and r["task"] == "mrpc" and r["seed"] == 5)
    ]  # X lacks a seed
    rows.append(_row("X", cells[0], 0.5, lr=1e-4))  # and has a run no Y run pairs with
    append_results(tmp_path / "r.jsonl", rows)
    cmp = compare_runs(tmp_path / "r.jsonl")
    x, y = cmp.models.index("X"), cmp.models.index("Y")
    d = diff[:-1]  # the 11 common cells
    assert cmp.n_pairs[x, y] == cmp.n_pairs[y, x] == 11
    assert (cmp.wins[x, y], cmp.wins[y, x]) == (int((d > 0).sum()), int((d < 0).sum()))
    expected = exact_wilcoxon_p_ties(d)
    assert expected != pytest.approx(exact_wilcoxon_p_ties(diff))  # the dropped seed matters
    assert cmp.pvalues_two_sided[x, y] == pytest.approx(expected, rel=1e-9)
    assert cmp.pvalues_two_sided[y, x] == pytest.approx(expected, rel=1e-9)
    # directional: (row, column) tests "row better than column" (one-sided, as the Hitchhikers'
    # Guide's Fig. 2b)
    assert cmp.pvalues[x, y] == pytest.approx(exact_wilcoxon_p_ties(d, "greater"), rel=1e-9)
    assert cmp.pvalues[y, x] == pytest.approx(exact_wilcoxon_p_ties(d, "less"), rel=1e-9)


def test_per_run_pairs_one_score_per_run(results: Path, tmp_path: Path) -> None:
    """`per_run`: MRPC's acc and F1 of one run become one pair (their mean), so the 9 (run, metric)
    cells of the fixture are 6 runs, and p is the exact Wilcoxon p of the per-run differences."""
    def per_run(d: np.ndarray) -> np.ndarray:  # sst2 seeds 0-2, then mrpc (acc + f1) / 2 per seed
        return np.concatenate([d[:3], (d[3:6] + d[6:9]) / 2])

    cmp = compare_runs(results, tmp_path / "out", per_run=True)
    a, b, c = (cmp.models.index(m) for m in "ABC")
    assert cmp.columns == [("sst2", "run_mean"), ("mrpc", "run_mean")]
    assert cmp.n_pairs[a, b] == 6 and cmp.n_pairs[c, b] == 6
    assert cmp.pvalues_two_sided[c, b] == pytest.approx(exact_wilcoxon_p(per_run(MIXED)))
    assert cmp.pvalues[c, b] == pytest.approx(exact_greater_p(per_run(MIXED)))
    assert cmp.wins[c, b] == int(np.sum(per_run(MIXED) > 0))
    mrpc = cmp.columns.index(("mrpc", "run_mean"))
    assert cmp.mean[b, mrpc] == pytest.approx(per_run(BASE)[3:].mean())
    # a run's test metrics are averaged apart from its validation metrics, never with them
    path = tmp_path / "test.jsonl"
    append_results(path, [_row(m, ("mrpc", metric, s), v + (0.1 if m == "A" else 0) + s / 100)
                          for m in "AB" for s in range(3)
                          for metric, v in (("acc", 0.8), ("f1", 0.7), ("acc_test", 0.2))])
    split = compare_runs(path, per_run=True)
    assert split.columns == [("mrpc", "run_mean"), ("mrpc", "run_mean_test")]
    col = split.columns.index(("mrpc", "run_mean_test"))
    assert split.mean[split.models.index("B"), col] == pytest.approx(0.21)


def test_compare_cli_per_run(results: Path, tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    from mlsm.cli import main

    main(["compare", str(results), "--per-run", "--out", str(tmp_path / "cmp")])
    assert "run_mean" in capsys.readouterr().out
    with open(tmp_path / "cmp" / "means.csv", encoding="utf-8") as f:
        assert {r["metric"] for r in csv.DictReader(f)} == {"run_mean"}


def test_test_set_metrics_are_reported_never_tested(results: Path, tmp_path: Path) -> None:
    """`--eval-test` rows (<metric>_test) appear in the means table, but the p-values, wins, pair
    counts, bootstrap CIs and averages equal those of the same file without them."""
    with_test = tmp_path / "with_test.jsonl"
    with_test.write_bytes(results.read_bytes())
    # test scores that would change every statistic: C far above A and B on f1_test
    extra = [_row(m, ("conll2003", "f1_test", s), v + (0.5 if m == "C" else 0.0))
             for m in "ABC" for s, v in enumerate((0.60, 0.61, 0.62))]
    append_results(with_test, extra)
    for per_run in (False, True):
        ref = compare_runs(results, bootstrap=200, per_run=per_run)
        got = compare_runs(with_test, bootstrap=200, per_run=per_run)
        assert got.models == ref.models
        for field in ("pvalues", "pvalues_two_sided", "wins", "n_pairs", "ci"):
            np.testing.assert_array_equal(getattr(got, field), getattr(ref, field))
        assert [r[-1] for r in got.mean_table()] == [r[-1] for r in ref.mean_table()]
        test_col = [c for c in got.columns if c[1].endswith("_test")]
        assert len(test_col) == 1
        c, col = got.models.index("C"), got.columns.index(test_col[0])
        assert got.mean[c, col] == pytest.approx(np.mean([1.10, 1.11, 1.12]))
        md = got.to_markdown()
        assert "Test-set scores (conll2003 " in md and "dev metrics alone" in md
        assert "Test-set" not in ref.to_markdown()
