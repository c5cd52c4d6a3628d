"""The v1 study page (docs/results/cpu_replication/README.md) and the demo page
(docs/results/demo/README.md) are written by hand from what `mlsm study report` and `mlsm demo`
wrote beside them, and the README's Results section copies their tables again. Every number of
those tables must be what those files say, rounded as
printed; a number the page copied from the already-rounded report.md may differ by half a unit of
each. (The v2 page has its own test: tests/test_results_v2_page.py.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from .pages import agree, agree_rounded, rows

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
V1 = RESULTS / "cpu_replication"
DEMO = RESULTS / "demo"


def _model(name: str) -> str:
    """The report's model name of a page's 'MLSM l=5 @ 50 %' / 'MLM @ 100 %'."""
    m = re.fullmatch(r"(MLM|MLSM l\s*=\s*(\d+))\s*@\s*(\d+)\s*%", name.strip())
    assert m, f"unreadable model name {name!r}"
    arm = "mlm" if m.group(1) == "MLM" else f"mlsm_l{m.group(2)}"
    return f"{arm}@{m.group(3)}%"


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _wins(report_row: list[str]) -> list[float]:
    """A/B wins of a report.md headline row: its "4/15 | 9/15" is a page's "4 vs 9"."""
    return [float(report_row[i].split("/")[0]) for i in (2, 3)]


def _demo(arm: str) -> tuple[dict, dict, dict, float]:
    """The demo's held-out masked tokens, word-order pairs, BLiMP subset and SST-2 accuracy."""
    record = _json(DEMO / "blimp" / f"{arm}@100pct.json")
    finetune = _json(DEMO / "summary.json")["finetune"]
    sst2 = dict(zip(finetune["models"], (m[0] for m in finetune["mean"]), strict=True))
    sets = record["sets"]
    return record["heldout"], sets["heldout_prose_word_order"], sets["blimp"], sst2[f"{arm}@100%"]


DEMO_ROWS = [("mlm", "MLM"), ("mlsm", "MLSM, through its probe")]


def _report_table(heading: str) -> dict[tuple[str, str], list[str]]:
    """report.md's headline table under `heading`: (A, B) -> its cells."""
    text = (V1 / "report.md").read_text()
    table = text[text.index(heading):].split("\n## ")[0]
    return {(r[0], r[1]): r for r in rows(table, "") if "@" in r[0]}


@pytest.fixture(scope="module")
def v1_page() -> str:
    return (V1 / "README.md").read_text()


def test_v1_headline_table_is_the_report(v1_page) -> None:
    per_run = _report_table("one pair per run, its metrics averaged")
    per_metric = _report_table("one pair per fine-tuning run and metric")
    headline = [r for r in rows(v1_page, "") if len(r) == 8 and r[0].startswith(("MLSM", "MLM"))]
    assert len(headline) == 5, "the page's headline table must have the five comparisons"
    for cells in headline:
        pair, where = (_model(cells[0]), _model(cells[1])), f"v1 headline {cells[0]} vs {cells[1]}"
        looks = [(cells[2:5], per_run[pair]), (cells[5:8], per_metric[pair])]
        for (wins, mean, p), report in looks:
            agree(wins, _wins(report), where)
            agree_rounded(mean, report[7], where)
            agree_rounded(p, report[6], where)


def test_v1_average_table_is_the_summary(v1_page) -> None:
    finetune = _json(V1 / "summary.json")["finetune"]
    means = (sum(m) / len(m) for m in finetune["mean"])  # the mean of the 7 metrics' seed means
    average = dict(zip(finetune["models"], means, strict=True))
    arms = {"MLM": "mlm", "MLSM l = 5": "mlsm_l5", "MLSM l = 6": "mlsm_l6"}
    checked = 0
    for cells in rows(v1_page, ""):
        if cells[0] in arms and len(cells) == 4:
            agree(" ".join(cells[1:]), [100 * average[f"{arms[cells[0]]}@{p}%"]
                                        for p in (25, 50, 100)], f"v1 average {cells[0]}")
            checked += 1
    assert checked == 3, "the page's average dev score table must have a row per arm"


def test_v1_blimp_tables_are_the_records(v1_page) -> None:
    checked = 0
    for cells in rows(v1_page, ""):
        m = re.match(r"(MLM|MLSM l=\d+) @ 100 %", cells[0])
        if not m or len(cells) != 5:
            continue
        record = _json(V1 / "blimp" / f"{_model(m.group(0)).replace('%', 'pct')}.json")
        blimp = record["sets"]["blimp"]
        probe, held = record["probe"], record["heldout"]  # latent arms: through their probe
        top1, loss = (probe["heldout_top1"], probe["heldout_loss"]) if probe \
            else (held["top1"], held["loss"])
        where = f"v1 BLiMP {cells[0]}"
        agree(" ".join(cells[1:]), [100 * blimp["overall"], blimp["p_vs_chance"], 100 * top1, loss],
              where)
        checked += 1
    assert checked == 4, "the page's two BLiMP tables must have their four rows"


def test_v1_blimp_pair_sentence_is_the_summary(v1_page) -> None:
    pair = next(p for p in _json(V1 / "summary.json")["blimp_pairs"]
                if (p["a"], p["b"]) == ("mlsm_l5@100%", "mlm@100%"))
    sentence = re.search(r"MLSM − MLM = (.+?two-sided\s+p = [\d.]+)", v1_page, re.S)
    assert sentence, "the page must state MLSM l = 5 − MLM paired by phenomenon"
    agree(sentence.group(1).replace("p(MLSM > MLM)", "").replace("p(MLM > MLSM)", ""),
          [100 * pair["mean_diff"], pair["wins_a"], pair["wins_b"], pair["p_a_better"],
           pair["p_b_better"], pair["p_two_sided"]], "v1 BLiMP MLSM − MLM")


def test_demo_table_is_the_demo_records() -> None:
    page = (DEMO / "README.md").read_text()
    header = next(r for r in rows(page, "model") if "held-out masked top-1" in r[1])
    for arm, label in DEMO_ROWS:
        held, order, blimp, sst2 = _demo(arm)
        [cells] = [r for r in rows(page, label) if r[0] == label]
        agree(cells[1], [100 * held["top1"], held["p_vs_unigram"]], f"demo {label} masked")
        agree(cells[2], [100 * order["overall"], order["p_vs_chance"]], f"demo {label} order")
        agree(cells[3], [100 * blimp["overall"], blimp["tests"]["p_vs_control"], 50,  # vs 50 %
                         blimp["tests"]["p_vs_chance"]], f"demo {label} BLiMP")
        agree(cells[4], [100 * sst2], f"demo {label} SST-2")
        counts = [100 * held["unigram_top1"], held["n"], order["n_pairs"], 100 * order["control"],
                  blimp["n_pairs"], 100 * blimp["control"]]
        agree(" ".join(header[1:4]).replace("top-1", "top"), counts, "demo header")


def _readme_results() -> str:
    text = (RESULTS.parents[1] / "README.md").read_text()
    return text[text.index("## Results"):].split("\n## ")[0]


def test_readme_v1_table_is_the_report() -> None:
    per_run = _report_table("one pair per run, its metrics averaged")
    per_metric = _report_table("one pair per fine-tuning run and metric")
    summary = _json(V1 / "summary.json")
    blimp = {b["arm"]: b["overall"] for b in summary["blimp"]}
    pairs = {(p["a"], p["b"]): p for p in summary["blimp_pairs"]}
    checked = 0
    for cells in rows(_readme_results(), ""):
        names = cells[0].removeprefix("BLiMP, ").split(" vs ")
        if len(names) != 2 or "@" not in cells[0]:
            continue
        a, b = names
        b = f"MLSM {b}" if b.startswith("l=") else b
        if "@" not in a:  # "BLiMP, MLSM l=5 vs MLM @ 100 %": both at the readiness named last
            a += b[b.index(" @"):]
        pair, where = (_model(a), _model(b)), f"README v1 {cells[0]}"
        if cells[0].startswith("BLiMP"):
            p = pairs[pair]
            agree(cells[1], [p["wins_a"], p["wins_b"]], where)
            arm_a, arm_b = (name.split("@")[0] for name in pair)
            agree(cells[2], [100 * blimp[arm_a], 100 * blimp[arm_b], 100 * p["mean_diff"]], where)
            agree(cells[3], [p["p_two_sided"], p["n_phenomena"]], where)
        else:
            report = per_run[pair]
            agree(cells[1], _wins(report), where)
            agree_rounded(cells[2], report[7], where)
            agree_rounded(cells[3], report[6], where)
            agree_rounded(cells[4], per_metric[pair][6], where)
        checked += 1
    assert checked == 7, "the README's v1 table must have its five headline and two BLiMP rows"


def test_readme_demo_table_is_the_demo_records() -> None:
    results = _readme_results()
    start = results.index("**`mlsm demo`")
    demo = results[start:results.find("\n**", start + 1)]  # up to the next bold lead-in
    for arm, label in DEMO_ROWS:
        held, order, blimp, sst2 = _demo(arm)
        [cells] = [r for r in rows(demo, label) if r[0] == label]
        where = f"README demo {label}"
        agree(cells[1], [100 * held["top1"], held["p_vs_unigram"]], where)
        agree(cells[2], [100 * order["overall"], order["p_vs_chance"]], where)
        agree(cells[3], [100 * blimp["overall"], blimp["tests"]["p_vs_control"]], where)
        agree(cells[4], [100 * sst2], where)
