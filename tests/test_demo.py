"""`mlsm demo`: where its evaluation data comes from (without network) and its summary."""

from __future__ import annotations

import json
import math
import re
import socket
from pathlib import Path

import pytest

from mlsm.demo import demo_study, hub_reachable, select_eval_data, summary_lines
from mlsm.errors import UserError
from mlsm.study.runner import Study


def _no_network(*args, **kwargs):
    raise AssertionError("tried to open a connection")


def test_hub_offline_never_touches_the_network(monkeypatch) -> None:
    monkeypatch.setattr(socket, "create_connection", _no_network)
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
        monkeypatch.setenv(var, "1")
        assert hub_reachable() is False


def test_unreachable_hub_is_false_within_the_timeout(monkeypatch) -> None:
    seen = {}

    def refuse(address, timeout=None):
        seen["timeout"] = timeout
        raise OSError("network is unreachable")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(socket, "create_connection", refuse)
    assert hub_reachable(timeout=2.0) is False
    assert seen["timeout"] == 2.0  # a bounded wait, never the OS's minutes-long default


def _shared(tmp_path: Path, glue: bool, blimp: bool) -> Path:
    root = tmp_path / "shared"
    if glue:
        (root / "glue" / "SST-2").mkdir(parents=True)
    if blimp:
        (root / "blimp").mkdir(parents=True)
    return root


def test_local_data_comes_first_and_the_hub_is_not_asked(tmp_path) -> None:
    shared = _shared(tmp_path, glue=True, blimp=True)
    glue, blimp = select_eval_data(shared, online=_no_network, log=_no_network)
    assert (glue, blimp) == (str(shared / "glue"), str(shared / "blimp"))


def test_without_local_data_the_hub_datasets_are_used_when_reachable(tmp_path) -> None:
    logged: list[str] = []
    assert select_eval_data(None, online=lambda: True, log=logged.append) == ("", "nyu-mll/blimp")
    # only BLiMP local: SST-2 from the Hub, BLiMP from the folder
    shared = _shared(tmp_path, glue=False, blimp=True)
    chosen = select_eval_data(shared, online=lambda: True, log=logged.append)
    assert chosen == ("", str(shared / "blimp"))
    assert logged == []


def test_offline_without_local_data_is_one_line_naming_the_flag(tmp_path) -> None:
    logged: list[str] = []
    assert select_eval_data(None, online=lambda: False, log=logged.append) == (None, None)
    assert len(logged) == 1 and "SST-2 and BLiMP" in logged[0] and "--data" in logged[0]


def test_demo_study_uses_what_was_selected(tmp_path) -> None:
    pairs, held = tmp_path / "pairs", tmp_path / "held"
    spec = demo_study(tmp_path / "out", "corpus.txt", pairs, held, "", "nyu-mll/blimp", 8, 4, 2, 3)
    assert spec.finetune.tasks == ["sst2"] and spec.finetune.data_dir == ""  # "" = HF datasets
    assert spec.blimp.data == [str(pairs), "nyu-mll/blimp"] and spec.blimp.limits == [0, 3]
    assert spec.blimp.heldout_store == str(held)
    spec = demo_study(tmp_path / "out", "corpus.txt", pairs, held, None, None, 8, 4, 2, 3)
    assert spec.finetune.tasks == [] and spec.blimp.data == [str(pairs)]


def _blimp_row(arm: str, overall: float, top1: float) -> dict:
    return {"arm": arm, "readiness": 1.0, "overall": overall, "n_pairs": 400,
            "sets": {"pairs": {"overall": overall, "n_pairs": 400, "p_vs_chance": 1e-6,
                               "phenomena": {"swap": overall}}},
            "heldout": {"top1": top1, "unigram_top1": 0.05, "p_vs_unigram": 1e-9, "n": 1000}}


def test_summary_skips_nan_rows_with_one_warning(tmp_path) -> None:
    spec = demo_study(tmp_path / "out", "corpus.txt", tmp_path / "p", tmp_path / "h", "", None,
                      8, 4, 2, 3)
    from mlsm.study.reuse import blimp_inputs
    from mlsm.study.sameness import fingerprint_of

    study = Study(spec, log=lambda s: None)
    (study.root / "blimp").mkdir()
    row = _blimp_row("mlm", 0.71, 0.25)
    stale = {**row, "arm": "mlsm"}  # as the blimp stage writes it, of settings since edited
    row["fingerprint"] = fingerprint_of(blimp_inputs(study, "mlm", 1.0))
    (study.root / "blimp" / "mlm@100pct.json").write_text(json.dumps(row))
    (study.root / "blimp" / "mlsm@50pct.json").write_text(json.dumps({**stale, "fingerprint": "0"}))
    nan_row = _blimp_row("mlsm", math.nan, math.nan)
    nan_row["fingerprint"] = fingerprint_of(blimp_inputs(study, "mlsm", 1.0))
    (study.root / "blimp" / "mlsm@100pct.json").write_text(json.dumps(nan_row))
    cell = {"lr": 2e-5, "epochs": 3, "batch_size": 32, "max_len": 128, "n_train": 100}
    rows = [{"model": "mlm@100%", "task": "sst2", "metric": "acc", "seed": s, "value": v, **cell}
            for s, v in enumerate([0.6, math.nan, 0.7])]
    study.results.write_text("".join(json.dumps(r) + "\n" for r in rows))  # json writes NaN as NaN
    lines = summary_lines(study)
    warnings = [x for x in lines if x.startswith("warning")]
    assert len(warnings) == 1 and "3 result(s)" in warnings[0]
    body = [x for x in lines if not x.startswith("warning")]
    assert not any("nan" in x.lower() for x in body)
    assert "mlm@100% sst2 acc: 65.0 (mean of 2 seeds)" in body
    assert any(x.startswith("mlm@100%: held-out masked top-1 25.0 % (unigram 5.0 %") for x in body)
    assert not any(x.startswith("mlsm@100%:") for x in body)


@pytest.mark.parametrize("k,n,expected", [(60, 100, 0.0569), (50, 100, 1.0)])
def test_binomial_p_is_scipys_two_sided_test(k, n, expected) -> None:
    from mlsm.study.stages import binomial_p

    assert binomial_p(k, n, 0.5) == pytest.approx(expected, abs=1e-4)
    assert math.isnan(binomial_p(0, 0, 0.5))


def test_heldout_masked_tokens_of_the_unigram_equal_its_baseline(store_dir, tmp_path) -> None:
    """A scorer that predicts the unigram distribution of the run's tokens scores exactly the
    reported unigram baseline on the same targets (loss, top-1, p = 1): the baseline is computed
    on the targets the model is scored on."""
    from mlsm.data.corpus import TokenStore
    from mlsm.evaluate.probe.probe_fit import unigram_log_probs
    from mlsm.run_config import config_from_dict
    from mlsm.study.stages import heldout_masked_tokens
    from mlsm.train.loop import pretrain
    from tests.helpers import TINY_MODEL

    cfg = config_from_dict({
        "data": {"store": str(store_dir), "max_len": 32},
        "model": {"arch": "bert", "overrides": dict(TINY_MODEL)},
        "train": {"steps": 2, "batch_size": 4, "out": str(tmp_path / "run"), "readiness": [1.0],
                  "device": "cpu"}})
    pretrain(cfg)
    ck = tmp_path / "run" / "checkpoints" / "step-0000002"
    unigram = unigram_log_probs(ck, len(TokenStore.open(store_dir).load_tokenizer()))  # (V,)

    class UnigramScorer:
        def logits_at(self, input_ids, attention_mask, select):
            return unigram.expand(int(select.sum()), -1)  # (N, V)

    h = heldout_masked_tokens(UnigramScorer(), ck, 3, 4, store=str(store_dir))
    assert h["n"] > 0
    assert h["loss"] == pytest.approx(h["unigram_loss"], rel=1e-5)
    assert h["top1"] == h["unigram_top1"] and h["p_vs_unigram"] == pytest.approx(1.0)


def _demo_text_files(out: Path) -> None:
    """Every file the demo writes before its study starts (each is skipped or rewritten when the
    demo is run again)."""
    from mlsm import demo
    from mlsm.demo import write_pairs

    _, held = demo._write_corpus(out)
    write_pairs(held, out / "pairs")
    demo._heldout_store(held, out)


def _contents(out: Path) -> dict[Path, bytes]:
    """Each file's bytes (a token store's meta.json, which records its path and time, left out)."""
    return {p.relative_to(out): p.read_bytes() for p in out.rglob("*")
            if p.is_file() and p.name != "meta.json"}


def test_a_demo_killed_while_writing_leaves_no_torn_file(tmp_path: Path, monkeypatch) -> None:
    """A demo re-run skips what exists, so a file torn by a kill would be trained or scored on:
    killed in the middle of any of its writes, the demo leaves each file whole or absent, and the
    re-run then writes exactly what an uninterrupted demo writes."""
    from mlsm import demo

    docs = [f"Document number {i} says that the {i % 7} cats sleep. " * 3 for i in range(360)]
    monkeypatch.setattr(demo, "stdlib_prose", lambda: list(docs))
    _demo_text_files(tmp_path / "whole")
    reference = _contents(tmp_path / "whole")
    real = Path.write_text
    for kill_at in range(5):  # each of its five text writes, one per run
        calls = []

        def killed(self: Path, data: str, *args, _at=kill_at, _calls=calls, **kwargs) -> int:
            _calls.append(self)
            if len(_calls) - 1 == _at:  # the process dies halfway through this write
                real(self, data[: len(data) // 2], *args, **kwargs)
                raise KeyboardInterrupt
            return real(self, data, *args, **kwargs)

        out = tmp_path / f"killed-{kill_at}"
        monkeypatch.setattr(Path, "write_text", killed)
        with pytest.raises(KeyboardInterrupt):
            _demo_text_files(out)
        monkeypatch.setattr(Path, "write_text", real)
        for name, data in _contents(out).items():
            assert data == reference[name], f"torn: {name}"
        _demo_text_files(out)
        assert _contents(out) == reference


def test_the_report_names_the_prose_pairs_for_what_they_are(tmp_path) -> None:
    """The demo's first pair set is word-order pairs of held-out prose: the report's table and
    figure heading name it by its set, and nothing calls its accuracy BLiMP."""
    from mlsm.demo import PAIR_SET
    from mlsm.study.report import write_report
    from mlsm.study.reuse import blimp_inputs
    from mlsm.study.sameness import fingerprint_of

    spec = demo_study(tmp_path / "out", "corpus.txt", tmp_path / PAIR_SET, tmp_path / "h", None,
                      "blimp-folder", 8, 4, 2, 3)
    assert Path(spec.blimp.data[0]).name == PAIR_SET
    study = Study(spec, log=lambda s: None)
    (study.root / "blimp").mkdir(parents=True)
    for arm, acc in (("mlm", 0.52), ("mlsm", 0.64)):
        row = _blimp_row(arm, acc, 0.1)
        row["sets"] = {PAIR_SET: {**row["sets"]["pairs"], "phenomena": {"shuffled_words": acc}},
                       "blimp-folder": {"overall": 0.55, "n_pairs": 670, "p_vs_chance": 0.01,
                                        "phenomena": {"anaphor_number_agreement": 0.55}}}
        # as the BLiMP stage writes it: stamped with its inputs' fingerprint (else left out)
        row["fingerprint"] = fingerprint_of(blimp_inputs(study, arm, 1.0))
        (study.root / "blimp" / f"{arm}@100pct.json").write_text(json.dumps(row))
    text = write_report(study).read_text()
    assert f"| model | {PAIR_SET} % | pairs |" in text
    assert "| mlsm@100% | 64.0 | 400 |" in text  # the column holds the prose pairs' accuracy
    assert "BLiMP %" not in text and "## BLiMP" not in text


def test_word_order_pairs_get_one_binomial_p_in_console_and_report(tmp_path) -> None:
    """The demo's word-order pairs (two "phenomena": a Wilcoxon across them cannot go below 0.5)
    are tested by the exact binomial test over their pairs, as the README and the demo page
    quote it; the console summary and the study report print the same p, scipy's binomtest.
    BLiMP keeps its Wilcoxon across phenomena. The rows are the demo's recorded ones."""
    from scipy.stats import binomtest

    from mlsm.demo import PAIR_SET
    from mlsm.evaluate.compare.paired import p_text
    from mlsm.study.report import write_report
    from mlsm.study.reuse import blimp_inputs
    from mlsm.study.sameness import fingerprint_of

    recorded = Path(__file__).resolve().parents[1] / "docs" / "results" / "demo" / "blimp"
    spec = demo_study(tmp_path / "out", "corpus.txt", tmp_path / PAIR_SET, tmp_path / "h", None,
                      str(tmp_path / "blimp"), 8, 4, 2, 3)
    study = Study(spec, log=lambda s: None)
    (study.root / "blimp").mkdir(parents=True)
    row = json.loads((recorded / "mlsm@100pct.json").read_text())
    assert list(row["sets"]) == [PAIR_SET, "blimp"]
    row["fingerprint"] = fingerprint_of(blimp_inputs(study, "mlsm", 1.0))
    (study.root / "blimp" / "mlsm@100pct.json").write_text(json.dumps(row))
    pairs, blimp = row["sets"][PAIR_SET], row["sets"]["blimp"]
    exact = binomtest(pairs["correct"], pairs["n_pairs"], 0.5).pvalue  # 4.2e-8: the README's
    wilcoxon = (p_text(blimp["tests"]["p_vs_control"]), p_text(blimp["tests"]["p_vs_chance"]))
    (line,) = [x for x in summary_lines(study) if x.startswith("mlsm@100%:")]
    console = re.search(rf"{PAIR_SET} 63\.7 % of 400 \(unigram 50\.0 %; exact binomial over 400 "
                        r"pairs: p vs unigram (\S+), p vs 50 % (\S+)\)", line)
    assert console, line
    assert f"blimp 55.5 % of 670 (unigram 56.3 %; Wilcoxon over 67 phenomena: p vs unigram " \
        f"{wilcoxon[0]}, p vs 50 % {wilcoxon[1]})" in line
    text = write_report(study).read_text()
    sets = re.search(r"\| mlsm@100% \| 63\.7 \| 50\.0 \| (\S+) \| (\S+) \| 55\.5 \| 56\.3 \| (\S+) "
                     r"\| (\S+) \|", text)
    first = re.search(r"\| mlsm@100% \| 63\.7 \| 400 \| 50\.0 \| (\S+) \| (\S+) \|", text)
    assert sets and first, text
    assert console.groups() == sets.groups()[:2] == first.groups() == (p_text(exact),) * 2
    assert float(console.group(2)) == pytest.approx(exact, rel=5e-3)
    assert sets.groups()[2:] == wilcoxon


def test_one_seed_report_reads_first_zero_shot_and_never_nan(tmp_path, monkeypatch) -> None:
    """The demo's recorded rows (one SST-2 seed per model): the report opens with the zero-shot
    pair sets, prints "n/a (1 pair)" wherever a paired p-value or interval would stand on one
    pair (never "+nan", never Wilcoxon's formal 0.5 / 1), names the command that generated it and
    says which arms are pre-trained in a readable sentence."""
    import shutil
    import sys

    from mlsm.demo import PAIR_SET
    from mlsm.study.report import write_report
    from mlsm.study.reuse import blimp_inputs
    from mlsm.study.sameness import fingerprint_of

    recorded = Path(__file__).resolve().parents[1] / "docs" / "results" / "demo"
    spec = demo_study(tmp_path / "out", "corpus.txt", tmp_path / PAIR_SET, tmp_path / "h",
                      str(tmp_path / "glue"), str(tmp_path / "blimp"), 8, 4, 1, 3)
    study = Study(spec, log=lambda s: None)
    (study.root / "blimp").mkdir(parents=True)
    for arm in ("mlsm", "mlm"):
        row = json.loads((recorded / "blimp" / f"{arm}@100pct.json").read_text())
        row["fingerprint"] = fingerprint_of(blimp_inputs(study, arm, 1.0))
        (study.root / "blimp" / f"{arm}@100pct.json").write_text(json.dumps(row))
    shutil.copy(recorded / "results.jsonl", study.results)
    monkeypatch.setattr(sys, "argv", ["/venv/bin/mlsm", "demo", "--out", "runs/demo"])
    text = write_report(study, tmp_path / "published").read_text()
    assert "Generated by `mlsm demo --out runs/demo`" in text
    assert "0 of 2 arms pre-trained (none yet); not yet: mlsm, mlm." in text
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    first_result = next(h for h in headings
                        if not any(w in h for w in ("Pre-registered", "Exploratory", "Fixed")))
    assert "pair" in first_result.lower(), headings
    assert headings.index(first_result) < min(i for i, h in enumerate(headings)
                                              if "Wilcoxon" in h or "Fine-tuning" in h)
    assert "nan" not in text.lower()
    headline = [line for line in text.splitlines()
                if line.startswith("| mlsm@100% | mlm@100% | 0/1 | 1/1 |")]  # fine-tuning's
    assert len(headline) == 2, headline
    assert all(line.count("n/a (1 pair)") == 4 for line in headline), headline
    matrix = text.split("## Wilcoxon signed-rank p-values")[1].split("##")[0]
    assert "| mlsm@100% | — | n/a (1 pair) |" in matrix


def test_summary_reads_stage_times_through_the_study_folder(tmp_path) -> None:
    """The demo's stage-time line reads stages.jsonl through `Study.stage_runs`, the one reader of
    that file: a line torn by a killed study is skipped with a warning (json.loads raised on it
    before), and a row of another shape is one line naming the file and line."""
    spec = demo_study(tmp_path / "out", "corpus.txt", tmp_path / "p", tmp_path / "h", "", None,
                      8, 4, 2, 3)
    warned: list[str] = []
    study = Study(spec, log=warned.append)
    row = {"stage": "pretrain", "arm": "mlm", "seconds": 117.0, "cpu_seconds": 57.0,
           "state": "done"}
    (study.root / "stages.jsonl").write_text(json.dumps(row) + '\n{"stage": "probe", "ar')
    assert summary_lines(study)[-1] == "stage wall (CPU) times: pretrain:mlm 117 s (57 s CPU)"
    assert any("torn by a killed writer" in w for w in warned)
    (study.root / "stages.jsonl").write_text(json.dumps({**row, "seconds": "long"}) + "\n")
    with pytest.raises(UserError, match=r"stages.jsonl:1 is not a row the study wrote"):
        summary_lines(study)
