"""A study file (`mlsm study STUDY.yaml`) as documented dataclasses.

A study is several pre-training **arms** trained on identical batches (they share `base`, so the
batch of step t depends only on (data.seed, t)), evaluated at readiness checkpoints by paired
fine-tuning and by BLiMP — the comparison of Table 1 and Fig. 4 of the *Hitchhikers' Guide to Masked
Latent Semantic Modeling* (anonymous, under review). Every key below is checked; an unknown one is a
one-line error naming the valid keys.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from mlsm.config import NON_NEGATIVE, POSITIVE, build_dataclass, field_with_default, merge, ranged
from mlsm.config import read_yaml as read_recipe
from mlsm.defaults import LAM, TEACHER_LAYER, lam_range
from mlsm.errors import UserError
from mlsm.evaluate.finetune.finetune_config import FinetuneConfig
from mlsm.evaluate.probe.probe_fit_config import PAPER_PROBE_STEPS, ProbeFitConfig, ProbeRecipe
from mlsm.evaluate.readouts import ReadoutSpec
from mlsm.evaluate.zeroshot.blimp_config import BlimpConfig
from mlsm.inputs import read_yaml
from mlsm.run_config import config_from_dict
from mlsm.study.hypotheses import Hypothesis, parse_hypotheses
from mlsm.teacher.dictionary_config import (
    ATOM_KINDS,
    TEACHER_INITS,
    AtomKind,
    DictionaryConfig,
    TeacherInit,
)

_FRACTIONS = (lambda v: len(set(v)) == len(v) and all(0 < f <= 1 for f in v),
              "distinct fractions in (0, 1]")


@dataclass
class CorpusSpec:
    sources: list[str] = field(default_factory=list)
    """Corpus files, folders, globs or hf:NAME, tokenised once into STUDY_OUT/store."""
    text_field: str = "text"
    """JSON field holding the text of a .jsonl source."""
    tokenizer: str = ""
    """Tokenizer folder / hub id; empty = the packaged teacher's (student and teacher must
    agree)."""


@dataclass
class DictionarySpec(DictionaryConfig):
    """A study's `dictionary:` group: every `DictionaryConfig` setting (declared there once, as
    `mlsm dictionary` takes it; k and lam here are the defaults of arms whose own `dictionary`
    gives none), a smaller n_vectors default, and the teacher."""

    n_vectors: int = field_with_default(DictionaryConfig, "n_vectors", 200_000)
    """Teacher states the dictionary is learned on (the official `train_dict.py` collects 1,000,000;
    see the study notes)."""
    teacher: str = ""
    """Teacher folder or hub id; empty = the packaged all-MiniLM-L6-v2. Every arm that reads the
    teacher's states uses it unless the arm names its own objective.teacher: the MLSM arms and
    the dense control feature_kd (not logit KD, whose teacher is a masked LM)."""


@dataclass
class ArmDictionary:
    """An arm's `dictionary:` (latent objectives): which of the study's dictionaries it trains
    against. The study learns (and shares) one dictionary per (teacher, layer, k, lam, atoms,
    teacher_init) and sets objective.dictionary / objective.layer to it. What the arm leaves out
    is the study's `dictionary` group's (`ArmDictionary.settings`, the one place that says so)."""

    layer: int = TEACHER_LAYER
    """Teacher layer l whose states the dictionary codes (layers 1..l are computed)."""
    k: int | None = None
    """Number of atoms; none = the study's dictionary.k."""
    lam: float | None = None
    """λ of the ℓ1 penalty; none = the study's dictionary.lam."""
    targets: bool = False
    """true = the study also builds this dictionary's target store once (`mlsm targets`: the
    codes of every position of the token store, shared by every arm and seed using it) and sets
    objective.targets, so pre-training never runs the teacher."""
    atoms: AtomKind | None = None
    """random (or random_nonneg) = the random-dictionary control; none = the study's
    dictionary.atoms."""
    teacher_init: TeacherInit | None = None
    """random = the random-teacher control, which also sets objective.teacher_init (and
    teacher_seed, the `dictionary` group's); none = the study's dictionary.teacher_init."""

    def settings(self, group: DictionaryConfig, where: str) -> DictionaryConfig:
        """The settings this arm's dictionary is learned with: `group`'s, with the arm's own k,
        lam, atoms and teacher_init on top where it gives them."""
        own = {key: getattr(self, key) for key in ("k", "lam", "atoms", "teacher_init")
               if getattr(self, key) is not None}
        return DictionaryConfig.over(group, own, where)


ARM_DICTIONARY_KEYS = tuple(f.name for f in dataclasses.fields(ArmDictionary))
"""The keys of an arm's `dictionary:` (`ArmSpec.dictionary`)."""


@dataclass
class ArmSpec:
    recipe: str = ""
    """A run-config YAML file (e.g. ../configs/hitchhiker/mlsm.yaml; a relative path is read from
    the study file's folder) that is this arm's starting point: the arm's run config is the
    recipe, then the study's `base`, the arm's `overrides` and `objective`, then what the study
    sets itself (data.store, train.out, train.readiness, the dictionary). Empty = `base` alone."""
    objective: dict[str, Any] = field(default_factory=dict)
    """objective.* of this arm (name plus the objective's own keys), merged into the recipe's (or
    base's) objective when it names the same one or none, else replacing it. Empty = the
    recipe's / base's objective, else mlm."""
    dictionary: ArmDictionary | None = None
    """For latent objectives: {layer, k, lam, targets, atoms, teacher_init} (`ArmDictionary`,
    below); absent or empty = the arm uses no dictionary."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Run-config groups merged over `base` for this arm only (e.g. {optim: {lr: 5e-4}})."""


@dataclass
class ProbeSpec(ProbeFitConfig, ProbeRecipe):
    """A study's `probe:` group: every `ProbeFitConfig` and `ProbeRecipe` setting (declared there
    once, as `mlsm probe` takes them), with the study's own batch size and, for the paper recipe,
    its steps written out. With recipe `paper` (the pre-training run's optimiser and batches
    through the training loop) only heldout_batches, batch_size and min_delta of the fit's
    settings are read, for the held-out score written beside the probe."""

    batch_size: int = field_with_default(ProbeFitConfig, "batch_size", 16)
    """Probe batch size in sequences (the k x |V| probe costs ~6 x an MLM head per target)."""
    steps: int = field_with_default(ProbeRecipe, "steps", PAPER_PROBE_STEPS)
    """recipe paper: probe steps through the training loop (the Hitchhikers' Guide trains 10,000;
    0 = that); recipe plateau: not read."""
    head: Literal["latent", "vocab", "factored"] = field(default="latent", metadata={
        "check": (lambda v: v == "latent", "latent in a study (a latent arm's own probe; the "
                  "readout controls are probe.controls)")})
    """The head of a latent arm's own probe: latent (k -> |V| on its latent head)."""
    controls: list[str] = field(default_factory=list, metadata={
        "check": (lambda v: len(set(v)) == len(v) and set(v) <= {"vocab", "factored"},
                  "distinct readout controls among vocab, factored"), "metavar": "HEAD,HEAD"})
    """Readout controls fitted, with the plateau recipe and these settings, on every arm scored by
    PLL at each BLiMP readiness point (MLM arms included): vocab (a fresh untied d -> |V| head)
    and factored (a fresh d -> k -> |V| head of width `rank`, MLSM's readout shape). The BLiMP
    stage scores held-out masked tokens through each: rows of kind masked, task heldout:vocab /
    heldout:factored (docs/readouts.md, "Readout controls")."""


@dataclass
class FinetuneSpec(FinetuneConfig):
    """A study's `finetune:` section: every `FinetuneConfig` setting (declared there once, with
    the defaults of `mlsm finetune`), plus the keys only a study has."""

    tasks: list[str] = field(default_factory=list)
    """Task names (see `mlsm.evaluate.finetune.tasks`); empty = no fine-tuning."""
    readiness: list[float] = ranged([1.0], _FRACTIONS)
    """Fractions of pre-training whose checkpoints are fine-tuned (a subset of `readiness`)."""


@dataclass
class BlimpSpec(BlimpConfig):
    """A study's `blimp:` group: every `BlimpConfig` setting (declared there once, as `mlsm blimp`
    takes it; `phenomena` applies to the first set), plus which pair sets and checkpoints."""

    data: list[str] = field(default_factory=list)
    """Pair sets in BLiMP's format, each scored by PLL on its own: a folder, a file or an HF name
    (nyu-mll/blimp). Empty = no BLiMP stage. The first set is the headline score."""
    readiness: list[float] = field(default_factory=lambda: [1.0],
                                   metadata={"check": _FRACTIONS, "decides": False})
    """Fractions of pre-training whose checkpoints are scored (latent arms through their probe;
    which models, not how one is scored, so not in a BLiMP file's fingerprint)."""
    limits: list[int] = ranged([], (lambda v: all(n >= 0 for n in v), "numbers 0 or more"))
    """Optional per-set limits, one per entry of `data` (0 = limit_per_phenomenon)."""
    heldout_store: str = ""
    """Token store of held-out documents for the masked-token score reported beside each pair
    score; empty = the chunks after the run's last batch (held out only within its first epoch)."""


@dataclass
class ExecutorSpec:
    kind: str = "local"
    """`local` (in this process, or `jobs` subprocesses) or `slurm` (submitit)."""
    jobs: int = ranged(1, POSITIVE)
    """local: arms pre-trained at once, each a subprocess with `threads` threads (with evaluation
    in subprocesses too, eval_jobs > 1, an arm's evaluation starts when its own pre-training ends,
    one chain per readiness point); keep max(jobs, eval_jobs) x threads at or below the cores."""
    eval_jobs: int = ranged(0, NON_NEGATIVE)
    """local: evaluation subprocesses (one stage of one arm at one readiness point: probe, blimp,
    readout; or an arm's fine-tuning grid) run at once, each with `threads` threads; 0 = jobs.
    1 runs them in the driver one after the other with jobs x threads threads, which is faster
    on a few cores (no subprocess start-up; the demo does it)."""
    threads: int = ranged(0, NON_NEGATIVE)
    """torch threads per job (0 = torch's default; on slurm, the job's cpus_per_task); overrides
    base train.threads. A local evaluation stage with work for one arm only runs in the driver
    with jobs x threads."""
    slurm: dict[str, Any] = field(default_factory=dict)
    """slurm: submitit parameters, e.g. {partition: gpu, gpus_per_node: 1, timeout_min: 1440,
    cpus_per_task: 8, nodes: 1}; timeout_min is required; `setup` (shell lines before each
    job); `folder` (logs) defaults to STUDY_OUT/slurm. See docs/study.md."""


@dataclass
class StudySpec:
    name: str = "study"
    """Study name (report title)."""
    out: str = ""
    """Study folder: store, dictionaries, runs, results.jsonl, report. Empty = a folder named
    after the file, beside it. Relative paths in a study file (this one, corpus sources, data
    folders) are relative to the file's folder."""
    notes: str = ""
    """Free text copied into the report: why each hyper-parameter was fixed as it is."""
    corpus: CorpusSpec = field(default_factory=CorpusSpec)
    """The pre-training text, tokenised once into STUDY_OUT/store (group `corpus`)."""
    base: dict[str, Any] = field(default_factory=dict)
    """Run config shared by every arm (data, model, optim, train groups; see
    docs/configuration.md)."""
    readiness: list[float] = ranged([0.25, 0.5, 1.0], _FRACTIONS)
    """Fractions of pre-training kept as checkpoints for evaluation."""
    arms: dict[str, ArmSpec] = field(default_factory=dict)
    """Arm name -> objective and overrides. With `seeds`, the loaded study holds one entry per
    (arm, seed) run, named ARM-s<seed> (see `seeded_runs`)."""
    seeds: list[int] = ranged([], (lambda v: len(set(v)) == len(v) and all(s >= 0 for s in v),
                                   "distinct whole numbers 0 or more"))
    """Pre-training seeds: each arm is trained once per seed as run ARM-s<seed> (runs/ARM-s<seed>,
    models ARM-s<seed>@P%), the seed setting data.seed (data order, masking) and train.seed (model
    init, dropout), the same for every arm, so arms pair by seed. Dictionaries are learned once
    and shared. Empty (the default) = one run per arm named ARM with base's seeds, as before."""
    hypotheses: list[Hypothesis] = field(default_factory=list)
    """Pre-registered hypotheses (see mlsm.study.hypotheses.Hypothesis and docs/study.md):
    recorded in STUDY_OUT/preregistration.json before any evaluation row exists, evaluated by the
    report over the seeds with Holm's correction; everything else is labelled exploratory."""
    dictionary: DictionarySpec = field(default_factory=DictionarySpec)
    """How the dictionaries of latent arms are learned (group `dictionary`; each arm's layer, k
    and λ are in its own `dictionary`)."""
    probe: ProbeSpec = field(default_factory=ProbeSpec)
    """Training of the k -> |V| probe that lets a latent arm be scored by PLL (group `probe`)."""
    finetune: FinetuneSpec = field(default_factory=FinetuneSpec)
    """Paired fine-tuning of the readiness checkpoints (group `finetune`; no tasks = none)."""
    blimp: BlimpSpec = field(default_factory=BlimpSpec)
    """Minimal-pair scoring by PLL beside a unigram control (group `blimp`; no data = none)."""
    executor: ExecutorSpec = field(default_factory=ExecutorSpec)
    """Where the stages run: this machine (`local`) or a Slurm cluster (group `executor`)."""
    readout: ReadoutSpec | None = None
    """Readouts (docs/readouts.md) of every readiness checkpoint; none (no `readout` group) = no
    readout stage."""

    @property
    def root(self) -> Path:
        return Path(self.out)


_NESTED = {"corpus": CorpusSpec, "dictionary": DictionarySpec, "probe": ProbeSpec,
           "finetune": FinetuneSpec, "blimp": BlimpSpec, "executor": ExecutorSpec}


def study_from_dict(raw: dict[str, Any], where: str = "study",
                    folder: str | Path | None = None) -> StudySpec:
    """Build and validate a StudySpec from a parsed study file; `folder`: the study file's
    folder, from which relative `arms.*.recipe` paths are read (default: the working folder)."""
    if not isinstance(raw, dict):
        raise UserError(f"{where} must be a mapping with keys such as base, arms, finetune")
    raw = dict(raw)
    groups = {k: build_dataclass(cls, raw.pop(k, None) or {}, k)
              for k, cls in _NESTED.items()}
    arms_raw = raw.pop("arms", None) or {}
    if not isinstance(arms_raw, dict) or not arms_raw:
        raise UserError(f"{where}: `arms` must map at least one arm name to "
                        "{objective: {name: ...}}")
    arms = {str(n): build_dataclass(ArmSpec, a or {}, f"arms.{n}") for n, a in arms_raw.items()}
    arms = {n: dataclasses.replace(a, recipe=_recipe_path(n, a.recipe, folder)) if a.recipe else a
            for n, a in arms.items()}
    readout = raw.pop("readout", None)
    if readout is not None:
        readout = build_dataclass(ReadoutSpec, readout, "readout")
    hypotheses = raw.pop("hypotheses", None)
    spec = build_dataclass(StudySpec, raw, "study")
    spec = dataclasses.replace(spec, arms=seeded_runs(arms, spec.seeds), **groups, readout=readout,
                               hypotheses=parse_hypotheses(hypotheses, list(arms), spec.readiness))
    return _validate(spec)


def spec_record(spec: StudySpec) -> dict[str, Any]:
    """`spec` as plain data (JSON) exactly as loaded: its arms are the runs (ARM-s<seed> in a
    seeded study), its paths as resolved, its hypotheses parsed. `spec_from_record` gives the
    same spec back; a study file would not (`load_study` seeds the arms and resolves the paths
    against the file's folder, so a second pass renames and moves them)."""
    return dataclasses.asdict(spec)


def spec_from_record(raw: dict[str, Any]) -> StudySpec:
    """The inverse of `spec_record`."""
    raw = dict(raw)
    groups = {k: build_dataclass(cls, raw.pop(k), k) for k, cls in _NESTED.items()}
    arms = {n: build_dataclass(ArmSpec, a, f"arms.{n}") for n, a in raw.pop("arms").items()}
    arms = {n: dataclasses.replace(a, dictionary=arm_dictionary_of(
                n, a.dictionary and {k: v for k, v in a.dictionary.items() if v is not None},
                groups["dictionary"])) for n, a in arms.items()}
    hyps = [build_dataclass(Hypothesis, h, "hypotheses") for h in raw.pop("hypotheses")]
    readout = raw.pop("readout")
    readout = None if readout is None else build_dataclass(ReadoutSpec, readout, "readout")
    return dataclasses.replace(build_dataclass(StudySpec, raw, "study"), arms=arms,
                               hypotheses=hyps, readout=readout, **groups)


def seeded_runs(arms: dict[str, ArmSpec], seeds: list[int]) -> dict[str, ArmSpec]:
    """One run per (arm, seed), seed by seed (every arm of seed 0 first, so pairs complete
    early), named ARM-s<seed>, whose overrides set data.seed and train.seed to the seed (over the
    recipe's and base's); `arms` unchanged when `seeds` is empty."""
    if not seeds:
        return arms
    clash = next((n for n in arms if n.rpartition("-s")[2].isdigit()), None)
    if clash:
        raise UserError(f"arm name {clash!r} ends like a seeded run's (ARM-s<seed>); rename it, "
                        "e.g. without the -s")
    return {f"{name}-s{s}": dataclasses.replace(
                a, overrides=merge(a.overrides, {"data": {"seed": s}, "train": {"seed": s}}))
            for s in seeds for name, a in arms.items()}


def _validate(spec: StudySpec) -> StudySpec:
    """`spec` checked, its arms' `dictionary:` typed (`ArmDictionary`)."""
    typed = {}
    for name, arm in spec.arms.items():
        if not name.replace("_", "").replace("-", "").isalnum():
            raise UserError(f"arm name {name!r} must be letters, digits, _ or -")
        config_from_dict(arm_base(spec, name))  # checks every key
        typed[name] = dataclasses.replace(
            arm, dictionary=arm_dictionary_of(name, arm.dictionary, spec.dictionary))
    spec = dataclasses.replace(spec, arms=typed)
    for key, fracs in (("finetune.readiness", spec.finetune.readiness),
                       ("blimp.readiness", spec.blimp.readiness)):
        extra = [f for f in fracs if f not in spec.readiness]
        if extra:
            raise UserError(f"{key} lists {extra[0]}, which is not in readiness {spec.readiness}; "
                            "add it there")
    if spec.blimp.limits and len(spec.blimp.limits) != len(spec.blimp.data):
        raise UserError(f"blimp.limits has {len(spec.blimp.limits)} entries but blimp.data has "
                        f"{len(spec.blimp.data)}; give one per set")
    _check_tasks(spec.finetune.tasks)
    _check_preset(spec.finetune)
    if spec.executor.kind not in ("local", "slurm"):
        raise UserError(f"executor.kind must be local or slurm, got {spec.executor.kind!r}")
    slurm = spec.executor.slurm
    if spec.executor.kind == "slurm" and "timeout_min" not in slurm \
            and slurm.get("cluster") not in ("local", "debug"):  # submitit would ask for 5 min
        raise UserError("executor.slurm.timeout_min is not set, so every job would get submitit's "
                        "5 minutes; set it to the longest stage's minutes (e.g. timeout_min: 1440)")
    return spec


def arm_dictionary_of(arm: str, raw: Any, group: DictionarySpec) -> ArmDictionary | None:
    """arms.ARM.dictionary as written (a mapping; empty or absent = none), checked in the study's
    own terms and typed; an `ArmDictionary` already built is checked the same way."""
    if isinstance(raw, ArmDictionary):
        raw = {k: v for k, v in dataclasses.asdict(raw).items() if v is not None}
    if raw is None or raw == {}:
        return None
    if not isinstance(raw, dict):
        raise UserError(f"arms.{arm}.dictionary must be a mapping such as {{layer: 5}}, "
                        f"got {raw!r}")
    unknown = set(raw) - set(ARM_DICTIONARY_KEYS)
    if unknown:
        raise UserError(f"unknown key arms.{arm}.dictionary.{sorted(unknown)[0]}; "
                        f"valid keys: {', '.join(ARM_DICTIONARY_KEYS)}")
    if not isinstance(raw.get("targets", False), bool):
        raise UserError(f"arms.{arm}.dictionary.targets must be true or false")
    typed = ArmDictionary(**raw)  # each value checked below, in the study's own words
    check_arm_dictionary(arm, typed, group.n_vectors, group.k or 0)
    return typed


def _recipe_path(arm: str, recipe: str, folder: str | Path | None) -> str:
    """arms.ARM.recipe as an absolute path (relative to the study file's folder), checked to be a
    file."""
    path = Path(recipe).expanduser()
    if not path.is_absolute():
        path = Path(folder or ".") / path
    if not path.is_file():
        raise UserError(f"arms.{arm}.recipe {recipe} is not a file (read from "
                        f"{Path(folder or '.').resolve()}); give a run-config YAML such as "
                        "../configs/hitchhiker/mlm.yaml, relative to the study file")
    return str(path.resolve())


def arm_base(spec: StudySpec, arm: str) -> dict[str, Any]:
    """The raw run config of an arm before the study's own settings (store, out, readiness,
    dictionary): its recipe, the study's base, the arm's overrides, then its objective."""
    a = spec.arms[arm]
    raw = (read_recipe(a.recipe) or {}) if a.recipe else {}
    if not isinstance(raw, dict):
        raise UserError(f"arms.{arm}.recipe {a.recipe} must be a YAML mapping of groups (data:, "
                        "model:, objective:, optim:, train:); see configs/")
    raw = merge(merge(raw, spec.base), a.overrides)
    below = raw.get("objective") if isinstance(raw.get("objective"), dict) else {}
    if a.objective.get("name", below.get("name")) != below.get("name"):
        below = {}  # another objective than the recipe's: none of its keys apply
    objective = merge(below, a.objective)
    if not objective:
        objective = {"name": "mlm"}
    if "name" not in objective:
        raise UserError(f"arms.{arm}.objective has no name and neither its recipe nor base names "
                        "one; write e.g. objective: {name: mlm}")
    return {**raw, "objective": objective}


def _check_tasks(tasks: list[str]) -> None:
    """finetune.tasks: known names, each once (a repeated task would be fine-tuned twice)."""
    from mlsm.evaluate.finetune.tasks import get_task

    names = [get_task(t).name for t in tasks]  # an unknown name is one line listing the tasks
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UserError(f"finetune.tasks lists {twice[0]} twice; give each task once")


def _check_preset(ft: FinetuneSpec) -> None:
    """finetune.preset: a known name, and none of the keys it fixes set otherwise."""
    if not ft.preset:
        return
    from mlsm.evaluate.finetune.protocol import get_preset

    default = FinetuneSpec()
    clash = [k for k in get_preset(ft.preset).values if getattr(ft, k) != getattr(default, k)]
    if clash:
        raise UserError(f"finetune.preset {ft.preset} fixes finetune.{clash[0]}; remove one of "
                        "the two")


def check_arm_dictionary(arm: str, d: ArmDictionary, n_vectors: int, k_default: int = 0) -> None:
    """An arm's dictionary settings, refused in the study's own terms (a study has no
    `mlsm dictionary` flags). k_default: the k used when the arm gives none (0 = not known yet)."""
    layer, k, lam = d.layer, d.k or k_default, d.lam
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise UserError(f"arms.{arm}.dictionary.layer must be a whole number >= 0 (got {layer!r})")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise UserError(f"arms.{arm}.dictionary.k must be a whole number >= 1 (got {k!r})")
    lam_ok, lam_text = lam_range()
    if lam is not None and (isinstance(lam, bool) or not isinstance(lam, (int, float))
                            or not lam_ok(lam)):
        raise UserError(f"arms.{arm}.dictionary.lam must be a number {lam_text}, got {lam!r}; "
                        f"Berend 2023 uses {LAM}")
    for key, valid in (("atoms", ATOM_KINDS), ("teacher_init", TEACHER_INITS)):
        if getattr(d, key) is not None and getattr(d, key) not in valid:
            raise UserError(f"arms.{arm}.dictionary.{key} must be {' or '.join(valid)}, got "
                            f"{getattr(d, key)!r}")
    if k and n_vectors < k and d.atoms in (None, "learned"):
        raise UserError(f"dictionary.n_vectors {n_vectors} is fewer than the k={k} atoms of arm "
                        f"{arm}; raise dictionary.n_vectors (usually >= 100 x k) or lower "
                        f"arms.{arm}.dictionary.k")


def load_study(path: str | Path, out: str | None = None) -> StudySpec:
    """Read a study file; `out` (e.g. from --out) replaces the file's `out`."""
    p = Path(path)
    if p.is_dir():
        raise UserError(f"study file {p} is a folder; pass its YAML file, e.g. "
                        "studies/cpu_replication.yaml")
    if not p.is_file():
        raise UserError(f"study file {p} not found; "
                        "pass a YAML file such as studies/cpu_replication.yaml")
    raw = read_yaml(p, "study file", "fix it (see studies/*.yaml)") or {}
    spec = relative_to(study_from_dict(raw, str(p), p.parent), p.parent)
    folder = out or spec.out or str(p.parent / p.stem)
    if not folder.isprintable():  # every run's train.out lies inside it: refused before any stage
        flag = "--out" if out else f"{p}: out"
        raise UserError(f"{flag} {ascii(folder)} holds a line break or another control "
                        "character; a path is taken literally: pass one without them (nothing "
                        "was written)")
    return dataclasses.replace(spec, out=str(Path(folder).expanduser()))


def relative_to(spec: StudySpec, folder: Path) -> StudySpec:
    """A study file's relative paths, read relative to the file's folder (not to wherever the
    command runs), so a shipped study works from any clone: `out`, corpus sources (not hf:NAME),
    finetune.data_dir, the held-out and readout stores and readout.glue always; a tokenizer,
    teacher or pair set only when that path exists beside the file (otherwise it is a hub or HF
    datasets name)."""
    def path(text: str) -> str:
        return text if not text or Path(text).expanduser().is_absolute() else str(folder / text)

    def if_there(text: str) -> str:
        return path(text) if text and (folder / text).exists() else text

    corpus = dataclasses.replace(
        spec.corpus, tokenizer=if_there(spec.corpus.tokenizer),
        sources=[s if s.startswith("hf:") else path(s) for s in spec.corpus.sources])
    readout = spec.readout and dataclasses.replace(
        spec.readout, glue=path(spec.readout.glue), store=path(spec.readout.store),
        heldout_store=path(spec.readout.heldout_store),
        pairs=[if_there(d) for d in spec.readout.pairs])
    return dataclasses.replace(
        spec, out=path(spec.out), corpus=corpus, readout=readout,
        dictionary=dataclasses.replace(spec.dictionary, teacher=if_there(spec.dictionary.teacher)),
        finetune=dataclasses.replace(spec.finetune, data_dir=path(spec.finetune.data_dir)),
        blimp=dataclasses.replace(spec.blimp, data=[if_there(d) for d in spec.blimp.data],
                                  heldout_store=path(spec.blimp.heldout_store)))


def readiness_label(frac: float) -> str:
    """0.25 -> '25%' (how arms@readiness are named in results and plots)."""
    return f"{100 * frac:g}%"


def arm_dictionary(spec: StudySpec, arm: str) -> DictionaryConfig:
    """The settings the arm's dictionary is learned with (`ArmDictionary.settings`); the study's
    `dictionary` group alone for an arm without one."""
    d = spec.arms[arm].dictionary
    where = f"arms.{arm}.dictionary"
    return DictionaryConfig.over(spec.dictionary, {}, where) if d is None else \
        d.settings(spec.dictionary, where)
