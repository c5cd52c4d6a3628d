"""The verbs that read a student: probe, finetune, compare, report, blimp, score, readout and
rank. Each verb is its parser (`add_VERB`) beside its handler, which calls one library
function."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable
from pathlib import Path

from mlsm.artifacts.outputs import guard_output, report_kind, writing, writing_file
from mlsm.cli import early
from mlsm.cli.args import (
    device,
    fraction,
    non_negative_int,
    out_dir,
    out_file,
    positive_int,
    unit_interval,
)
from mlsm.errors import UserError
from mlsm.inputs import check_apart


def add_probe(sub: argparse._SubParsersAction) -> Callable:
    from mlsm.cli.dataclass_flags import add_dataclass_flags
    from mlsm.evaluate.probe.probe_fit_config import ProbeFitConfig, ProbeRecipe

    p = sub.add_parser("probe",
                       help="train the k -> |V| linear probe of an MLSM checkpoint (for "
                       "PLL/BLiMP), or a readout control on any checkpoint (--head vocab / "
                       "factored)",
                       description="Train the linear probe of an MLSM checkpoint, or (--head vocab "
                       "or factored) a fresh readout head on a frozen checkpoint of any objective "
                       "(docs/readouts.md, \"Readout controls\"). group.key=value "
                       "overrides of the probe run may stand anywhere on the command line: mlsm "
                       "probe CKPT --steps 200 optim.lr=1e-3")
    p.add_argument("checkpoint", help="an mlsm or mtl run (RUN, RUN@50%%, RUN@step-N) or its "
                   "checkpoints/step-* folder")
    p.add_argument("--store", default="",
                   help="token store prepared with the checkpoint's tokenizer (default: the one "
                   "the model was pre-trained on)")
    p.add_argument("--out", default="", type=out_dir,
                   help="run directory (default: <run>/probe-<checkpoint>)")
    p.add_argument("--resume", nargs="?", const="auto", default=None,
                   help="continue an interrupted probe run")
    p.add_argument("overrides", nargs="*",
                   help="group.key=value overrides of the probe run, anywhere on the command line "
                   "(before or after the options), e.g. optim.lr=1e-3 train.batch_size=16")
    # which probe, and the plateau probe's settings: generated from ProbeRecipe and
    # ProbeFitConfig (docstrings, defaults, ranges)
    add_dataclass_flags(p.add_argument_group("recipe"), ProbeRecipe)
    add_dataclass_flags(p.add_argument_group(
        "plateau probe (the default recipe; refused with --steps, --recipe paper, --store, "
        "--resume or overrides)"), ProbeFitConfig)
    return _probe


def _probe(a: argparse.Namespace) -> None:
    early.mlsm_checkpoint(a.checkpoint, "pass an mlsm run or its checkpoints/step-* folder")
    early.store(a.store)
    from mlsm.artifacts.probe_record import has_probe_record, read_probe_record
    from mlsm.cli.dataclass_flags import flag_values
    from mlsm.errors import Stopped
    from mlsm.evaluate.probe.probe import probe_run
    from mlsm.evaluate.probe.probe_fit_config import ProbeFitConfig, ProbeRecipe

    run, stopped = probe_run(a.checkpoint, store=a.store, out=a.out, overrides=a.overrides,
                             resume=a.resume, **flag_values(a, ProbeRecipe),
                             **flag_values(a, ProbeFitConfig))
    if stopped is not None:  # the loop saved a checkpoint and said how to resume: not finished
        raise Stopped(stopped)
    if has_probe_record(run):  # trained to a plateau: one checkpoint, and how good the probe is
        p = read_probe_record(run)
        print(f"probe ({p['input']}, {p['steps']} steps): held-out loss "
              f"{p['heldout_loss']:.3f} nats, top-1 {100 * p['heldout_top1']:.1f} % (unigram "
              f"{p['unigram_loss']:.3f}) -> score with `{_blimp_hint(a, p['checkpoint'])}`")
    else:
        print(f"probe run: {run} (score its checkpoints with `mlsm blimp`)")


def _blimp_hint(a: argparse.Namespace, probe: str) -> str:
    """The command that scores with the probe just trained: the model as the user named it (a run,
    as the README writes it) where `mlsm blimp` finds this probe through it (the latent probe in
    its default place), else the probe's own checkpoint folder."""
    from mlsm.artifacts.checkpoint import Checkpoint

    found = not a.out and a.head in (None, "latent")
    run = Checkpoint.open(a.checkpoint).folder.parent.parent.name
    return f"mlsm blimp {a.checkpoint if found else probe} --out runs/blimp-{run}"


def add_finetune(sub: argparse._SubParsersAction) -> Callable:
    from mlsm.cli.dataclass_flags import add_dataclass_flags
    from mlsm.evaluate.finetune.finetune_config import FinetuneConfig

    p = sub.add_parser("finetune",
                       help="fine-tune HF encoders on GLUE/WiC/CoNLL/SQuAD with paired seeds")
    p.add_argument("models", nargs="+", metavar="MODEL",
                   help="HF model folders or runs (RUN, RUN@50%%, RUN@step-N), "
                   "optionally NAME=MODEL")
    p.add_argument("--readiness", choices=["final", "all"], default="final",
                   help="for a run directory: its final checkpoint, or all its readiness "
                   "checkpoints (curves in `mlsm report`)")
    p.add_argument("--tasks", required=True,
                   help="comma-separated: cola,sst2,mrpc,stsb,rte,qnli,mnli,qqp,wic,conll2003,"
                   "squad,squad_v2,scifact,scifact_zeroshot,beir:NAME[_zeroshot] (any BEIR "
                   "folder); wic_lemma: WiC with the lemma prefixed, ours")
    p.add_argument("--results", default="results.jsonl", type=out_file,
                   help="JSON-lines file to append to")
    # every fine-tuning setting: generated from FinetuneConfig (its docstrings, defaults, ranges)
    add_dataclass_flags(p, FinetuneConfig)
    p.add_argument("--device", default="auto", type=device, help="auto, cpu, cuda, cuda:1 ...")
    p.add_argument("--report-to", default="", metavar="TRACKERS",
                   help="comma-separated trackers, one run per cell: tensorboard, wandb, mlflow, "
                        "trackio (files in RESULTS_DIR/tracking; pip install -e \".[tracking]\")")
    return _finetune


def _finetune(a: argparse.Namespace) -> None:
    early.models(a.models, a.readiness)
    from mlsm.cli.dataclass_flags import flag_values
    from mlsm.evaluate.finetune.finetune import finetune
    from mlsm.evaluate.finetune.finetune_config import FinetuneConfig
    from mlsm.locking import hold

    with hold(a.results, "results file"):  # one grid per results file at a time
        path = finetune(a.models, [t for t in a.tasks.split(",") if t], results=a.results,
                        device=a.device, readiness=a.readiness,
                        report_to=[t for t in a.report_to.split(",") if t],
                        **flag_values(a, FinetuneConfig))
    print(f"results: {path}")


def add_compare(sub: argparse._SubParsersAction) -> Callable:
    p = sub.add_parser("compare",
                       help="Wilcoxon p-values, win counts and mean table from results.jsonl")
    p.add_argument("results", help="results.jsonl written by `mlsm finetune`")
    p.add_argument("--select-lr", action="store_true",
                   help="per model and task keep only the learning rate with the best mean "
                   "validation score")
    p.add_argument("--bootstrap", type=non_negative_int, default=0, metavar="N",
                   help="95 %% bootstrap CIs of each mean and of the mean paired differences "
                   "from N resamples (e.g. 10000; 0 = none)")
    p.add_argument("--per-run", action="store_true",
                   help="pair one score per fine-tuning run, its metrics averaged (MRPC acc/F1, "
                   "STS-B Pearson/Spearman), not one per metric: the conservative test")
    p.add_argument("--out", default=None, type=out_dir,
                   help="folder for comparison.md and CSVs (default: print only)")
    return _compare


def _compare(a: argparse.Namespace) -> None:
    from mlsm.evaluate.compare.stats import COMPARISON_KIND, compare_runs

    with writing(a.out, COMPARISON_KIND, keep=[a.results]) if a.out else contextlib.nullcontext():
        print(compare_runs(a.results, out_dir=a.out, select_lr=a.select_lr,
                           bootstrap=a.bootstrap, per_run=a.per_run).to_markdown())


def add_report(sub: argparse._SubParsersAction) -> Callable:
    p = sub.add_parser("report", help="PNG figures + report.md from results.jsonl")
    p.add_argument("results", help="results.jsonl written by `mlsm finetune`")
    p.add_argument("--out", required=True, type=out_dir,
                   help="folder for the PNGs, tables and report.md")
    p.add_argument("--baseline", default=None, help="model on the x axis of the paired scatters")
    p.add_argument("--per-run", action="store_true",
                   help="pair one score per fine-tuning run, its metrics averaged, as `mlsm "
                   "compare --per-run` (the conservative test)")
    return _report


def _report(a: argparse.Namespace) -> None:
    from mlsm.evaluate.compare.report import REPORT_KIND, make_report

    with writing(a.out, REPORT_KIND, keep=[a.results]):  # one writer per report folder
        print(f"report: {make_report(a.results, a.out, baseline=a.baseline, per_run=a.per_run)}")


def add_blimp(sub: argparse._SubParsersAction) -> Callable:
    from mlsm.cli.dataclass_flags import add_dataclass_flags
    from mlsm.evaluate.zeroshot.blimp_config import BlimpConfig

    p = sub.add_parser("blimp", help="BLiMP accuracy by pseudo-log-likelihood (PLL)")
    p.add_argument("model",
                   help="HF masked-LM folder or a run (RUN, RUN@50%%, RUN@step-N): MLM, KD and MTL "
                   "models use their vocabulary head; an MLSM run is scored through its probe "
                   "(mlsm probe RUN)")
    p.add_argument("--data", default="../shared/data/blimp",
                   help="folder of <UID>.jsonl(.gz), one such file, or HF 'blimp'")
    p.add_argument("--out", required=True, type=out_dir, help="folder for blimp.json and blimp.md")
    p.add_argument("--device", default=None, type=device, help="cpu, cuda, cuda:1 (default: cpu)")
    p.add_argument("--unigram", default="auto", metavar="STORE",
                   help="token store whose add-one unigram scores the same pairs as a control; "
                   "auto (default): the model's pre-training store; none: no control")
    # how pairs are scored: generated from BlimpConfig (docstrings, defaults, ranges)
    add_dataclass_flags(p.add_argument_group("scoring"), BlimpConfig)
    return _blimp


def _blimp(a: argparse.Namespace) -> None:
    early.scorer(a.model)
    if a.unigram not in ("auto", "none"):
        early.store(a.unigram, "--unigram")
    from mlsm.evaluate.zeroshot.blimp import BLIMP_HEADING

    check_apart(a.out, "--out", {"--data": a.data, "MODEL": a.model})
    kind = report_kind("BLiMP report", {"blimp.md", "blimp.json"}.__contains__,
                       {"blimp.md": BLIMP_HEADING})
    guard_output(a.out, kind)  # before the model loads
    with writing(a.out, kind):  # one writer: a second `blimp --out` here refuses at once
        _blimp_into(a)


def _blimp_into(a: argparse.Namespace) -> None:
    from mlsm.cli.dataclass_flags import flag_values
    from mlsm.evaluate.probe.probe import load_scorer
    from mlsm.evaluate.zeroshot.blimp import evaluate_blimp, write_blimp_report
    from mlsm.evaluate.zeroshot.blimp_config import BlimpConfig

    config = BlimpConfig.over(None, flag_values(a, BlimpConfig), "mlsm blimp")
    model, tokenizer = load_scorer(a.model, device=a.device)
    control = _unigram_control(a.model, a.unigram)
    result = evaluate_blimp(model, tokenizer, a.data, config, progress=None, control=control)
    paths = write_blimp_report(result, a.out)
    unigram = (f"; unigram control {100 * result['control']['overall']:.1f}%" if control
               else "; no unigram control" + ("" if a.unigram == "none" else
                                               " (no pre-training store known: --unigram STORE)"))
    print(f"BLiMP overall {100 * result['overall']:.1f}% over {result['n_phenomena']} phenomena "
          f"({result['n_pairs']} pairs){unigram} -> {paths['markdown']}")


def _unigram_control(model: str, store: str) -> object | None:
    """--unigram: 'none', a token store, or 'auto' (the tokens the model's pre-training run
    consumed, if known)."""
    from mlsm.artifacts.checkpoint import resolve_checkpoint
    from mlsm.evaluate.readouts import ReadoutSpec, unigram_control
    from mlsm.evaluate.zeroshot.unigram import UnigramControl

    if store == "none":
        return None
    if store != "auto":
        return UnigramControl.from_store(store)
    try:
        return unigram_control(resolve_checkpoint(model), ReadoutSpec())
    except UserError:  # an HF folder: no store known (the summary line says so)
        return None


def add_score(sub: argparse._SubParsersAction) -> Callable:
    p = sub.add_parser("score", help="PLL per sentence and pseudo-perplexity (PPPL) of a corpus")
    p.add_argument("model", help="HF masked-LM folder or a run (RUN, RUN@50%%, RUN@step-N); an "
                   "MLSM run is scored through its probe (mlsm probe RUN)")
    p.add_argument("input", help=".txt/.jsonl (gzipped or not), one sentence per line, or a "
                   "token store (scored in chunks of --max-tokens)")
    p.add_argument("--out", required=True, type=out_file,
                   help="JSON lines, one per sentence (the summary goes to OUT.summary.json)")
    p.add_argument("--variant", choices=["original", "within_word_l2r"], default="original",
                   help="PLL variant (within_word_l2r: Kauf & Ivanova 2023)")
    p.add_argument("--max-tokens", type=positive_int, default=None,
                   help="cut longer sentences to this many tokens (default: the model's limit)")
    p.add_argument("--limit", type=positive_int, default=None,
                   help="score the first N sentences / store chunks")
    p.add_argument("--text-field", default="text", help="JSON field of a .jsonl input")
    p.add_argument("--token-budget", type=positive_int, default=8192,
                   help="padded tokens per forward pass")
    p.add_argument("--results", default=None, type=out_file,
                   help="also append a results row (task pppl:INPUT, metric neg_log_pppl) for "
                   "compare/report")
    p.add_argument("--name", default=None, help="model name in the results row (default: the "
                   "folder name)")
    p.add_argument("--device", default=None, type=device, help="cpu, cuda, cuda:1 (default: cpu)")
    return _score


def _score(a: argparse.Namespace) -> None:
    early.scorer(a.model)
    check_apart(a.out, "--out", {"INPUT": a.input, "MODEL": a.model, "--results": a.results})
    # one writer per output: a second `score` on the same --out or --results refuses at once
    with writing_file(a.out, "scores file"), (
            writing_file(a.results, "results file") if a.results else contextlib.nullcontext()):
        _score_into(a)


def _score_into(a: argparse.Namespace) -> None:
    from mlsm.artifacts.results_file import append_results
    from mlsm.evaluate.probe.probe import load_scorer
    from mlsm.evaluate.zeroshot.score import results_row, score_corpus, warn_truncated, write_scores

    model, tokenizer = load_scorer(a.model, device=a.device)
    result = score_corpus(model, tokenizer, a.input, variant=a.variant, max_tokens=a.max_tokens,
                          text_field=a.text_field, limit=a.limit, token_budget=a.token_budget,
                          progress=None)
    paths = write_scores(result, a.out)
    warn_truncated(result)
    s = result.summary
    print(f"PPPL {s['pppl']:.3f} ({a.variant}) over {s['n_sentences']} {s['unit']}, "
          f"{s['n_tokens']} tokens -> {paths['scores']}, {paths['summary']}")
    if a.results:
        append_results(a.results, [results_row(result, a.model, a.name or Path(a.model).name)])
        print(f"results row appended to {a.results}")


def add_readout(sub: argparse._SubParsersAction) -> Callable:
    from mlsm.cli.dataclass_flags import add_dataclass_flags
    from mlsm.evaluate.readouts import ReadoutSpec

    p = sub.add_parser("readout", help="cheap readouts of a checkpoint: linear probes, minimal "
                       "pairs vs a unigram control, held-out masked tokens (docs/readouts.md)")
    p.add_argument("model", help="checkpoint folder, run (RUN, RUN@50%%, RUN@step-N) or HF "
                   "encoder folder")
    p.add_argument("--out", required=True, type=out_dir,
                   help="folder whose readouts.jsonl the rows are appended to")
    p.add_argument("--data", default="../shared/data",
                   help="folder holding glue/ and blimp/, the defaults of --glue and --pairs "
                   "(default ../shared/data)")
    p.add_argument("--name", default="", help="model name in the rows (default: MODEL)")
    # what is read and how: generated from ReadoutSpec (docstrings, defaults, ranges)
    add_dataclass_flags(p.add_argument_group("readouts"), ReadoutSpec)
    return _readout


def _readout(a: argparse.Namespace) -> None:
    early.model(a.model)
    from mlsm.cli.dataclass_flags import flag_values
    from mlsm.config import build_dataclass
    from mlsm.evaluate.readouts import READOUTS_FILE, ReadoutSpec, plot_rows, readout, write_rows

    given = flag_values(a, ReadoutSpec)
    data = Path(a.data) if a.data else None
    for key, sub in (("glue", "glue"), ("pairs", "blimp")):  # DATA/glue, DATA/blimp when there
        if key not in given and data and (data / sub).is_dir():
            given[key] = str(data / sub) if key == "glue" else [str(data / sub)]
    check_apart(a.out, "--out", {"MODEL": a.model, "--data": a.data or "",
                                 "--store": given.get("store", "")})
    spec = build_dataclass(ReadoutSpec, given, "mlsm readout")
    path = Path(a.out) / READOUTS_FILE
    with writing_file(path, "readouts file"):  # one writer: two runs at once doubled every row
        rows = readout(a.model, spec, name=a.name)
        write_rows(rows, path)
        plots = plot_rows(path)
    print(f"{len(rows)} readout rows -> {path}" + (f"; plots of every row there: "
                                                     f"{', '.join(plots)}" if plots else ""))


def add_rank(sub: argparse._SubParsersAction) -> Callable:
    p = sub.add_parser("rank", help="tau-effective rank of token representations per layer")
    p.add_argument("model",
                   help="HF encoder folder (AutoModel) or a run (RUN, RUN@50%%, RUN@step-N)")
    p.add_argument("--text", required=True, help=".txt or .txt.gz, one sentence per line")
    p.add_argument("--out", required=True, type=out_dir, help="folder for rank.csv/.md/.json/.png")
    p.add_argument("--mask-rate", type=fraction, default=0.15, help="fraction of tokens -> [MASK]")
    p.add_argument("--tau", type=unit_interval, default=0.9,
                   help="energy fraction (Meng et al. Def. 2.1)")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--max-sentences", type=positive_int, default=None, help="use the first N lines")
    p.add_argument("--max-length", type=positive_int, default=None,
                   help="truncate longer sentences (default: the model's positions, at most 128)")
    p.add_argument("--center", action="store_true", help="subtract the mean representation")
    p.add_argument("--device", default=None, type=device)
    return _rank


def _rank(a: argparse.Namespace) -> None:
    early.model(a.model)
    from mlsm.evaluate.zeroshot.rank import RANK_HEADING, read_sentences

    check_apart(a.out, "--out", {"--text": a.text, "MODEL": a.model})
    kind = report_kind("rank report", {"rank.md", "rank.csv", "rank.json", "rank.png"}
                       .__contains__, {"rank.md": RANK_HEADING})
    guard_output(a.out, kind)
    sentences = read_sentences(a.text, limit=a.max_sentences)  # bad text stops before the load
    with writing(a.out, kind):  # one writer: a second `rank --out` here refuses at once
        _rank_into(a, sentences)


def _rank_into(a: argparse.Namespace, sentences: list[str]) -> None:
    from mlsm.evaluate.zeroshot.rank import (
        layerwise_effective_rank,
        load_encoder,
        write_rank_report,
    )

    model, tokenizer = load_encoder(a.model, device=a.device)
    table = layerwise_effective_rank(model, tokenizer, sentences, mask_rate=a.mask_rate,
                                     seed=a.seed, tau=a.tau, center=a.center,
                                     max_length=a.max_length)
    paths = write_rank_report(table, a.out)
    if table.meta["n_cut"]:  # the model's positions (or --max-length) cut them: said, not hidden
        print(f"mlsm rank: note: {table.meta['n_cut']} of {len(sentences)} sentences were longer "
              f"than {table.meta['max_length']} tokens and were cut there", file=sys.stderr)
    print(table.to_markdown())
    print(f"-> {paths['csv']}, {paths['png']}")


VERBS = [add_probe, add_finetune, add_compare, add_report, add_blimp, add_score, add_readout,
         add_rank]
"""This module's verbs, in the order `mlsm --help` lists them."""
