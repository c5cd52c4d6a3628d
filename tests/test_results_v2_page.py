"""docs/results/cpu_replication_v2/README.md and the README's v2 table are written by hand from
the latest published study report (`seeds0-N/`). Every number in their hypothesis, detectable
effect and per-task tables must be what that report's summary.json says, rounded as printed:
a hand-copied 0.29 that should read 0.92 fails here, not in a reader's replication."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from mlsm.evaluate.compare.paired import min_detectable_effect
from mlsm.study.spec import load_study

from .pages import agree as _agree
from .pages import rows as _rows

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "docs" / "results" / "cpu_replication_v2"
PAGE = FOLDER / "README.md"
# The probes' metrics as the per-task table names them; acc and F1 are printed in %, MCC and the
# correlations as they are.
PROBE_METRICS = {"mcc", "acc", "f1", "pearson", "spearman"}


def _printed(metric: str) -> int:
    """The factor from a row's value to the page's number (percentages are x 100)."""
    return 100 if metric in {"acc", "f1"} else 1


def _section(text: str) -> str:
    """The page's section of the newest look: from its last `## Seeds 0–N` heading on."""
    starts = [m.start() for m in re.finditer(r"^## Seeds 0", text, re.M)]
    assert starts, f"{PAGE} has no '## Seeds 0–N' section"
    return text[starts[-1]:]


@pytest.fixture(scope="module")
def summary() -> dict:
    """summary.json of the newest look the page links (seeds0-N with the largest N)."""
    looks = sorted({int(n) for n in re.findall(r"\(seeds0-(\d+)/report\.md\)", PAGE.read_text())})
    assert looks, f"{PAGE} links no seeds0-N/report.md"
    return json.loads((FOLDER / f"seeds0-{looks[-1]}" / "summary.json").read_text())


def test_hypothesis_table_is_the_summary(summary) -> None:
    section = _section(PAGE.read_text())
    for h in summary["hypotheses"]:
        rows = _rows(section, f"{h['id']}:")
        assert len(rows) == 1, f"the page's newest section has no single {h['id']} row"
        cells, where = rows[0], f"page {h['id']}"
        _agree(cells[1], [100 * v for v in h["a_values"]], where)
        _agree(cells[2], [100 * v for v in h["b_values"]], where)
        _agree(cells[3], [100 * v for v in [h["mean_diff"], *h["ci95"]]], where)
        _agree(cells[4], [100 * h["sd_diff"]], where)
        _agree(cells[5], [h["p"]], where)
        _agree(cells[6], [h["p_holm"]], where)
        # the page may shorten "interim: 4 of 5 seeds, decided at 5" but not change it
        assert cells[7] and h["decision"].startswith(cells[7]), \
            f"{where}: decision {cells[7]!r}, the summary says {h['decision']!r}"


def test_readme_v2_table_is_the_summary(summary) -> None:
    text = (ROOT / "README.md").read_text()
    v2 = text[text.index("**v2, over pre-training seeds"):]
    for h in summary["hypotheses"]:
        rows = _rows(v2, f"{h['id']}:")
        assert rows, f"README's v2 table has no {h['id']} row"
        cells, where = rows[0], f"README {h['id']}"
        _agree(cells[1], [100 * v for v in h["a_values"]], where)
        _agree(cells[2], [100 * v for v in h["b_values"]], where)
        _agree(cells[3], [100 * h["mean_diff"]], where)
        _agree(cells[4], [h["p"], h["p_holm"]], where)
    assert re.search(rf"commit\s+{summary['git_revision'][:7]}", v2), \
        "README's v2 paragraph must name the commit the report was written at"


def test_detectable_effect_table_is_what_min_detectable_effect_computes(summary) -> None:
    hyps = {h.id: h for h in load_study(ROOT / "studies" / "cpu_replication_v2.yaml").hypotheses}
    section = _section(PAGE.read_text())
    header = next(r for r in _rows(section, "") if any("seeds, α" in c for c in r))
    columns = [re.fullmatch(r"at (\d+) seeds, α(/3)?", c) for c in header[1:]]
    assert all(columns), f"detectable-effect header {header} must read 'at N seeds, α[/3]'"
    for h in summary["hypotheses"]:
        spec = hyps[h["id"]]
        cells = next(r for r in _rows(section, h["id"]) if r[0] == h["id"])
        expected = [100 * min_detectable_effect(h["sd_diff"], int(m.group(1)),
                                                spec.alpha / (len(hyps) if m.group(2) else 1),
                                                spec.test, spec.direction) for m in columns]
        _agree(" ".join(cells[1:]), expected, f"detectable effect {h['id']}")


def test_per_task_probe_table_is_the_summary(summary) -> None:
    seeds = summary["hypotheses"][0]["seeds"]
    value = {(r["model"], r["task"], r["metric"]): r for r in summary["readouts"]}
    tasks = {r["task"] for r in summary["readouts"] if r["kind"] == "probe"}
    rows = {}  # task -> cells, from rows whose first word is a task ("STS-B Pearson / Spearman")
    for cells in _rows(_section(PAGE.read_text()), ""):
        words = cells[0].lower().replace("-", "").replace("/", " ").split()
        if words and words[0] in tasks:
            rows[words[0]] = cells
    assert set(rows) == tasks, f"the per-task probe table must have a row per task probed: {tasks}"
    for task, cells in rows.items():
        metrics = [w for w in cells[0].lower().split() if w in PROBE_METRICS]
        for cell, arm in [(cells[1], "mlsm_l5"), (cells[2], "mlm")]:
            _agree(cell, [_printed(m) * value[(f"{arm}-s{seed}@100%", task, m)]["value"]
                          for seed in seeds for m in metrics], f"{task} {arm}")
        first = f"mlm-s{seeds[0]}@100%"
        _agree(cells[3], [_printed(m) * value[(first, task, m)]["control"] for m in metrics],
               f"{task} control")
