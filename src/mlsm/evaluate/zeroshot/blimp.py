"""BLiMP: zero-shot grammatical knowledge from minimal pairs, scored by PLL.

BLiMP (Warstadt et al. 2020, TACL 8) has 67 paradigms ("phenomena", column `UID`) of 1000 minimal
pairs each; each paradigm has a `field` (morphology, syntax, semantics, syntax_semantics) and a
`linguistics_term` (the paper's 12-13 phenomenon groups). A pair counts as correct when the model
prefers the grammatical sentence: PLL(good) > PLL(bad) (Salazar et al. 2020, §4.2); an exact tie
counts half (`mlsm.evaluate.zeroshot.unigram.pair_credit`: the unigram control ties on every
word-order
pair, and both are scored alike). Reported: accuracy per phenomenon, per field (mean over the
field's phenomena), per `linguistics_term` (the paper's phenomenon groups) and overall (mean over
phenomena, as in the BLiMP paper and §4.3.1 of the *Hitchhikers' Guide to Masked Latent
Semantic Modeling*, anonymous, under review). With a unigram control
(`mlsm.evaluate.zeroshot.unigram`) the same pairs are scored by it too, and the model is tested
across
phenomena, not pooled pairs (`phenomenon_tests`): the pairs of one phenomenon come from one
template, so they are not independent draws and a pooled binomial test overstates the evidence
(issue #32).

Data: a folder of `<UID>.jsonl` / `<UID>.jsonl.gz` files (the layout of ../shared/data/blimp and of
the BLiMP repository), a single such file, or the HF dataset (`blimp` / `nyu-mll/blimp`, one
config per UID) when the hub is reachable.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlsm.errors import UserError
from mlsm.evaluate.zeroshot.blimp_config import BlimpConfig
from mlsm.evaluate.zeroshot.pll import SentenceTooLong, score_pll
from mlsm.evaluate.zeroshot.unigram import UnigramControl, pair_credit
from mlsm.fileio import atomic_write_text, files_as_one
from mlsm.hf import first_line
from mlsm.inputs import bounded_lines, loads

HF_NAMES = ("blimp", "nyu-mll/blimp")
_FIX_DATA = "point --data at a folder of BLiMP <UID>.jsonl(.gz) files (e.g. ../shared/data/blimp)"


@dataclass(frozen=True)
class BlimpPair:
    """One minimal pair: the grammatical and the ungrammatical sentence of one paradigm."""

    uid: str
    field: str
    good: str
    bad: str
    pair_id: str = ""
    term: str = ""  # `linguistics_term`: the 12-13 phenomenon groups of the BLiMP paper


def _field(row: dict) -> str:
    # One paradigm file of the release spells the field "syntax/semantics", the others
    # "syntax_semantics": normalise so that the field table has the paper's four fields.
    return str(row.get("field") or "unknown").replace("/", "_")


def _pair(row: dict, uid: str, index: int) -> BlimpPair:
    return BlimpPair(
        uid=str(row.get("UID") or uid), field=_field(row), good=row["sentence_good"],
        bad=row["sentence_bad"], pair_id=str(row.get("pairID", row.get("pair_id", index))),
        term=str(row.get("linguistics_term") or ""),
    )


def _stem(path: Path) -> str:
    name = path.name
    for suffix in (".jsonl.gz", ".jsonl"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return path.stem


def _read_file(path: Path) -> list[BlimpPair]:
    """Parse one paradigm file; every bad line is a UserError naming file and line."""
    pairs = []
    try:  # a line is read up to MAX_DOC_BYTES only (a gzip of one 400 MB line took 1.3 GB)
        for number, line in bounded_lines(path, "a BLiMP line"):
            if not line.strip():
                continue
            row = loads(line)
            if (not isinstance(row, dict) or not isinstance(row.get("sentence_good"), str)
                    or not isinstance(row.get("sentence_bad"), str)):
                raise UserError(
                    f"{path}:{number} is not a BLiMP row: each JSON line needs "
                    f"sentence_good and sentence_bad as text; {_FIX_DATA}"
                )
            pairs.append(_pair(row, _stem(path), number - 1))
    # OSError: BadGzipFile
    except (json.JSONDecodeError, UnicodeDecodeError, OSError, EOFError, zlib.error) as err:
        raise UserError(f"{path} is not JSON lines ({first_line(err)}): {_FIX_DATA}") from None
    return pairs


def _local_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.name.endswith((".jsonl", ".jsonl.gz")))
        if not files:
            raise UserError(f"no *.jsonl or *.jsonl.gz files in {path}: {_FIX_DATA}")
        stems = [_stem(p) for p in files]
        twice = next((s for s in stems if stems.count(s) > 1), None)
        if twice is not None:  # both would be read: every pair of it counted twice
            raise UserError(f"{path} holds both {twice}.jsonl and {twice}.jsonl.gz; keep one "
                            "of them (both would be scored, every pair counted twice)")
        return files
    if path.name.endswith((".jsonl", ".jsonl.gz")):
        return [path]
    raise UserError(f"{path} is not a .jsonl(.gz) file: {_FIX_DATA}")


def _looks_like_hub_name(data: str) -> bool:
    return data in HF_NAMES or (
        data.count("/") == 1 and not data.startswith((".", "/", "~")) and "." not in data
    )


def _load_hub(name: str, phenomena: Sequence[str] | None) -> list[BlimpPair]:
    """BLiMP from the HF hub: one config (and one 'train' split) per paradigm."""
    try:
        import datasets

        configs = list(phenomena) if phenomena else datasets.get_dataset_config_names(name)
        pairs = []
        for uid in configs:
            rows = datasets.load_dataset(name, uid, split="train")
            pairs += [_pair(row, uid, i) for i, row in enumerate(rows)]
        return pairs
    except Exception as err:  # offline, unknown name or config: all need the same fix
        raise UserError(
            f"cannot load BLiMP {name!r} from the HF hub ({first_line(err)}): {_FIX_DATA}"
        ) from None


def load_blimp(
    data: str | os.PathLike,
    phenomena: Sequence[str] | None = None,
    limit_per_phenomenon: int | None = None,
) -> dict[str, list[BlimpPair]]:
    """Read BLiMP pairs grouped by phenomenon (UID), UIDs sorted, pairs in file order.

    data: folder of `*.jsonl(.gz)`, one such file, or an HF dataset name. phenomena: keep only
    these UIDs (unknown ones are an error). limit_per_phenomenon: keep the first N pairs of each.
    """
    if limit_per_phenomenon is not None and limit_per_phenomenon < 1:
        raise UserError("limit_per_phenomenon must be a positive integer (or None for all pairs)")
    path = Path(os.path.expanduser(str(data)))
    if path.exists():
        pairs = [p for f in _local_files(path) for p in _read_file(f)]
    elif _looks_like_hub_name(str(data)):
        pairs = _load_hub(str(data), phenomena)
    else:
        raise UserError(f"BLiMP data {str(data)!r} not found: {_FIX_DATA}")
    grouped: dict[str, list[BlimpPair]] = {}
    for pair in pairs:
        grouped.setdefault(pair.uid, []).append(pair)
    if phenomena:
        unknown = sorted(set(phenomena) - set(grouped))
        if unknown:
            raise UserError(
                f"unknown BLiMP phenomena {', '.join(unknown)}: use UIDs such as "
                f"{', '.join(sorted(grouped)[:3])} (file names without .jsonl.gz)"
            )
        grouped = {uid: grouped[uid] for uid in phenomena}
    if not grouped:
        raise UserError(f"no BLiMP pairs in {data}: {_FIX_DATA}")
    return {uid: grouped[uid][:limit_per_phenomenon] for uid in sorted(grouped)}


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else float("nan")


def _summarise(
    grouped: dict[str, list[BlimpPair]], good: Sequence[float], bad: Sequence[float]
) -> dict[str, Any]:
    """Accuracies per phenomenon, per field and overall from scores in `grouped` order.
    `correct` counts strict wins, `ties` exact ties (each worth half a pair in `accuracy`)."""
    phenomena: dict[str, dict[str, Any]] = {}
    i = 0
    for uid, pairs in grouped.items():
        n = len(pairs)
        credit = [pair_credit(good[j], bad[j]) for j in range(i, i + n)]
        phenomena[uid] = {"field": pairs[0].field, "term": pairs[0].term,
                          "accuracy": sum(credit) / n, "correct": credit.count(1.0),
                          "ties": credit.count(0.5), "n": n}
        i += n
    return {
        "overall": _mean([row["accuracy"] for row in phenomena.values()]),
        "n_pairs": i,
        "n_phenomena": len(phenomena),
        "fields": _group(phenomena, "field"),
        "terms": _group(phenomena, "term"),
        "phenomena": phenomena,
    }


def phenomenon_tests(model: dict[str, float], control: dict[str, float] | None = None
                     ) -> dict[str, Any]:
    """Tests across phenomena (one accuracy per phenomenon is one observation): Wilcoxon
    signed-rank of the accuracies against 50 % and, with a control scored on the same pairs,
    of model − control paired by phenomenon (`mlsm.evaluate.compare.stats.wilcoxon_p`: scipy's, zero
    differences dropped; 1.0 when every phenomenon ties). One-sided p: the model is better;
    two-sided p: it differs. r: Pearson correlation of the two over phenomena."""
    import numpy as np

    from mlsm.evaluate.compare.stats import wilcoxon_p

    uids = sorted(model)
    x = np.array([model[u] for u in uids], dtype=float)
    half = np.full_like(x, 0.5)
    out: dict[str, Any] = {
        "n_phenomena": len(uids), "above_chance": int(np.sum(x > 0.5)),
        "below_chance": int(np.sum(x < 0.5)),
        "p_above_chance": wilcoxon_p(x, half, "greater"), "p_vs_chance": wilcoxon_p(x, half)}
    if control:
        common = [u for u in uids if u in control]
        x = np.array([model[u] for u in common], dtype=float)
        y = np.array([control[u] for u in common], dtype=float)
        r = float(np.corrcoef(x, y)[0, 1]) if len(common) > 1 and x.std() and y.std() \
            else float("nan")
        out.update({"n_paired": len(common), "wins_vs_control": int(np.sum(x > y)),
                    "losses_vs_control": int(np.sum(x < y)),
                    "mean_diff_vs_control": float(np.mean(x - y)) if common else float("nan"),
                    "p_above_control": wilcoxon_p(x, y, "greater"),
                    "p_vs_control": wilcoxon_p(x, y), "r_vs_control": r})
    return out


WORD_ORDER_PAIRS = "heldout_prose_word_order"
"""The demo's pair set (`mlsm.demo.PAIR_SET`; a set is named by its folder): a held-out sentence
vs its words shuffled, and vs two of its words swapped."""
PAIRWISE_TESTED = frozenset({WORD_ORDER_PAIRS})
"""Pair sets tested over their pairs (exact binomial), not across phenomena: each word-order pair
is a distinct held-out sentence, so the pairs are independent draws (a BLiMP phenomenon's pairs
share one template and are not), and its two "phenomena" are too few for a test across them (a
two-sided Wilcoxon signed-rank over n of them cannot go below 2 / 2**n: 0.5 at n = 2)."""


@dataclass(frozen=True)
class SetTest:
    """The two-sided tests one pair set is reported with (`pair_set_test`)."""

    test: str  # "binomial": exact, over the pairs; "wilcoxon": signed-rank, across phenomena
    n: int  # pairs (binomial) or phenomena (wilcoxon)
    p_vs_control: float
    p_vs_chance: float

    def label(self) -> str:
        """'exact binomial over 400 pairs' or 'Wilcoxon over 67 phenomena'."""
        if self.test == "binomial":
            return f"exact binomial over {self.n} pairs"
        return f"Wilcoxon over {self.n} phenomena"


def pair_set_test(name: str, entry: dict[str, Any]) -> SetTest:
    """Which test the pair set `name` gets, and its p-values, from the set's entry in a BLiMP row
    (`mlsm.study.stages`): the one rule of the study report and the demo's summary. A set of
    `PAIRWISE_TESTED`: exact binomial tests of its correct pairs against 50 % and against the
    rate of the unigram control on the same pairs; any other set: the Wilcoxon signed-rank tests
    across phenomena its entry holds (`phenomenon_tests`). An entry written before those tests:
    the pooled binomial p against 50 % it holds. A missing p is NaN."""
    from mlsm.evaluate.zeroshot.heldout import binomial_p
    from mlsm.inputs import is_number

    nan, tests = float("nan"), entry.get("tests")
    if name not in PAIRWISE_TESTED and isinstance(tests, dict):
        return SetTest("wilcoxon", int(tests.get("n_phenomena") or 0),
                       tests.get("p_vs_control", nan), tests.get("p_vs_chance", nan))
    n, correct, control = entry.get("n_pairs"), entry.get("correct"), entry.get("control")
    if not (is_number(n) and is_number(correct)):
        return SetTest("binomial", int(n) if is_number(n) else 0, nan,
                       entry.get("p_vs_chance", nan))
    return SetTest("binomial", int(n),
                   binomial_p(int(correct), int(n), control) if is_number(control) else nan,
                   binomial_p(int(correct), int(n), 0.5))


def tests_note(names: Sequence[str]) -> str:
    """What the p-values of these pair sets are (`pair_set_test`), for a table's note."""
    across = [f"`{n}`" for n in names if n not in PAIRWISE_TESTED]
    pairwise = [f"`{n}`" for n in names if n in PAIRWISE_TESTED]
    parts = [f"{', '.join(across)}: two-sided Wilcoxon signed-rank over the set's phenomena "
             "(model − unigram, model − 50 %; one accuracy per phenomenon: its pairs share one "
             "template, so pooled pairs are not independent)"] if across else []
    if pairwise:
        parts.append(f"{', '.join(pairwise)}: two-sided exact binomial test of the correct pairs "
                     "against the unigram's rate on them and against 50 % (distinct sentences, "
                     "and too few phenomena for a test across them)")
    return "p: " + "; ".join(parts) + "."


def _group(phenomena: dict[str, dict[str, Any]], key: str) -> dict[str, dict[str, Any]]:
    """Mean accuracy over the phenomena sharing `key` (each phenomenon weighs the same)."""
    groups: dict[str, dict[str, Any]] = {}
    for uid, row in phenomena.items():
        entry = groups.setdefault(row[key] or "unknown", {"phenomena": [], "n": 0})
        entry["phenomena"].append(uid)
        entry["n"] += row["n"]
    for entry in groups.values():
        entry["accuracy"] = _mean([phenomena[u]["accuracy"] for u in entry["phenomena"]])
    return dict(sorted(groups.items()))


def evaluate_blimp(
    model: Any,
    tokenizer: Any,
    data: str | os.PathLike,
    config: BlimpConfig | None = None,
    *,
    device: str | None = None,
    keep_scores: bool = False,
    progress: bool | None = None,
    control: UnigramControl | None = None,
    **settings: Any,
) -> dict[str, Any]:
    """BLiMP accuracy of a masked LM (or any `MaskedScorer`) by PLL.

    The settings are `BlimpConfig`'s fields (a settings group: docs/architecture.md, "Settings
    groups").

    Returns {"overall", "n_pairs", "n_phenomena", "fields": {field: {"accuracy", "n",
    "phenomena"}}, "terms": {linguistics_term: same}, "phenomena": {UID: {"field", "term",
    "accuracy", "correct", "n"}}, "variant", "data"}
    and, with keep_scores, "pairs": [{"uid", "pair_id", "good", "bad"}] (the PLLs). "tests":
    `phenomenon_tests`. With a `control`, every phenomenon also has "control_accuracy", "control"
    holds its overall score and source, and the tests pair the model with it by phenomenon.
    """
    cfg = BlimpConfig.over(config, settings)
    grouped = load_blimp(data, cfg.phenomena or None, cfg.limit_per_phenomenon or None)
    pairs = [p for group in grouped.values() for p in group]
    # One call for all sentences: the best length bucketing, and repeated sentences scored once.
    try:
        scores = score_pll(model, tokenizer, [p.good for p in pairs] + [p.bad for p in pairs],
                           variant=cfg.variant, token_budget=cfg.token_budget, device=device,
                           progress=progress, max_chars=cfg.max_sentence_chars)
    except SentenceTooLong as long:  # name the pair, not its index among all sentences
        pair = pairs[long.index % len(pairs)]
        which = "sentence_good" if long.index < len(pairs) else "sentence_bad"
        raise UserError(f"{pair.uid} pair {pair.pair_id}: {which} has {long.n_tokens} tokens, "
                        f"more than the model's {long.limit} positions (config.json "
                        "max_position_embeddings); score a model of more positions, or leave "
                        "that pair out of --data") from None
    good, bad = scores[: len(pairs)], scores[len(pairs) :]
    result = {"variant": cfg.variant, "data": str(data), **_summarise(grouped, good, bad)}
    model_acc = {u: r["accuracy"] for u, r in result["phenomena"].items()}
    control_acc = None
    if control is not None:
        scores = control.score([p.good for p in pairs] + [p.bad for p in pairs])
        summary = _summarise(grouped, scores[: len(pairs)], scores[len(pairs):])
        control_acc = {u: r["accuracy"] for u, r in summary["phenomena"].items()}
        for uid, row in result["phenomena"].items():
            row["control_accuracy"] = control_acc[uid]
        result["control"] = {"kind": "unigram", "overall": summary["overall"],
                             **control.describe()}
    result["tests"] = phenomenon_tests(model_acc, control_acc)
    if keep_scores:
        result["pairs"] = [{"uid": p.uid, "pair_id": p.pair_id, "good": g, "bad": b}
                           for p, g, b in zip(pairs, good, bad, strict=True)]
    return result


BLIMP_HEADING = "# BLiMP (PLL)"  # blimp.md's first line: how `mlsm blimp` knows a folder is its


def _pct(x: Any) -> str:
    return f"{100 * x:.1f}" if isinstance(x, (int, float)) and x == x else "—"


def _tests_lines(result: dict[str, Any]) -> list[str]:
    """The tests across phenomena, in words (none without a `tests` entry: older files)."""
    t = result.get("tests")
    if not t:
        return []
    lines = ["", "**Tests across phenomena** (Wilcoxon signed-rank, one accuracy per phenomenon; "
             "never pooled pairs):", "",
             f"- vs 50 %: {t['above_chance']} of {t['n_phenomena']} phenomena above, "
             f"{t['below_chance']} below; p(above) {t['p_above_chance']:.3g}, "
             f"two-sided p {t['p_vs_chance']:.3g}"]
    if "p_vs_control" in t:
        lines.append(f"- vs the unigram control (paired by phenomenon): {t['wins_vs_control']} "
                     f"wins, {t['losses_vs_control']} losses of {t['n_paired']}; mean difference "
                     f"{100 * t['mean_diff_vs_control']:+.1f} points; p(above) "
                     f"{t['p_above_control']:.3g}, two-sided p {t['p_vs_control']:.3g}; r over "
                     f"phenomena {t['r_vs_control']:.2f}")
    return lines


def blimp_markdown(result: dict[str, Any]) -> str:
    """A human-readable report: overall, per field, per phenomenon (accuracies in %), the unigram
    control's score beside the model's, and the tests across phenomena."""
    control = result.get("control")
    lines = [
        BLIMP_HEADING,
        "",
        f"variant: `{result.get('variant', '?')}` · data: `{result.get('data', '?')}` · "
        f"{result['n_pairs']} pairs in {result['n_phenomena']} phenomena",
        "",
        f"**Overall (mean over phenomena): {100 * result['overall']:.1f}%**"
        + (f" · unigram control {_pct(control['overall'])}% (add-one smoothed counts of "
           f"`{control['source']}`, {control['n_tokens']:,} tokens)" if control else ""),
        *_tests_lines(result),
        "",
        "| field | phenomena | pairs | accuracy (%) |",
        "| --- | ---: | ---: | ---: |",
    ]
    for field, row in result["fields"].items():
        lines.append(f"| {field} | {len(row['phenomena'])} | {row['n']} | "
                     f"{100 * row['accuracy']:.1f} |")
    lines += ["", "| linguistics term | phenomena | pairs | accuracy (%) |",
              "| --- | ---: | ---: | ---: |"]
    for term, row in result.get("terms", {}).items():
        lines.append(f"| {term} | {len(row['phenomena'])} | {row['n']} | "
                     f"{100 * row['accuracy']:.1f} |")
    lines += ["", "| phenomenon (UID) | field | pairs | accuracy (%) | unigram control (%) |",
              "| --- | --- | ---: | ---: | ---: |"]
    for uid, row in sorted(result["phenomena"].items(), key=lambda kv: (kv[1]["field"], kv[0])):
        lines.append(f"| {uid} | {row['field']} | {row['n']} | {100 * row['accuracy']:.1f} | "
                     f"{_pct(row.get('control_accuracy'))} |")
    return "\n".join(lines) + "\n"


BLIMP_FILES = ("blimp.md", "blimp.json")
"""The files `mlsm blimp --out` writes."""


def write_blimp_report(result: dict[str, Any], out_dir: str | os.PathLike) -> dict[str, Path]:
    """Write `blimp.json` (everything in `result`) and `blimp.md` into out_dir; return the paths."""
    out = Path(out_dir)
    with files_as_one(out, BLIMP_FILES.__contains__) as stage:  # never a new .md, an old .json
        atomic_write_text(stage / "blimp.md", blimp_markdown(result))
        atomic_write_text(stage / "blimp.json", json.dumps(result, indent=2) + "\n")
    return {"json": out / "blimp.json", "markdown": out / "blimp.md"}
