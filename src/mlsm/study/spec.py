"""A study file (`mlsm study STUDY.yaml`) as documented dataclasses.

A study is several pre-training **arms** trained on identical batches (they share `base`, so the
batch of step t depends only on (data.seed, t)), evaluated at readiness checkpoints by paired
fine-tuning and by BLiMP — the comparison of Berend 2023, Table 1 and Fig. 4. Every key below is
checked; an unknown one is a one-line error naming the valid keys.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlsm.config import FIELD_CHECKS, build_dataclass, config_from_dict, merge
from mlsm.defaults import LAM, TEACHER_LAYER
from mlsm.errors import UserError
from mlsm.evaluate.readouts import ReadoutSpec
from mlsm.inputs import read_yaml


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
class DictionarySpec:
    teacher: str = ""
    """Teacher folder or hub id; empty = the packaged all-MiniLM-L6-v2."""
    n_vectors: int = 200_000
    """Teacher states the dictionary is learned on (Berend 2023 used far more; see the study
    notes)."""
    max_len: int = 128
    """Sequence length when collecting teacher states."""
    seed: int = 0
    """Seed of the state sample and of the atom initialisation."""


@dataclass
class ArmSpec:
    objective: dict[str, Any] = field(default_factory=lambda: {"name": "mlm"})
    """objective.* of this arm (name plus the objective's own keys)."""
    dictionary: dict[str, Any] = field(default_factory=dict)
    """For latent objectives: {layer, k, lam}; the study learns (and shares) one dictionary per
    (teacher, layer, k, lam) and sets objective.dictionary / objective.layer to it."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Run-config groups merged over `base` for this arm only (e.g. {optim: {lr: 5e-4}})."""


@dataclass
class ProbeSpec:
    lr: float = 0.2
    """Adam lr of the k -> |V| probe per unit of mean input L1 norm (inputs are standardised), i.e.
    roughly how far one step may move a logit (see mlsm.evaluate.probe_fit)."""
    inputs: list[str] = field(default_factory=lambda: ["probs", "logprobs", "logits"])
    """Input kinds tried for `select_steps` steps; the best on held-out chunks continues."""
    select_steps: int = 100
    """Steps every input kind trains before the best is kept."""
    max_steps: int = 2000
    """Upper bound on probe steps; training stops earlier at a held-out loss plateau."""
    eval_every: int = 50
    """Held-out loss is measured every N steps."""
    patience: int = 3
    """Stop after this many evaluations without a relative improvement of `min_delta`."""
    min_delta: float = 0.005
    """Relative held-out loss improvement that counts as progress."""
    heldout_batches: int = 4
    """Batches of held-out chunks (steps beyond the pre-training run) for the plateau test."""
    batch_size: int = 16
    """Probe batch size in sequences (the k x |V| probe costs ~6 x an MLM head per target)."""


@dataclass
class FinetuneSpec:
    tasks: list[str] = field(default_factory=list)
    """Task names (see `mlsm.evaluate.tasks`); empty = no fine-tuning."""
    data_dir: str = ""
    """Folder holding the task folders (GLUE layout); empty = HF `datasets`."""
    readiness: list[float] = field(default_factory=lambda: [1.0])
    """Fractions of pre-training whose checkpoints are fine-tuned (a subset of `readiness`)."""
    seeds: int = 3
    """Fine-tuning seeds per cell (paired across arms: same seed, same head init and order)."""
    lrs: list[float] = field(default_factory=lambda: [1e-4])
    """Fine-tuning learning rates (fixed a priori; never chosen on the dev sets)."""
    epochs: int = 3
    """Fine-tuning epochs."""
    batch_size: int = 32
    """Fine-tuning batch size."""
    max_len: int = 128
    """Fine-tuning sequence length."""
    max_train_examples: int = 0
    """Cap on training examples per task (0 = all)."""
    warmup_ratio: float = 0.1
    """Fraction of fine-tuning steps with linear warmup."""
    weight_decay: float = 0.01
    """AdamW weight decay when fine-tuning."""


@dataclass
class BlimpSpec:
    data: list[str] = field(default_factory=list)
    """Pair sets in BLiMP's format, each scored by PLL on its own: a folder, a file or an HF name
    (nyu-mll/blimp). Empty = no BLiMP stage. The first set is the headline score."""
    readiness: list[float] = field(default_factory=lambda: [1.0])
    """Fractions of pre-training whose checkpoints are scored (latent arms through their probe)."""
    limit_per_phenomenon: int = 0
    """First N pairs of each phenomenon (0 = all 1000)."""
    limits: list[int] = field(default_factory=list)
    """Optional per-set limits, one per entry of `data` (0 = limit_per_phenomenon)."""
    phenomena: list[str] = field(default_factory=list)
    """UIDs of the first set to score; empty = all (67 for BLiMP)."""
    heldout_store: str = ""
    """Token store of held-out documents for the masked-token score reported beside each pair
    score; empty = the chunks after the run's last batch (held out only within its first epoch)."""


@dataclass
class ExecutorSpec:
    kind: str = "local"
    """`local` (in this process, or `jobs` subprocesses) or `slurm` (submitit)."""
    jobs: int = 1
    """local: arms run at once, each stage of each arm a subprocess with `threads` threads; keep
    jobs x threads at or below the cores."""
    eval_jobs: int = 0
    """local: arms whose evaluation stage (probe, finetune, blimp) runs at once, each a subprocess
    with `threads` threads; 0 = jobs. 1 runs them in the driver one after the other with jobs x
    threads threads, which is faster on a few cores (no subprocess start-up; the demo does it)."""
    threads: int = 0
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
    """Study folder: store, dictionaries, runs, results.jsonl, report. Empty = studies/NAME next to
    the file."""
    notes: str = ""
    """Free text copied into the report: why each hyper-parameter was fixed as it is."""
    corpus: CorpusSpec = field(default_factory=CorpusSpec)
    base: dict[str, Any] = field(default_factory=dict)
    """Run config shared by every arm (data, model, optim, train groups; see
    docs/configuration.md)."""
    readiness: list[float] = field(default_factory=lambda: [0.25, 0.5, 1.0])
    """Fractions of pre-training kept as checkpoints for evaluation."""
    arms: dict[str, ArmSpec] = field(default_factory=dict)
    """Arm name -> objective and overrides."""
    dictionary: DictionarySpec = field(default_factory=DictionarySpec)
    probe: ProbeSpec = field(default_factory=ProbeSpec)
    finetune: FinetuneSpec = field(default_factory=FinetuneSpec)
    blimp: BlimpSpec = field(default_factory=BlimpSpec)
    executor: ExecutorSpec = field(default_factory=ExecutorSpec)
    readout: ReadoutSpec | None = None
    """Readouts (docs/readouts.md) of every readiness checkpoint; none (no `readout` group) = no
    readout stage."""

    @property
    def root(self) -> Path:
        return Path(self.out)


_POS = (lambda v: v > 0, "positive")
_NONNEG = (lambda v: v >= 0, "0 or more")
_FRACTIONS = (lambda v: len(set(v)) == len(v) and all(0 < f <= 1 for f in v),
              "distinct fractions in (0, 1]")
# Ranges of the study's own keys, checked by build_dataclass like a run config's (FIELD_CHECKS
# keys are "group.key"; these groups do not clash with the run config's data/model/optim/train).
FIELD_CHECKS.update({
    "study.readiness": _FRACTIONS,
    "dictionary.n_vectors": _POS, "dictionary.max_len": (lambda v: v >= 4, "at least 4"),
    "probe.lr": _POS, "probe.select_steps": _NONNEG, "probe.max_steps": _POS,
    "probe.eval_every": _POS, "probe.patience": _POS, "probe.min_delta": _NONNEG,
    "probe.heldout_batches": _POS, "probe.batch_size": _POS,
    "probe.inputs": (lambda v: bool(v) and len(set(v)) == len(v)
                     and set(v) <= {"probs", "logprobs", "logits"},
                     "distinct input kinds among probs, logprobs, logits"),
    "finetune.readiness": _FRACTIONS, "finetune.seeds": _POS, "finetune.epochs": _POS,
    "finetune.batch_size": _POS, "finetune.max_len": (lambda v: v >= 4, "at least 4"),
    "finetune.max_train_examples": _NONNEG, "finetune.weight_decay": _NONNEG,
    "finetune.lrs": (lambda v: bool(v) and all(lr > 0 for lr in v), "positive learning rates"),
    "finetune.warmup_ratio": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "blimp.readiness": _FRACTIONS, "blimp.limit_per_phenomenon": _NONNEG,
    "blimp.limits": (lambda v: all(n >= 0 for n in v), "numbers 0 or more"),
    "executor.jobs": _POS, "executor.eval_jobs": _NONNEG, "executor.threads": _NONNEG,
    "readout.kinds": (lambda v: set(v) <= {"probe", "pairs", "masked"},
                      "readout kinds among probe, pairs, masked"),
    "readout.max_train": _NONNEG, "readout.pair_limit": _NONNEG, "readout.masked_batches": _POS,
    "readout.pppl_batches": _NONNEG, "readout.batch_size": _POS,
    "readout.max_len": (lambda v: v >= 8, "at least 8"),
})

_NESTED = {"corpus": CorpusSpec, "dictionary": DictionarySpec, "probe": ProbeSpec,
           "finetune": FinetuneSpec, "blimp": BlimpSpec, "executor": ExecutorSpec}


def study_from_dict(raw: dict[str, Any], where: str = "study") -> StudySpec:
    """Build and validate a StudySpec from a parsed study file."""
    if not isinstance(raw, dict):
        raise UserError(f"{where} must be a mapping with keys such as base, arms, finetune")
    raw = dict(raw)
    groups = {k: build_dataclass(cls, raw.pop(k, None) or {}, k) for k, cls in _NESTED.items()}
    arms_raw = raw.pop("arms", None) or {}
    if not isinstance(arms_raw, dict) or not arms_raw:
        raise UserError(f"{where}: `arms` must map at least one arm name to "
                        "{objective: {name: ...}}")
    arms = {str(n): build_dataclass(ArmSpec, a or {}, f"arms.{n}") for n, a in arms_raw.items()}
    readout = raw.pop("readout", None)
    if readout is not None:
        readout = build_dataclass(ReadoutSpec, readout, "readout")
    spec = build_dataclass(StudySpec, raw, "study")
    spec = dataclasses.replace(spec, arms=arms, readout=readout, **groups)
    _validate(spec)
    return spec


def _validate(spec: StudySpec) -> None:
    for name, arm in spec.arms.items():
        if not name.replace("_", "").replace("-", "").isalnum():
            raise UserError(f"arm name {name!r} must be letters, digits, _ or -")
        if "name" not in arm.objective:
            raise UserError(f"arms.{name}.objective has no name; "
                            "write e.g. objective: {name: mlm}")
        # checks every key
        config_from_dict(merge(spec.base, {**arm.overrides, "objective": arm.objective}))
        unknown = set(arm.dictionary) - {"layer", "k", "lam"}
        if unknown:
            raise UserError(f"unknown key arms.{name}.dictionary.{sorted(unknown)[0]}; "
                            "valid keys: layer, k, lam")
        check_arm_dictionary(name, arm.dictionary, spec.dictionary.n_vectors)
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
    if spec.executor.kind not in ("local", "slurm"):
        raise UserError(f"executor.kind must be local or slurm, got {spec.executor.kind!r}")
    slurm = spec.executor.slurm
    if spec.executor.kind == "slurm" and "timeout_min" not in slurm \
            and slurm.get("cluster") not in ("local", "debug"):  # submitit would ask for 5 min
        raise UserError("executor.slurm.timeout_min is not set, so every job would get submitit's "
                        "5 minutes; set it to the longest stage's minutes (e.g. timeout_min: 1440)")


def _check_tasks(tasks: list[str]) -> None:
    """finetune.tasks: known names, each once (a repeated task would be fine-tuned twice)."""
    from mlsm.evaluate.tasks import get_task

    names = [get_task(t).name for t in tasks]  # an unknown name is one line listing the tasks
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UserError(f"finetune.tasks lists {twice[0]} twice; give each task once")


def check_arm_dictionary(arm: str, d: dict[str, Any], n_vectors: int, k_default: int = 0) -> None:
    """An arm's dictionary settings, refused in the study's own terms (a study has no
    `mlsm dictionary` flags). k_default: the k used when the arm gives none (0 = not known yet)."""
    layer, k, lam = d.get("layer", TEACHER_LAYER), d.get("k") or k_default, d.get("lam", LAM)
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise UserError(f"arms.{arm}.dictionary.layer must be a whole number >= 0 (got {layer!r})")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise UserError(f"arms.{arm}.dictionary.k must be a whole number >= 1 (got {k!r})")
    if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not lam > 0:
        raise UserError(f"arms.{arm}.dictionary.lam must be a number > 0 (got {lam!r}); "
                        f"Berend 2023 uses {LAM}")
    if k and n_vectors < k:
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
    spec = study_from_dict(raw, str(p))
    folder = out or spec.out or str(p.parent / p.stem)
    return dataclasses.replace(spec, out=str(Path(folder).expanduser()))


def readiness_label(frac: float) -> str:
    """0.25 -> '25%' (how arms@readiness are named in results and plots)."""
    return f"{100 * frac:g}%"
