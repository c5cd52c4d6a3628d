"""`mlsm readout`: cheap, low-noise readouts of one checkpoint or HF encoder, as JSON-lines rows.

Three kinds (docs/readouts.md), each read beside a control measured on the same items:
- `probe`: frozen-encoder linear probes on the full GLUE training sets
  (`mlsm.evaluate.zeroshot.linear_probes`); control: the majority / mean training label;
- `pairs`: minimal-pair sets (BLiMP, word-order pairs) by PLL, per phenomenon and overall, with the
  unigram-frequency control scored on the same pairs and the tests across phenomena
  (`mlsm.evaluate.zeroshot.blimp.phenomenon_tests`);
- `masked`: held-out masked-token loss, top-1 and PPPL, beside the unigram's
  (`mlsm.evaluate.zeroshot.heldout`). Latent (MLSM) models are read through their k -> |V| probe;
  without
  one, `pairs` and `masked` write one row saying so.

Rows are appended to OUT/readouts.jsonl; `plot_rows` draws every readout in it against steps and
against training FLOPs (`mlsm.evaluate.readout_plots`). A row: {"model", "checkpoint", "step",
"readiness", "train_flops", "kind", "task", "metric", "value", "control", "control_kind", "n",
...}: `task` is the GLUE task, the pair set or "heldout"; pair rows of one phenomenon also carry
"phenomenon"; "train_flops" = step x FLOPs per training batch
(`mlsm.train.flops.flops_for_run`), so any readout can be plotted against compute.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlsm.config import INT_LIMIT, check_fields, ranged

KINDS = ("probe", "pairs", "masked")
READOUTS_FILE = "readouts.jsonl"
PROBE_TASKS = ("cola", "sst2", "mrpc", "stsb", "rte", "qnli")


def _whole(least: int, what: str) -> Any:
    return (lambda v: isinstance(v, int) and not isinstance(v, bool) and least <= v < INT_LIMIT,
            what)


@dataclass
class ReadoutSpec:
    """Which readouts `mlsm readout` (its flags come from these fields), `readout()` and a study's
    `readout:` group take, and how; each range sits beside its field."""

    kinds: list[str] = field(default_factory=lambda: list(KINDS), metadata={
        "check": (lambda v: bool(v) and set(v) <= set(KINDS),
                  "readout kinds among " + ", ".join(KINDS)), "metavar": "KIND,KIND"})
    """Readouts to take: probe (linear probes), pairs (minimal pairs), masked (held-out tokens)."""
    glue: str = ""
    """Folder of GLUE task folders (e.g. ../shared/data/glue); empty = no linear probes (`mlsm
    readout`: DATA/glue when it exists)."""
    tasks: list[str] = field(default_factory=lambda: list(PROBE_TASKS),
                             metadata={"metavar": "TASK,TASK"})
    """Tasks probed (those without train and dev files under `glue` are left out)."""
    max_train: int = ranged(0, _whole(0, "0 or more"))
    """Cap on training examples per task (0 = the full training set; a cap is for tests)."""
    max_len: int = ranged(128, _whole(8, "at least 8"))
    """Tokens per sentence when encoding for the probes (longer ones are cut)."""
    pairs: list[str] = field(default_factory=list, metadata={"nargs": "+", "metavar": "SET"})
    """Minimal-pair sets in BLiMP's format (folders or files), each scored by PLL (`mlsm readout`:
    DATA/blimp when it exists)."""
    pair_limit: int = ranged(100, _whole(0, "0 or more"))
    """First N pairs of each phenomenon (0 = all; 100 gives BLiMP's 6,700 pairs)."""
    store: str = ""
    """Token store whose counts make the unigram control; empty = the tokens the model's
    pre-training run consumed (its first steps x batch sequences, in its data order)."""
    heldout_store: str = ""
    """Token store of held-out documents for `masked`; empty = the chunks after the run's last
    batch (held out only within its first epoch)."""
    masked_batches: int = ranged(8, _whole(1, "a positive whole number"))
    """Held-out batches for the masked-token loss and top-1."""
    pppl_batches: int = ranged(1, _whole(0, "0 or more"))
    """Held-out batches whose every token is masked in turn for PPPL (0 = no PPPL)."""
    batch_size: int = ranged(16, _whole(1, "a positive whole number"))
    """Sequences per held-out batch."""


def checkpoint_facts(folder: Path) -> dict[str, Any]:
    """step, readiness and training FLOPs of an mlsm checkpoint (None for an HF folder)."""
    from mlsm.artifacts.checkpoint import Checkpoint

    ck = Checkpoint.at(folder)
    facts: dict[str, Any] = {"step": None, "readiness": None, "train_flops": None}
    if not ck.is_checkpoint:
        return facts
    facts["step"], facts["readiness"] = ck.step, ck.readiness
    try:
        from mlsm.run_config import config_from_dict
        from mlsm.train.flops import flops_for_run
        from mlsm.train.throughput import flops_row_of

        cfg = config_from_dict(ck.config)
        row = flops_row_of(flops_for_run(cfg), cfg.objective.name)
        if row is not None and facts["step"] is not None:
            facts["train_flops"] = float(row.total) * int(facts["step"])
    except Exception:  # a teacher or dictionary no longer at hand: the rest of the row stands
        pass
    return facts


def train_store(folder: Path, spec: ReadoutSpec) -> str:
    from mlsm.artifacts.checkpoint import Checkpoint
    from mlsm.errors import UserError

    if spec.store:
        return spec.store
    store = Checkpoint.at(folder).store
    if store and Path(store).is_dir():
        return store
    raise UserError(f"{folder}: no pre-training token store to count the unigram control on; "
                    "pass --store STORE (a token store made with the model's tokenizer)")


def unigram_control(folder: Path, spec: ReadoutSpec) -> Any:
    """The unigram control of a checkpoint: counted on the store `spec.store` names, else on the
    tokens the checkpoint's pre-training run consumed (`UnigramControl.consumed_by`)."""
    from mlsm.evaluate.zeroshot.unigram import UnigramControl

    if spec.store:
        return UnigramControl.from_store(spec.store)
    train_store(folder, spec)  # one line when the run names no store or it is gone
    return UnigramControl.consumed_by(folder)


def readout(model: str | Path, spec: ReadoutSpec, *, name: str = "",
            scorer_path: str | Path | None = None,
            log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Every readout of `spec.kinds` for one model (a checkpoint, RUN@50%, or an HF folder);
    `scorer_path` reads words through that folder (an MLSM checkpoint's probe)."""
    from mlsm.artifacts.checkpoint import resolve_checkpoint
    from mlsm.errors import UserError
    from mlsm.provenance import git_revision

    check_fields(spec, "readout")  # a spec built in Python has not met its ranges yet
    if spec.glue and "probe" in spec.kinds and not Path(spec.glue).is_dir():
        raise UserError(f"GLUE folder {spec.glue} not found; point --glue (or readout.glue) at "
                        "the folder holding CoLA/, SST-2/, ... (e.g. ../shared/data/glue)")
    folder = resolve_checkpoint(model)
    base = {"model": name or str(model), "checkpoint": str(folder), **checkpoint_facts(folder),
            "git_revision": git_revision()}
    rows: list[dict[str, Any]] = []
    if "probe" in spec.kinds and not spec.glue:
        log("[readout] probe: no GLUE folder given (--glue, or --data holding glue/)")
    if "pairs" in spec.kinds and not spec.pairs:
        log("[readout] pairs: no pair set given (--pairs, or --data holding blimp/)")
    if "probe" in spec.kinds and spec.glue:
        rows += _probe_rows(folder, spec, log)
    words = [k for k in ("pairs", "masked") if k in spec.kinds]
    if words:
        rows += _word_rows(folder, Path(scorer_path) if scorer_path else folder, spec, words, log)
    return [{**base, **r} for r in rows]


def _probe_rows(folder: Path, spec: ReadoutSpec, log: Callable[[str], None]) -> list[dict]:
    from mlsm.evaluate.zeroshot.linear_probes import available_tasks, probe_task
    from mlsm.evaluate.zeroshot.rank import load_encoder

    model, tokenizer = load_encoder(str(folder))
    rows = []
    tasks = available_tasks(spec.glue, spec.tasks)
    if not tasks:
        log(f"[readout] probe: none of {', '.join(spec.tasks)} has train and dev files in "
            f"{spec.glue}")
    for task in tasks:
        got = probe_task(model, tokenizer, task, spec.glue, spec.max_train or None, spec.max_len)
        log(f"[readout] probe {task}: " + ", ".join(
            f"{r['metric']} {r['value']:.3f} (control {r['control']:.3f})" for r in got)
            + f" in {got[0]['seconds']:.0f} s")
        rows += [{"kind": "probe", **r} for r in got]
    return rows


def _word_rows(folder: Path, scorer_path: Path, spec: ReadoutSpec, kinds: list[str],
               log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Pairs and masked rows, or one row per kind saying why the model cannot be read in words
    (an MLSM checkpoint without a probe; MAE-LM)."""
    from mlsm.errors import UserError
    from mlsm.evaluate.probe.probe import load_scorer

    try:
        scorer, tokenizer = load_scorer(scorer_path)
    except UserError as exc:
        log(f"[readout] {', '.join(kinds)}: not read ({exc})")
        note = "no probe" if "probe" in str(exc) else str(exc)
        return [{"kind": k, "task": "", "metric": "", "value": None, "note": note} for k in kinds]
    rows = []
    if "pairs" in kinds:
        rows += _pair_rows(scorer, tokenizer, folder, spec, log)
    if "masked" in kinds:
        rows += _masked_rows(scorer, folder, spec, log)
    return rows


def _pair_rows(scorer: Any, tokenizer: Any, folder: Path, spec: ReadoutSpec,
               log: Callable[[str], None]) -> list[dict[str, Any]]:
    from mlsm.evaluate.zeroshot.blimp import evaluate_blimp

    control = unigram_control(folder, spec) if spec.pairs else None
    rows = []
    for data in spec.pairs:
        start = time.perf_counter()
        r = evaluate_blimp(scorer, tokenizer, data, limit_per_phenomenon=spec.pair_limit or None,
                           control=control, progress=None)
        task, t = Path(data).name or str(data), r["tests"]
        rows.append({"kind": "pairs", "task": task, "metric": "accuracy", "value": r["overall"],
                     "control": r["control"]["overall"], "control_kind": "unigram",
                     "n": r["n_pairs"], "seconds": round(time.perf_counter() - start, 1), **t})
        rows += [{"kind": "pairs", "task": task, "phenomenon": uid, "metric": "accuracy",
                  "value": p["accuracy"], "control": p["control_accuracy"],
                  "control_kind": "unigram", "n": p["n"]} for uid, p in r["phenomena"].items()]
        log(f"[readout] pairs {task}: {100 * r['overall']:.1f} % (unigram "
            f"{100 * r['control']['overall']:.1f} %) over {t['n_phenomena']} phenomena; "
            f"p vs unigram {t.get('p_vs_control', float('nan')):.3g}, "
            f"p vs 50 % {t['p_vs_chance']:.3g}")
    return rows


def _masked_rows(scorer: Any, folder: Path, spec: ReadoutSpec,
                 log: Callable[[str], None]) -> list[dict[str, Any]]:
    from mlsm.evaluate.zeroshot.heldout import masked_token_scores, pppl

    start = time.perf_counter()
    source, steps = _heldout(folder, spec)
    control = unigram_control(folder, spec)
    import torch

    unigram = torch.from_numpy(control.log_probs).float()  # (V,)
    m = masked_token_scores(scorer, source, steps, spec.batch_size, unigram)
    text = "held-out store" if spec.heldout_store else "chunks after the run"
    rows = [{"kind": "masked", "task": "heldout", "metric": "loss", "value": m["loss"],
             "control": m["unigram_loss"], "control_kind": "unigram", "n": m["n"], "text": text},
            {"kind": "masked", "task": "heldout", "metric": "top1", "value": m["top1"],
             "control": m["unigram_top1"], "control_kind": "unigram", "n": m["n"], "text": text,
             "p_vs_control": m["p_vs_unigram"]}]
    if spec.pppl_batches:
        p = pppl(scorer, source, steps[: spec.pppl_batches], spec.batch_size, unigram,
                 source.mask_id)
        rows.append({"kind": "masked", "task": "heldout", "metric": "pppl", "value": p["pppl"],
                     "control": p["unigram_ppl"], "control_kind": "unigram", "n": p["n"],
                     "text": text})
    seconds = round(time.perf_counter() - start, 1)
    log("[readout] masked: " + ", ".join(f"{r['metric']} {r['value']:.3f} (unigram "
                                          f"{r['control']:.3f})" for r in rows)
        + f" in {seconds:.0f} s")
    return [{**r, "seconds": seconds} for r in rows]


def _heldout(folder: Path, spec: ReadoutSpec) -> tuple[Any, list[int]]:
    """The held-out batches: the run's data config on a held-out store (or on the chunks after
    the run); an HF folder needs a held-out store and reads it with the default masking."""
    from mlsm.artifacts.checkpoint import Checkpoint
    from mlsm.data.batches import BatchSource
    from mlsm.data.corpus import TokenStore
    from mlsm.errors import UserError
    from mlsm.evaluate.zeroshot.heldout import heldout_source
    from mlsm.run_config import config_from_dict

    if Checkpoint.at(folder).is_checkpoint:
        source, steps, _ = heldout_source(folder, spec.masked_batches, spec.batch_size,
                                          spec.heldout_store or None)
        return source, steps
    if not spec.heldout_store:
        raise UserError(f"{folder} is not an mlsm checkpoint, so it has no held-out chunks; "
                        "pass --heldout-store STORE (held-out documents, the model's tokenizer)")
    store = TokenStore.open(spec.heldout_store)
    cfg = config_from_dict({"data": {"store": spec.heldout_store, "max_len": spec.max_len}})
    return BatchSource(store, cfg.data, store.load_tokenizer()), list(range(spec.masked_batches))


def write_rows(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Append rows to a JSON-lines file (one locked write, like results.jsonl)."""
    from mlsm.artifacts.results_file import append_results

    append_results(path, rows)
    return Path(path)


def plot_rows(path: str | Path) -> list[str]:
    """Redraw readouts_steps.png / readouts_flops.png beside a readouts.jsonl from all its rows
    (one line per run); a line torn by a killed writer is left out (`read_jsonl`). The figures
    land as one set (`files_as_one`): a kill between them left one drawn from other rows."""
    from mlsm.artifacts.jsonl import read_jsonl
    from mlsm.evaluate.readout_plots import PLOT_NAMES, write_plots
    from mlsm.fileio import files_as_one

    path = Path(path)
    found = read_jsonl(path, "readouts file", "remove or fix that line (readouts files are JSON "
                       "lines written by mlsm readout)")
    rows = [row for _, row in found.rows if isinstance(row, dict) and isinstance(row.get("kind"),
                                                                                str)]
    with files_as_one(path.parent, lambda name: name in PLOT_NAMES.values()) as stage:
        names = write_plots(rows, stage)
    return [str(path.parent / name) for name in names]
