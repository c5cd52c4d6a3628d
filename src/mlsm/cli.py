"""`mlsm <verb>`: argument wiring only; every verb calls a library function.

Arguments are validated here, at the edge, by argparse `type=` functions (`positive_int`,
`fraction`, `out_dir`, ...; the fine-tuning flags are generated from `FinetuneConfig` by
`mlsm.dataclass_flags`): a bad value is one line naming the flag before any work starts.
`main` turns a `UserError` into one line (exit 2) and keeps real bugs loud: an unexpected
exception prints its traceback plus one line asking to report it (exit 1). docs/reliability.md.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import math
import os
import re
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

from mlsm.artifacts.outputs import guard_output, report_kind, writing, writing_file
from mlsm.config import INT_LIMIT
from mlsm.defaults import TEACHER_LAYER, lam_range
from mlsm.errors import Incomplete, UserError
from mlsm.inputs import check_apart
from mlsm.limits import MAX_DOC_BYTES

# --------------------------------------------------------------------------- argument types


def _number(text: str, kind: type) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not "
                                         f"{'an integer' if kind is int else 'a number'}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    if kind is int and not -INT_LIMIT <= value < INT_LIMIT:  # C integers overflow deep inside
        raise argparse.ArgumentTypeError(f"{text} is out of range (at most {INT_LIMIT - 1})")
    return value


def positive_int(text: str) -> int:
    value = int(_number(text, int))
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(_number(text, int))
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def positive_float(text: str) -> float:
    value = _number(text, float)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = _number(text, float)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def lam_value(text: str) -> float:
    """A sparse-coding λ, in the range `mlsm.defaults.lam_range` declares."""
    value = _number(text, float)
    ok, what = lam_range()
    if not ok(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
    return value


def fraction(text: str) -> float:
    """A number in [0, 1)."""
    value = _number(text, float)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def unit_interval(text: str) -> float:
    """A number in (0, 1]."""
    value = _number(text, float)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def out_dir(text: str) -> str:
    """An output folder: it may exist (as a folder) but must not be an existing file."""
    with _path_errors(text):
        if text and Path(text).exists() and not Path(text).is_dir():
            raise argparse.ArgumentTypeError(f"{text} is an existing file; pass a folder "
                                             "(nothing was written)")
    return text


def out_file(text: str) -> str:
    """An output file: it may exist (as a file) but must not be a folder."""
    with _path_errors(text):
        if Path(text).is_dir():
            raise argparse.ArgumentTypeError(f"{text} is a folder; pass a file path")
    return text


@contextlib.contextmanager
def _path_errors(text: str) -> Iterator[None]:
    """An OSError while a flag's path is checked (a name over 255 bytes) is a usage error: argparse
    turns only ArgumentTypeError/TypeError/ValueError into one line."""
    try:
        yield
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{exc.strerror or exc}: {text}; "
                                         f"{path_fix(exc)}") from None


_PATH_FIXES = {
    errno.ENOSPC: "free disk space and re-run", errno.EDQUOT: "free disk space and re-run",
    errno.EFBIG: "free disk space or raise the file size limit",
    errno.EACCES: "check its permissions or write elsewhere",
    errno.EPERM: "check its permissions or write elsewhere",
    errno.EROFS: "write to a writable file system",
    errno.ELOOP: "remove the symbolic-link loop or pass another path",
    errno.ENAMETOOLONG: "shorten the path (each name at most 255 bytes)",
    errno.ENOENT: "check the path",
    errno.ENOTDIR: "a part of the path is a file, not a folder; check the path",
    errno.EEXIST: "a file or a broken symbolic link is in the way; remove it or pass another "
                  "path",
}


def path_fix(exc: OSError) -> str:
    """What to do about an OSError on a path the user gave, by its errno."""
    default = "check the path, its permissions and the free disk space"
    return _PATH_FIXES.get(exc.errno or 0, default)


def device(text: str) -> str:
    if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; use cpu, cuda, "
                                         "cuda:N (or auto)")
    if text.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text} asked for but no CUDA device is "
                                             "visible; pass --device cpu")
    return text


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (no usage block): `mlsm VERB: error: ...`."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _prepare(a: argparse.Namespace) -> None:
    from mlsm.data.corpus import prepare_corpus

    store = prepare_corpus(a.sources, a.tokenizer, a.out, text_field=a.text_field,
                           overwrite=a.overwrite, num_proc=a.num_proc,
                           max_doc_bytes=a.max_doc_bytes)
    print(f"token store {store.path}: {store.n_tokens:,} tokens in {store.n_docs:,} documents")


def _train_tokenizer(a: argparse.Namespace) -> None:
    from mlsm.data.tokenizer import train_tokenizer

    tok = train_tokenizer(a.sources, a.out, kind=a.kind, vocab_size=a.vocab_size,
                          lowercase=a.lowercase, text_field=a.text_field,
                          max_doc_bytes=a.max_doc_bytes)
    print(f"{a.kind} tokenizer with {len(tok):,} entries saved to {a.out}")


def _pretrain(a: argparse.Namespace) -> None:
    from mlsm.run_config import load_config
    from mlsm.train.loop import pretrain

    run = pretrain(load_config(a.config, a.overrides), resume=a.resume)
    print(f"run directory: {run}")


def _finetune(a: argparse.Namespace) -> None:
    from mlsm.dataclass_flags import flag_values
    from mlsm.evaluate.finetune import finetune
    from mlsm.evaluate.finetune_config import FinetuneConfig
    from mlsm.locking import hold

    with hold(a.results, "results file"):  # one grid per results file at a time
        path = finetune(a.models, [t for t in a.tasks.split(",") if t], results=a.results,
                        device=a.device, readiness=a.readiness,
                        report_to=[t for t in a.report_to.split(",") if t],
                        **flag_values(a, FinetuneConfig))
    print(f"results: {path}")


def _compare(a: argparse.Namespace) -> None:
    from mlsm.evaluate.stats import COMPARISON_KIND, compare_runs

    with writing(a.out, COMPARISON_KIND, keep=[a.results]) if a.out else contextlib.nullcontext():
        print(compare_runs(a.results, out_dir=a.out, select_lr=a.select_lr,
                           bootstrap=a.bootstrap, per_run=a.per_run).to_markdown())


def _report(a: argparse.Namespace) -> None:
    from mlsm.evaluate.report import REPORT_KIND, make_report

    with writing(a.out, REPORT_KIND, keep=[a.results]):  # one writer per report folder
        print(f"report: {make_report(a.results, a.out, baseline=a.baseline, per_run=a.per_run)}")


def _probe(a: argparse.Namespace) -> None:
    from mlsm.dataclass_flags import flag_values
    from mlsm.evaluate.probe import run_probe
    from mlsm.evaluate.probe_fit_config import ProbeFitConfig, ProbeRecipe

    run = run_probe(a.checkpoint, store=a.store, out=a.out, overrides=a.overrides,
                    resume=a.resume, **flag_values(a, ProbeRecipe),
                    **flag_values(a, ProbeFitConfig))
    info = run / "probe.json"
    if info.is_file():  # trained to a plateau: one checkpoint, and how good the probe is
        import json

        p = json.loads(info.read_text())
        print(f"probe ({p['input']}, {p['steps']} steps): held-out loss "
              f"{p['heldout_loss']:.3f} nats, top-1 {100 * p['heldout_top1']:.1f} % (unigram "
              f"{p['unigram_loss']:.3f}) -> score with `mlsm blimp {p['checkpoint']} --out blimp`")
    else:
        print(f"probe run: {run} (score its checkpoints with `mlsm blimp`)")


def _demo(a: argparse.Namespace) -> None:
    from mlsm.demo import BATCH, SEEDS, STEPS, run_demo

    run_demo(a.out, corpus=a.corpus, data=a.data, steps=a.steps or STEPS, batch=a.batch or BATCH,
             seeds=a.seeds or SEEDS, blimp_pairs=a.blimp_pairs)


def _blimp(a: argparse.Namespace) -> None:
    from mlsm.evaluate.blimp import BLIMP_HEADING

    check_apart(a.out, "--out", {"--data": a.data, "MODEL": a.model})
    kind = report_kind("BLiMP report", {"blimp.md", "blimp.json"}.__contains__,
                       {"blimp.md": BLIMP_HEADING})
    guard_output(a.out, kind)  # before the model loads
    with writing(a.out, kind):  # one writer: a second `blimp --out` here refuses at once
        _blimp_into(a)


def _blimp_into(a: argparse.Namespace) -> None:
    from mlsm.dataclass_flags import flag_values
    from mlsm.evaluate.blimp import evaluate_blimp, write_blimp_report
    from mlsm.evaluate.blimp_config import BlimpConfig, blimp_config
    from mlsm.evaluate.probe import load_scorer

    config = blimp_config(None, flag_values(a, BlimpConfig), "mlsm blimp")
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
    """--unigram: 'none', a token store, or 'auto' (the model's pre-training store, if known)."""
    from mlsm.evaluate.readouts import ReadoutSpec, train_store
    from mlsm.evaluate.unigram import UnigramControl
    from mlsm.runs import resolve_checkpoint

    if store == "none":
        return None
    if store != "auto":
        return UnigramControl.from_store(store)
    try:
        return UnigramControl.from_store(train_store(resolve_checkpoint(model), ReadoutSpec()))
    except UserError:  # an HF folder: no store known (the summary line says so)
        return None


def _readout(a: argparse.Namespace) -> None:
    from mlsm.config import build_dataclass
    from mlsm.dataclass_flags import flag_values
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


def _score(a: argparse.Namespace) -> None:
    check_apart(a.out, "--out", {"INPUT": a.input, "MODEL": a.model, "--results": a.results})
    # one writer per output: a second `score` on the same --out or --results refuses at once
    with writing_file(a.out, "scores file"), (
            writing_file(a.results, "results file") if a.results else contextlib.nullcontext()):
        _score_into(a)


def _score_into(a: argparse.Namespace) -> None:
    from mlsm.evaluate.probe import load_scorer
    from mlsm.evaluate.score import results_row, score_corpus, warn_truncated, write_scores
    from mlsm.evaluate.stats import append_results

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


def _rank(a: argparse.Namespace) -> None:
    from mlsm.evaluate.rank import RANK_HEADING, read_sentences

    check_apart(a.out, "--out", {"--text": a.text, "MODEL": a.model})
    kind = report_kind("rank report", {"rank.md", "rank.csv", "rank.json", "rank.png"}
                       .__contains__, {"rank.md": RANK_HEADING})
    guard_output(a.out, kind)
    sentences = read_sentences(a.text, limit=a.max_sentences)  # bad text stops before the load
    with writing(a.out, kind):  # one writer: a second `rank --out` here refuses at once
        _rank_into(a, sentences)


def _rank_into(a: argparse.Namespace, sentences: list[str]) -> None:
    from mlsm.evaluate.rank import layerwise_effective_rank, load_encoder, write_rank_report

    model, tokenizer = load_encoder(a.model, device=a.device)
    table = layerwise_effective_rank(model, tokenizer, sentences, mask_rate=a.mask_rate,
                                     seed=a.seed, tau=a.tau, center=a.center,
                                     max_length=a.max_length)
    paths = write_rank_report(table, a.out)
    print(table.to_markdown())
    print(f"-> {paths['csv']}, {paths['png']}")


def _dictionary(a: argparse.Namespace) -> None:
    from mlsm.data.corpus import TokenStore
    from mlsm.dataclass_flags import flag_values
    from mlsm.dictionary_config import DictionaryConfig
    from mlsm.teacher.dictionary import check_dictionary_out, learn_dictionary
    from mlsm.teacher.teacher import load_teacher

    check_apart(a.out, "--out", {"--store": a.store, "--teacher": a.teacher})
    check_dictionary_out(a.out)  # before minutes of work
    d = learn_dictionary(TokenStore.open(a.store),
                         load_teacher(a.teacher, a.layer, device=a.device),
                         out=a.out, **flag_values(a, DictionaryConfig))
    print(f"dictionary d={d.d} k={d.k} objective "
          f"{d.meta.get('objective', float('nan')):.5f} -> {a.out}")


def _targets(a: argparse.Namespace) -> None:
    from mlsm.locking import hold
    from mlsm.teacher.dictionary import load_dictionary
    from mlsm.teacher.targets import TargetStore, build_target_store, check_targets_out
    from mlsm.teacher.teacher import load_teacher

    check_apart(a.out, "--out", {"--store": a.store, "--dictionary": a.dictionary,
                                 "--teacher": a.teacher})
    check_targets_out(a.out)  # the folder and its lock before loading the teacher
    with hold(a.out, "target store"):
        dictionary = load_dictionary(a.dictionary)
        layer = a.layer if a.layer is not None else dictionary.layer
        teacher = load_teacher(a.teacher, layer, device=a.device)
        out = build_target_store(a.store, dictionary, teacher, a.max_len, a.out, nnz=a.nnz,
                                 batch_size=a.batch_size)
    meta = TargetStore.open(out).meta
    kept = "whole" if meta["nnz"] is None else f"cut to {meta['nnz']} entries"
    print(f"target store {out}: codes of {meta['n_positions']:,} positions for "
          f"max_len {a.max_len}, mean support {meta['mean_support']:.1f}, {kept}; "
          f"{100 * meta['truncated'] / meta['n_positions']:.2f}% of codes truncated")


def _flops(a: argparse.Namespace) -> None:
    from mlsm.flops import flops_for_run, format_table
    from mlsm.run_config import load_config

    cfg = load_config(a.config, a.overrides)
    rows = flops_for_run(cfg, teacher=a.teacher, k=a.k, layer=a.layer, vocab_size=a.vocab_size,
                         accounting=a.accounting)
    print(format_table(rows, accounting=a.accounting))


def _study(a: argparse.Namespace) -> None:
    from mlsm.study import load_study, run_study

    report_only = a.report_only or a.study[0] == "report"
    files = a.study[1:] if a.study[0] == "report" else a.study
    if len(files) != 1:
        raise UserError("pass one study file: mlsm study STUDY.yaml (or mlsm study "
                        "report STUDY.yaml)")
    spec = load_study(files[0], out=a.out)
    report = run_study(spec, stages=["report"] if report_only else a.stages or None,
                       arms=a.arms)
    print(f"study folder: {spec.root}" + (f"; report: {report}" if report else ""))


def _add_study(sub: argparse._SubParsersAction) -> Callable:
    p = sub.add_parser("study", help="run a study file: arms, readiness checkpoints, "
                       "fine-tuning, BLiMP, report")
    p.add_argument("study", nargs="+", metavar="STUDY.yaml",
                   help="study file (see studies/); `report STUDY.yaml` only writes the report")
    p.add_argument("--out", help="study folder (default: the file's `out`)")
    p.add_argument("--report-only", action="store_true",
                   help="only (re)write the report from what is done")
    p.add_argument("--stages", nargs="+", choices=["store", "dictionary", "pretrain", "probe",
                                                   "finetune", "blimp", "readout", "report"],
                   help="run only these stages (default: all that are not complete)")
    p.add_argument("--arms", nargs="+", metavar="ARM",
                   help="run the stages of these arms only (default: every arm of the study); "
                        "what each subprocess of a local study with executor.jobs > 1 runs")
    return _study


def _export(a: argparse.Namespace) -> None:
    from mlsm.export import export_checkpoint, push_to_hub

    out = export_checkpoint(a.checkpoint, a.out, results=a.results, probe=a.probe,
                            license=a.license, format=a.format, normalize=a.normalize)
    loads = "SentenceTransformer" if a.format != "hf" else "from_pretrained"
    print(f"exported {a.checkpoint} -> {out} (README.md model card, loads with {loads})")
    if a.push_to_hub:
        print(f"pushed: {push_to_hub(out, a.push_to_hub, private=a.private)}")


def _add_demo(sub: argparse._SubParsersAction) -> Callable:
    p = sub.add_parser("demo", help="MLSM vs MLM end to end, offline, in minutes on a CPU")
    p.add_argument("--out", default="runs/demo", type=out_dir,
                   help="where everything goes (re-running resumes)")
    p.add_argument("--corpus", default=None,
                   help="text files / hf:NAME (default: Python's own documentation prose)")
    p.add_argument("--data", default=None,
                   help="folder with glue/ and blimp/ (default: ../shared/data if present, "
                        "else HF datasets when the Hub is reachable)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="pre-training steps per student (default: mlsm.demo.STEPS)")
    p.add_argument("--batch", type=positive_int, default=None,
                   help="sequences per step (default: mlsm.demo.BATCH)")
    p.add_argument("--seeds", type=positive_int, default=None,
                   help="SST-2 fine-tuning seeds per model (default: mlsm.demo.SEEDS)")
    p.add_argument("--blimp-pairs", type=positive_int, default=10,
                   help="BLiMP pairs per phenomenon (the held-out prose pairs are all scored)")
    return _demo


def _add_prepare(sub: argparse._SubParsersAction) -> Callable:
    p = sub.add_parser("prepare", help="tokenise text into a token store")
    p.add_argument("sources", nargs="+",
                   help="files, directories, globs (.txt/.jsonl[.gz]) or hf:NAME[,CONFIG][@SPLIT]")
    p.add_argument("--tokenizer", required=True,
                   help="HF tokenizer folder or hub id (must have a mask token)")
    p.add_argument("--out", required=True, type=out_dir, help="token store directory to write")
    p.add_argument("--text-field", default="text",
                   help="JSON field holding the text (default: text)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing store of other inputs")
    p.add_argument("--num-proc", type=positive_int, default=None,
                   help="tokenising processes (default: every CPU available; same store)")
    _add_max_doc_bytes(p)
    return _prepare


def _add_max_doc_bytes(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-doc-bytes", type=positive_int, default=MAX_DOC_BYTES,
                   help="refuse a corpus line or document longer than this many bytes, before "
                   f"it is tokenised (default {MAX_DOC_BYTES:,})")


def _add_train_tokenizer(sub: argparse._SubParsersAction) -> Callable:
    p = sub.add_parser("train-tokenizer", help="train a WordPiece or Unigram tokenizer")
    p.add_argument("sources", nargs="+", help="files, directories, globs or hf:NAME")
    p.add_argument("--out", required=True, type=out_dir, help="folder for the tokenizer")
    p.add_argument("--kind", choices=["wordpiece", "unigram"], default="wordpiece")
    p.add_argument("--vocab-size", type=positive_int, default=30522)
    p.add_argument("--lowercase", action="store_true")
    p.add_argument("--text-field", default="text")
    _add_max_doc_bytes(p)
    return _train_tokenizer


def _add_pretrain(sub: argparse._SubParsersAction) -> Callable:
    p = sub.add_parser("pretrain", help="pre-train a student (MLM, MLSM, KD, ...)")
    p.add_argument("--config", help="YAML recipe (see configs/)")
    p.add_argument("--resume", nargs="?", const="auto", default=None,
                   help="continue a run: 'auto' (newest checkpoint in train.out) or a "
                   "checkpoint folder")
    p.add_argument("overrides", nargs="*", help="group.key=value overrides, anywhere on the "
                   "command line, e.g. optim.lr=3e-4 train.steps=200")
    return _pretrain


def _add_finetune(sub: argparse._SubParsersAction) -> Callable:
    from mlsm.dataclass_flags import add_dataclass_flags
    from mlsm.evaluate.finetune_config import FinetuneConfig

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


def _add_compare(sub: argparse._SubParsersAction) -> Callable:
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


def _add_report(sub: argparse._SubParsersAction) -> Callable:
    p = sub.add_parser("report", help="PNG figures + report.md from results.jsonl")
    p.add_argument("results", help="results.jsonl written by `mlsm finetune`")
    p.add_argument("--out", required=True, type=out_dir,
                   help="folder for the PNGs, tables and report.md")
    p.add_argument("--baseline", default=None, help="model on the x axis of the paired scatters")
    p.add_argument("--per-run", action="store_true",
                   help="pair one score per fine-tuning run, its metrics averaged, as `mlsm "
                   "compare --per-run` (the conservative test)")
    return _report


def _add_probe(sub: argparse._SubParsersAction) -> Callable:
    from mlsm.dataclass_flags import add_dataclass_flags
    from mlsm.evaluate.probe_fit_config import ProbeFitConfig, ProbeRecipe

    p = sub.add_parser("probe",
                       help="train the k -> |V| linear probe of an MLSM checkpoint (for PLL/BLiMP)",
                       description="Train the linear probe of an MLSM checkpoint. group.key=value "
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


def _add_blimp(sub: argparse._SubParsersAction) -> Callable:
    from mlsm.dataclass_flags import add_dataclass_flags
    from mlsm.evaluate.blimp_config import BlimpConfig

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


def _add_score(sub: argparse._SubParsersAction) -> Callable:
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


def _add_readout(sub: argparse._SubParsersAction) -> Callable:
    from mlsm.dataclass_flags import add_dataclass_flags
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


def _add_rank(sub: argparse._SubParsersAction) -> Callable:
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
    p.add_argument("--max-length", type=positive_int, default=128, help="truncate longer sentences")
    p.add_argument("--center", action="store_true", help="subtract the mean representation")
    p.add_argument("--device", default=None, type=device)
    return _rank


def _add_dictionary(sub: argparse._SubParsersAction) -> Callable:
    from mlsm.dataclass_flags import add_dataclass_flags
    from mlsm.dictionary_config import DictionaryConfig

    p = sub.add_parser("dictionary",
                       help="learn the MLSM dictionary on teacher states of a token store")
    p.add_argument("--store", required=True,
                   help="token store prepared with the teacher's tokenizer")
    p.add_argument("--teacher", default=None,
                   help="HF folder or hub id (default: packaged all-MiniLM-L6-v2)")
    p.add_argument("--layer", type=non_negative_int, default=TEACHER_LAYER,
                   help=f"teacher layer, HF hidden_states numbering (0 = embeddings; "
                   f"default {TEACHER_LAYER})")
    # every learning setting: generated from DictionaryConfig (its docstrings, defaults, ranges)
    add_dataclass_flags(p, DictionaryConfig)
    p.add_argument("--device", default="cpu", type=device)
    p.add_argument("--out", required=True, type=out_file,
                   help="PATH.safetensors (meta goes to PATH.json)")
    return _dictionary


def _add_targets(sub: argparse._SubParsersAction) -> Callable:
    p = sub.add_parser("targets",
                       help="precompute MLSM target codes for every token of a token store")
    p.add_argument("--store", required=True,
                   help="token store (prepared with the teacher's tokenizer)")
    p.add_argument("--dictionary", required=True,
                   help="dictionary from `mlsm dictionary` (PATH[.safetensors])")
    p.add_argument("--teacher", default=None,
                   help="teacher folder or hub id (default: packaged all-MiniLM-L6-v2)")
    p.add_argument("--layer", type=non_negative_int, default=None,
                   help="teacher layer (default: the dictionary's)")
    p.add_argument("--max-len", type=positive_int, default=128,
                   help="data.max_len of the runs that will use it")
    p.add_argument("--nnz", type=positive_int, default=None,
                   help="keep only each code's N largest entries (default: every "
                   "non-zero; a cap is lossy)")
    p.add_argument("--batch-size", type=positive_int, default=64,
                   help="chunks per teacher forward / progress record")
    p.add_argument("--device", default="cpu", type=device, help="cpu or cuda[:N]")
    p.add_argument("--out", required=True, type=out_dir,
                   help="target store folder (re-run the same command to resume)")
    return _targets


def _add_flops(sub: argparse._SubParsersAction) -> Callable:
    p = sub.add_parser("flops",
                       help="FLOPs per training batch of MLM, KD, MLSM variants and MTL (Markdown)")
    p.add_argument("--config",
                   help="YAML recipe (student from model.*, teacher/layer/k from objective.*)")
    p.add_argument("--teacher", default=None,
                   help="teacher folder or hub id (default: objective.teacher)")
    p.add_argument("--k", type=positive_int, default=None,
                   help="dictionary size (default: the dictionary's / 4 d)")
    p.add_argument("--layer", type=non_negative_int, default=None,
                   help="early-exit layer of MLSM_l (default: objective.layer)")
    p.add_argument("--vocab-size", type=positive_int, default=None,
                   help="student vocabulary (default: the teacher's)")
    p.add_argument("--accounting", choices=["mlsm", "paper"], default="mlsm",
                   help="paper: the Hitchhikers' Guide's Table 3 (one 128-sequence batch, heads at "
                   "all positions); "
                        "mlsm: ours (global batch, heads at selected positions) [mlsm]")
    p.add_argument("overrides", nargs="*", help="group.key=value overrides, anywhere on the "
                   "command line, e.g. train.batch_size=256")
    return _flops


def _add_export(sub: argparse._SubParsersAction) -> Callable:
    p = sub.add_parser("export",
                       help="Hub-ready folder + model card from a checkpoint (optionally push it)")
    p.add_argument("checkpoint", help="checkpoint folder (<run>/checkpoints/step-*)")
    p.add_argument("--out", required=True, type=out_dir,
                   help="folder to write (an earlier export there is replaced)")
    p.add_argument("--results", default=None,
                   help="results.jsonl of `mlsm finetune`, or a report .md, for the card's table")
    p.add_argument("--probe", default=None,
                   help="probe checkpoint to ship (default: the newest of <run>/probe-<step>)")
    p.add_argument("--license", default="unknown",
                   help="license id for the card's metadata (e.g. apache-2.0, mit)")
    p.add_argument("--push-to-hub", default=None, metavar="REPO",
                   help="upload the folder to this Hub repo (needs network and `hf auth login`)")
    p.add_argument("--private", action="store_true", help="create the Hub repo as private")
    p.add_argument("--format", default="hf", choices=["hf", "sentence-transformers"],
                   help="hf: the Hub folder; sentence-transformers: also the files "
                        "SentenceTransformer(OUT) loads (mean pooling)")
    p.add_argument("--normalize", action="store_true",
                   help="sentence-transformers: L2-normalise the embeddings (a Normalize module)")
    return _export


# One line per verb. --- verbs ---
_VERBS = [_add_demo, _add_prepare, _add_train_tokenizer, _add_dictionary, _add_targets,
          _add_pretrain, _add_flops, _add_probe, _add_finetune, _add_compare, _add_report,
          _add_blimp, _add_score, _add_readout, _add_rank, _add_export, _add_study]


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Callable]]:
    parser = _Parser(prog="mlsm", description="Masked Latent Semantic Modeling toolkit")
    parser.add_argument("--version", action="version", version=f"mlsm {version()}")
    sub = parser.add_subparsers(dest="verb", required=True)
    handlers = {}
    for add in _VERBS:
        handler = add(sub)
        handlers[next(reversed(sub.choices))] = handler
    return parser, handlers


def version() -> str:
    """The installed distribution's version (importlib.metadata); from a source tree that is
    not installed, the package's own `__version__`."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    import mlsm

    try:
        return installed("mlsm")
    except PackageNotFoundError:
        return mlsm.__version__


_OVERRIDE = re.compile(r"[A-Za-z_][\w.]*=")


def _split_overrides(parser: argparse.ArgumentParser,
                     argv: list[str]) -> tuple[list[str], list[str]]:
    """Pull `group.key=value` tokens out of a verb's command line, wherever they stand, for the
    verbs that take overrides (argparse alone only takes them right after the positionals).
    A token that is the value of an option (`--config a=b.yaml`) stays with its option."""
    verb = next((t for t in argv if not t.startswith("-")), None)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    verb_parser = sub.choices.get(verb) if verb else None
    if verb_parser is None or "overrides" not in {a.dest for a in verb_parser._actions}:
        return argv, []
    needs_value = {o for a in verb_parser._actions if a.nargs is None and a.option_strings
                   for o in a.option_strings}
    rest, overrides = [], []
    for i, token in enumerate(argv):
        if (i > argv.index(verb) and _OVERRIDE.match(token)
                and (i == 0 or argv[i - 1] not in needs_value)):
            overrides.append(token)
        else:
            rest.append(token)
    return rest, overrides


class Terminated(KeyboardInterrupt):
    """SIGTERM (timeout, Slurm, systemd, kill) raised in the main thread: it unwinds like Ctrl-C,
    so a folder being built is removed and a lock released, instead of a silent exit 143 that
    left a hidden partial build behind."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM raises Terminated while a verb runs (pretrain's loop installs its own handler:
    stop after the step with a checkpoint); the previous handler is restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    parser, handlers = build_parser()
    try:  # argparse exits (--help, bad flags); callers of main() get the status instead
        argv, overrides = _split_overrides(parser, list(sys.argv[1:] if argv is None else argv))
        args, extra = parser.parse_known_args(argv)
        if extra:  # named by the verb's parser, so the line says `mlsm VERB: error: ...`
            sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
            sub.choices[args.verb].error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    if overrides:
        args.overrides = [*args.overrides, *overrides]
    prog = f"mlsm {args.verb}"
    try:
        with _sigterm_interrupts():
            handlers[args.verb](args)
    except UserError as exc:
        print(f"{prog}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except Incomplete as exc:  # it finished what it could; part of it failed
        print(f"{prog}: error: {_one_line(exc)}", file=sys.stderr)
        return 1
    except Terminated:
        print(f"{prog}: stopped by SIGTERM; nothing was left half-written (a folder being "
              "built was removed): re-run the same command", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:
        if exc.filename is None:  # not about a path the user gave: a bug until shown otherwise
            return _report_bug(prog, exc)
        # the user's environment (missing file, permissions, disk full): say so in one line
        where = exc.filename if exc.filename2 is None else f"{exc.filename} -> {exc.filename2}"
        print(f"{prog}: error: {exc.strerror or _one_line(exc)}: {where}; {path_fix(exc)}",
              file=sys.stderr)
        return 2
    except Exception as exc:
        return _report_bug(prog, exc)
    return 0


def _report_bug(prog: str, exc: BaseException) -> int:
    """A real bug stays loud: the whole traceback, then one line saying what to do with it."""
    traceback.print_exc()
    print(f"{prog}: internal error ({type(exc).__name__}: {_one_line(exc)}); "
          "this is a bug in mlsm, please report it with the traceback above and the command "
          "you ran", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
