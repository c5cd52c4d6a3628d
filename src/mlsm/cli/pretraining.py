"""The verbs that make a student: demo, prepare, train-tokenizer, dictionary, targets, pretrain,
flops, export, migrate and study. Each verb is its parser (`add_VERB`) beside its handler, which
calls one library function."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING

from mlsm.cli import early
from mlsm.cli.args import (
    device,
    non_negative_int,
    out_dir,
    out_file,
    positive_int,
)
from mlsm.defaults import TEACHER_LAYER
from mlsm.errors import UserError
from mlsm.inputs import check_apart
from mlsm.limits import MAX_DOC_BYTES
from mlsm.teacher.dictionary_config import TEACHER_INITS

if TYPE_CHECKING:
    from mlsm.study.spec import StudySpec


def add_demo(sub: argparse._SubParsersAction) -> Callable:
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


def _demo(a: argparse.Namespace) -> None:
    from mlsm.demo import BATCH, SEEDS, STEPS, run_demo

    run_demo(a.out, corpus=a.corpus, data=a.data, steps=a.steps or STEPS, batch=a.batch or BATCH,
             seeds=a.seeds or SEEDS, blimp_pairs=a.blimp_pairs)


def add_prepare(sub: argparse._SubParsersAction) -> Callable:
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
    p.add_argument("--max-docs", type=non_negative_int, default=None, metavar="N",
                   help="tokenise only the first N documents, for a first try on a large corpus "
                   "(the rest is never read; default: all)")
    _max_doc_bytes_flag(p)
    return _prepare


def _prepare(a: argparse.Namespace) -> None:
    from mlsm.data.corpus import prepare_corpus

    store = prepare_corpus(a.sources, a.tokenizer, a.out, text_field=a.text_field,
                           overwrite=a.overwrite, num_proc=a.num_proc,
                           max_doc_bytes=a.max_doc_bytes, max_docs=a.max_docs or None)
    print(f"token store {store.path}: {store.n_tokens:,} tokens in {store.n_docs:,} documents")


def _max_doc_bytes_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-doc-bytes", type=positive_int, default=MAX_DOC_BYTES,
                   help="refuse a corpus line or document longer than this many bytes, before "
                   f"it is tokenised (default {MAX_DOC_BYTES:,})")


def add_train_tokenizer(sub: argparse._SubParsersAction) -> Callable:
    p = sub.add_parser("train-tokenizer", help="train a WordPiece or Unigram tokenizer")
    p.add_argument("sources", nargs="+", help="files, directories, globs or hf:NAME")
    p.add_argument("--out", required=True, type=out_dir, help="folder for the tokenizer")
    p.add_argument("--kind", choices=["wordpiece", "unigram"], default="wordpiece")
    p.add_argument("--vocab-size", type=positive_int, default=30522)
    p.add_argument("--lowercase", action="store_true")
    p.add_argument("--text-field", default="text")
    _max_doc_bytes_flag(p)
    return _train_tokenizer


def _train_tokenizer(a: argparse.Namespace) -> None:
    from mlsm.data.tokenizer import train_tokenizer

    tok = train_tokenizer(a.sources, a.out, kind=a.kind, vocab_size=a.vocab_size,
                          lowercase=a.lowercase, text_field=a.text_field,
                          max_doc_bytes=a.max_doc_bytes)
    print(f"{a.kind} tokenizer with {len(tok):,} entries saved to {a.out}")


def add_dictionary(sub: argparse._SubParsersAction) -> Callable:
    from mlsm.cli.dataclass_flags import add_dataclass_flags
    from mlsm.teacher.dictionary_config import DictionaryConfig

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


def _dictionary(a: argparse.Namespace) -> None:
    early.store(a.store)
    from mlsm.cli.dataclass_flags import flag_values
    from mlsm.data.corpus import TokenStore
    from mlsm.teacher.dictionary import (
        check_dictionary_out,
        check_vector_memory,
        learn_dictionary,
    )
    from mlsm.teacher.dictionary_config import DictionaryConfig
    from mlsm.teacher.dictionary_cost import announce
    from mlsm.teacher.teacher import load_teacher

    check_apart(a.out, "--out", {"--store": a.store, "--teacher": a.teacher})
    check_dictionary_out(a.out)  # before minutes of work
    given = flag_values(a, DictionaryConfig)
    c = DictionaryConfig.build(given, "mlsm dictionary")
    teacher = load_teacher(a.teacher, a.layer, device=a.device, init=c.teacher_init,
                           seed=c.teacher_seed)
    store = TokenStore.open(a.store)
    if c.atoms == "learned":  # a sample that cannot fit is refused before it is measured
        check_vector_memory(c.n_vectors, teacher.hidden_size)
    cost = announce(store, teacher, c, a.device, "n_vectors" in given)  # hours: said first
    if cost:
        print(cost, flush=True)
    d = learn_dictionary(store, teacher, c, out=a.out)
    made = (f"objective {d.meta['objective']:.5f}" if d.meta.get("objective") is not None
            else f"{d.meta.get('atoms')} atoms")
    print(f"dictionary d={d.d} k={d.k} {made} (teacher {teacher.init}) -> {a.out}")


def add_targets(sub: argparse._SubParsersAction) -> Callable:
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
    p.add_argument("--teacher-init", choices=TEACHER_INITS, default=None,
                   help="the teacher's weights: pretrained, or random (its architecture randomly "
                   "initialised; default: the dictionary's)")
    p.add_argument("--teacher-seed", type=non_negative_int, default=None,
                   help="seed of the random teacher's weights (default: the dictionary's)")
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


def _targets(a: argparse.Namespace) -> None:
    early.store(a.store)
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
        init = a.teacher_init or dictionary.meta.get("teacher_init", "pretrained")
        seed = dictionary.meta.get("teacher_seed", 0) if a.teacher_seed is None else a.teacher_seed
        teacher = load_teacher(a.teacher, layer, device=a.device, init=init, seed=seed)
        out = build_target_store(a.store, dictionary, teacher, a.max_len, a.out, nnz=a.nnz,
                                 batch_size=a.batch_size)
    meta = TargetStore.open(out).meta
    kept = "whole" if meta["nnz"] is None else f"cut to {meta['nnz']} entries"
    print(f"target store {out}: codes of {meta['n_positions']:,} positions for "
          f"max_len {a.max_len}, mean support {meta['mean_support']:.1f}, {kept}; "
          f"{100 * meta['truncated'] / meta['n_positions']:.2f}% of codes truncated")


def add_pretrain(sub: argparse._SubParsersAction) -> Callable:
    p = sub.add_parser("pretrain", help="pre-train a student (MLM, MLSM, KD, ...)",
                       description="Pre-train a student from a recipe (--config, overrides), or "
                       "from text in one command: mlsm pretrain --text FILE builds the token "
                       "store, the dictionary and, for MLSM, the probe with small-machine "
                       "defaults, reusing what exists (docs/tutorial.md)")
    p.add_argument("--config", help="YAML recipe (see configs/)")
    p.add_argument("--text", nargs="+", metavar="FILE",
                   help="text files / folders: build store, dictionary, run and probe "
                   "(mlsm.cli.from_text; the run goes to train.out, default "
                   "runs/<first file's name>)")
    p.add_argument("--objective", default="mlsm",
                   help="with --text: the objective (default mlsm); a dictionary is learned "
                   "when it takes one, a probe trained when PLL scores it through one")
    p.add_argument("--resume", nargs="?", const="auto", default=None,
                   help="continue a run: 'auto' (newest checkpoint in train.out) or a "
                   "checkpoint folder")
    p.add_argument("overrides", nargs="*", help="group.key=value overrides, anywhere on the "
                   "command line, e.g. optim.lr=3e-4 train.steps=200")
    return _pretrain


def _pretrain(a: argparse.Namespace) -> None:
    if a.text:
        _pretrain_text(a)
        return
    early.run_config(a.config, a.overrides)
    from mlsm.errors import Stopped
    from mlsm.run_config import load_config
    from mlsm.train.loop import pretrain_run
    from mlsm.train.signals import exit_status

    cfg = load_config(a.config, a.overrides)
    run, signum = pretrain_run(cfg, resume=a.resume)
    print(f"run directory: {run}")
    if signum is not None:  # stopped early with a checkpoint: not a finished run
        raise Stopped(exit_status(signum, cfg.train.signal_exit_zero))


def _pretrain_text(a: argparse.Namespace) -> None:
    if a.config or a.resume:
        raise UserError("--text builds its own recipe and resumes by itself; drop "
                        f"{'--config' if a.config else '--resume'} (or drop --text)")
    from mlsm.data.sources import resolve_paths

    for source in a.text:  # one line before the heavy imports
        resolve_paths(source)
    from mlsm.cli.from_text import pretrain_from_text

    print(f"run directory: {pretrain_from_text(a.text, a.objective, a.overrides)}")


def add_flops(sub: argparse._SubParsersAction) -> Callable:
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
                   help="paper: reproduces the Hitchhikers' Guide's Table 3 (inferred from its "
                   "numbers: one 128-sequence batch, heads at all positions); "
                        "mlsm: ours (global batch, heads at selected positions) [mlsm]")
    p.add_argument("overrides", nargs="*", help="group.key=value overrides, anywhere on the "
                   "command line, e.g. train.batch_size=256")
    return _flops


def _flops(a: argparse.Namespace) -> None:
    from mlsm.run_config import load_config
    from mlsm.train.flops import flops_for_run, format_table

    cfg = load_config(a.config, a.overrides)
    rows = flops_for_run(cfg, teacher=a.teacher, k=a.k, layer=a.layer, vocab_size=a.vocab_size,
                         accounting=a.accounting)
    print(format_table(rows, accounting=a.accounting))


def add_export(sub: argparse._SubParsersAction) -> Callable:
    p = sub.add_parser("export",
                       help="Hub-ready folder + model card from a run or checkpoint (optionally "
                       "push it)",
                       description="Write a Hub-ready folder (weights, tokenizer, heads, model "
                       "card) from a run: mlsm export runs/my-mlsm --out exports/my-mlsm")
    p.add_argument("checkpoint", metavar="RUN", help="a run (RUN: its final checkpoint, "
                   "RUN@50%%, RUN@step-N) or one of its <run>/checkpoints/step-* folders")
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


def _export(a: argparse.Namespace) -> None:
    from mlsm.artifacts.checkpoint import EXPORT_KIND
    from mlsm.artifacts.outputs import guard_output

    ck = early.mlsm_checkpoint(a.checkpoint, "pass a run directory, a <run>/checkpoints/step-* "
                               "folder or a folder saved by save_pretrained", hf_folder=True)
    check_apart(a.out, "--out", {"checkpoint": ck.folder, "--probe": a.probe,
                                 "--results": a.results}, contains=True)
    guard_output(a.out, EXPORT_KIND)  # before torch imports (export_checkpoint checks again)
    from mlsm.integrations.export import export_checkpoint, push_to_hub

    out = export_checkpoint(a.checkpoint, a.out, results=a.results, probe=a.probe,
                            license=a.license, format=a.format, normalize=a.normalize)
    loads = "SentenceTransformer" if a.format != "hf" else "from_pretrained"
    print(f"exported {a.checkpoint} -> {out} (README.md model card, loads with {loads})")
    if a.push_to_hub:
        print(f"pushed: {push_to_hub(out, a.push_to_hub, private=a.private)}")


def add_migrate(sub: argparse._SubParsersAction) -> Callable:
    p = sub.add_parser("migrate", help="once: write into checkpoints and exports of mlsm 0.1.0 "
                       "the facts readers need (latent head, PLL refusal)",
                       description="Write into each checkpoint.json (or an export's mlsm.json) "
                       "of mlsm 0.1.0 its latent head's name and its PLL refusal, computed from "
                       "its objective as a save records them today; a folder that records them "
                       "already is left unchanged. The marker's bytes change, and so does the "
                       "folder's content fingerprint (results recorded on it are not reused).")
    p.add_argument("paths", nargs="+", metavar="CHECKPOINT_OR_RUN",
                   help="a run directory (every checkpoint in it, its probe runs' too), a "
                        "<run>/checkpoints/step-* folder or an mlsm export folder")
    return _migrate


def _migrate(a: argparse.Namespace) -> None:
    from mlsm.migrate import migrate

    done = migrate(a.paths)
    for record in done:
        print(record.line())
    written = sum(r.written for r in done)
    print(f"{written} migrated, {len(done) - written} unchanged")


def add_study(sub: argparse._SubParsersAction) -> Callable:
    p = sub.add_parser("study", help="run a study file: arms, readiness checkpoints, "
                       "fine-tuning, BLiMP, report")
    p.add_argument("study", nargs="+", metavar="STUDY.yaml",
                   help="study file (see studies/); `report STUDY.yaml` only writes the report")
    p.add_argument("--out", help="study folder (default: the file's `out`)")
    p.add_argument("--report-only", action="store_true",
                   help="only (re)write the report from what is done")
    p.add_argument("--to", metavar="DIR",
                   help="with `report`: write the report of what is done now, and the rows it "
                        "reads, into DIR instead of the study folder, which is only read (works "
                        "while the study runs; to publish or commit a finished piece)")
    p.add_argument("--from", nargs="+", metavar="DIR", dest="pieces",
                   help="with `report --to`: the report over the study's published pieces "
                        "(folders earlier `--to` runs wrote, e.g. one per seed or session), "
                        "its hypotheses paired across every seed they hold; no study folder "
                        "is read")
    p.add_argument("--stages", nargs="+", choices=["store", "dictionary", "pretrain", "probe",
                                                   "finetune", "blimp", "readout", "report"],
                   help="run only these stages (default: all that are not complete)")
    p.add_argument("--arms", nargs="+", metavar="ARM",
                   help="run the stages of these arms only (default: every arm of the study); "
                        "what each subprocess of a local study with executor.jobs > 1 runs; "
                        "with `report --to`: publish these arms' rows only")
    p.add_argument("--print", action="store_true", dest="dry_run",
                   help="run nothing, write nothing: print every arm's resolved run config and "
                        "the stages it would run (with --stages / --arms: those only), as YAML")
    return _study


def _study(a: argparse.Namespace) -> None:
    from mlsm.study import load_study, run_study

    report_only = a.report_only or a.study[0] == "report"
    files = a.study[1:] if a.study[0] == "report" else a.study
    if len(files) != 1:
        raise UserError("pass one study file: mlsm study STUDY.yaml (or mlsm study "
                        "report STUDY.yaml)")
    spec = load_study(files[0], out=a.out)
    if a.dry_run:
        if report_only or a.to:
            raise UserError("--print shows what a study would run; drop `report`, "
                            "--report-only and --to (mlsm study STUDY.yaml --print)")
        _print_plan(spec, a)
        return
    if a.pieces and not (report_only and a.to):
        raise UserError("--from reports published pieces into a folder of its own: mlsm study "
                        "report STUDY.yaml --from DIR [DIR ...] --to DEST")
    if a.to:
        if not report_only:
            raise UserError("--to writes a report only: mlsm study report STUDY.yaml --to DIR")
        from mlsm.study.folder import only_arms
        from mlsm.study.publish import publish_report, report_pieces

        if a.pieces:
            print(f"report: {report_pieces(spec, a.pieces, a.to)} (from {len(a.pieces)} "
                  "published pieces, only read)")
        else:  # with --arms: a piece of these arms only (the others unfinished)
            print(f"report: {publish_report(only_arms(spec, a.arms), a.to)} (study folder "
                  f"{spec.root}, only read)")
        return
    report = run_study(spec, stages=["report"] if report_only else a.stages or None,
                       arms=a.arms)
    print(f"study folder: {spec.root}" + (f"; report: {report}" if report else ""))


def _print_plan(spec: StudySpec, a: argparse.Namespace) -> None:
    import yaml

    from mlsm.study.plan import study_plan

    plan = study_plan(spec, stages=a.stages, arms=a.arms)
    print(f"# mlsm study --print: the plan of {spec.name}; nothing was run or written")
    print(yaml.safe_dump(plan, sort_keys=False, allow_unicode=True, width=100), end="")


VERBS = [add_demo, add_prepare, add_train_tokenizer, add_dictionary,
         add_targets, add_pretrain, add_flops, add_export, add_migrate, add_study]
"""This module's verbs, in the order `mlsm --help` lists them."""
