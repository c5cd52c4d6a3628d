"""The settings of a fine-tuning grid, declared once.

`FinetuneConfig` is the one declaration: the flags of `mlsm finetune` are generated from its fields
(`mlsm.cli.dataclass_flags`), `finetune(models, tasks, config, **settings)` takes it, and a study's
`finetune:` section (`mlsm.study.spec.FinetuneSpec`) is a subclass that adds only the study's own
keys. Each field's range sits beside it (`metadata["check"]`, read by `build_dataclass` and by the
flag parser); `metadata["decides"] = False` marks the settings that cannot change a cell's scores
(which cells run, where the data is, whether to redo them); the others go into each cell's
fingerprint (`mlsm.config.deciding`, `mlsm.evaluate.finetune.cell_reuse`). Imports no torch: the CLI
builds its parser from it before anything heavy is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mlsm.config import INT_LIMIT, NON_NEGATIVE, POSITIVE_INT, Settings, deciding, whole

HEADS = ("cls", "mean")
DEFAULT_MAX_LEN = 128
"""max_len 0: the length of sentence, token and QA cells, and of retrieval cells whose model
folder gives none."""
MODEL_MAX_LEN_CAP = 512
"""max_len 0: the most tokens a retrieval cell takes from config.json's max_position_embeddings
(BERT's length; a sentence_bert_config.json length is taken as it is)."""


def _seeds_ok(v: Any) -> bool:
    if isinstance(v, list):
        return bool(v) and all(whole(s) and s >= 0 for s in v) and len(set(v)) == len(v)
    return whole(v) and v > 0


def _seed_count(text: str) -> int:
    value = int(text)  # ValueError: argparse's one line
    if not 0 < value < INT_LIMIT:
        raise ValueError(f"must be a positive number of seeds, got {text}")
    return value


def _checked(check: tuple[Any, str]) -> dict[str, Any]:
    return {"check": check}


_FRACTION = (lambda v: 0 <= v < 1, "in [0, 1)")


@dataclass
class FinetuneConfig(Settings):
    """How every (model, task, seed, lr) cell is fine-tuned and scored. `finetune()` takes it as
    `config_of(config, keywords)`; `mlsm finetune`'s flags and a study's `finetune:` section are
    its fields."""

    SECTION = "finetune"
    seeds: int | list[int] = field(default=5, metadata={
        "check": (_seeds_ok, "positive (a number of seeds N, run as 0..N-1) or a list of "
                             "distinct seeds 0 or more"),
        "flag": _seed_count, "metavar": "N", "decides": False})  # a cell's key, not a setting
    """Seeds per (model, task, lr): N runs seeds 0..N-1, or the list of seeds. Paired across
    models: for seed s the head init and data order are the same for every backbone."""
    lrs: list[float] = field(default_factory=lambda: [2e-5], metadata={"check": (
        lambda v: bool(v) and all(lr > 0 for lr in v), "positive learning rates"),
        "metavar": "LR,LR", "decides": False})  # each lr is a cell's key
    """Learning rates, comma-separated on the command line (a grid: every lr is run)."""
    epochs: int = field(default=3, metadata=_checked(POSITIVE_INT))
    """Passes over the training set (an upper bound when max_steps ends first)."""
    max_steps: int = field(default=0, metadata=_checked(NON_NEGATIVE))
    """Most optimizer steps per run, whichever of it and epochs ends first (0: no cap)."""
    batch_size: int = field(default=32, metadata=_checked(POSITIVE_INT))
    """Training examples per optimizer step."""
    head: str = field(default="cls", metadata=_checked((lambda v: v in HEADS, "cls or mean")))
    """Sentence-task head: cls = first token, dense, tanh, linear; mean = mean-pooled tokens,
    linear."""
    val_fraction: float = field(default=0.0, metadata=_checked(_FRACTION))
    """Hold out this fraction of each training set to pick the best of lrs on; the grid goes to
    RESULTS.lr-grid.jsonl (0: every lr is reported; the dev set is never used to choose)."""
    preset: str = field(default="", metadata={"metavar": "NAME", "decides": False})
    """A named protocol, e.g. mlm-vs-clm-2025 (docs/finetune.md): it fixes seeds, lrs, epochs,
    max_steps, batch_size, warmup_ratio, head and val_fraction; in `mlsm finetune` settings you give
    override it, a study file refuses a setting the preset fixes (one line names it)."""
    max_len: int = field(default=0, metadata=_checked((lambda v: v == 0 or v >= 4,
                                                       "0 (each task's own) or at least 4")))
    """Sequence length in tokens (pairs truncated longest-first), up to the model's limit. 0: 128
    for sentence, token and QA tasks; for retrieval the model's own length, as
    sentence-transformers takes it (sentence_bert_config.json's max_seq_length, else config.json's
    max_position_embeddings up to 512, else 128). Rows record the length used."""
    max_train_examples: int | None = field(default=None, metadata=_checked((
        lambda v: v is None or (whole(v) and v > 0), "a positive integer (null: all)")))
    """Cap on training examples per task, a fixed subset for every model and seed (none: all);
    evaluation sets are never capped."""
    warmup_ratio: float = field(default=0.0, metadata=_checked(_FRACTION))
    """Fraction of a run's steps with linear warmup; linear decay to 0 after."""
    weight_decay: float = field(default=0.01, metadata=_checked(NON_NEGATIVE))
    """AdamW weight decay (not on biases and LayerNorm weights)."""
    fixed_order: bool = False
    """Every seed trains on seed 0's data order, so seeds differ in the head only (the
    Hitchhikers' Guide §4.2)."""
    clip: float = field(default=1.0, metadata=_checked(NON_NEGATIVE))
    """Gradient-norm clipping, 0 = off."""
    eval_test: bool = False
    """Also score labelled test splits (CoNLL-2003) as <metric>_test, beside the dev metrics and
    never in the paired statistics."""
    temperature: float = field(default=0.05, metadata=_checked((lambda v: v > 0, "positive")))
    """InfoNCE temperature of fine-tuned retrieval tasks (0.05 = sentence-transformers' scale 20,
    SimCSE's)."""
    data_dir: str = field(default="", metadata={"decides": False})
    """Folder holding the task folders (CoLA/, SST-2/, ..., conll2003/, squad_v1.1/); empty: HF
    datasets. Its files' content, not its path, goes into each cell's fingerprint."""
    recompute: bool = field(default=False, metadata={"decides": False})
    """Train again the cells whose stored rows came from other inputs or settings (another
    fingerprint, or none: rows written before fingerprints); the fresh rows are appended and
    supersede the old ones, which compare and report then ignore. Without it such a cell is a
    one-line refusal."""

    def seed_list(self) -> list[int]:
        """The seeds run: 0..N-1 for a number N, else the list given."""
        return list(range(self.seeds)) if isinstance(self.seeds, int) else list(self.seeds)

    def decisive(self, kind: str, trained: bool) -> dict[str, Any]:
        """The settings that decide a cell's scores for a task of `kind` (`TaskSpec.kind`):
        `FinetuneConfig`'s deciding fields (not a study's own), less those the task never reads
        (the head of a bi-encoder, the temperature of a classifier, every training setting of a
        zero-shot cell)."""
        if not trained:  # zero-shot retrieval scores the checkpoint as loaded
            return {"max_len": self.max_len}
        skip = {"head"} if kind == "retrieval" else {"temperature"}
        return {k: v for k, v in deciding(self, FinetuneConfig).items() if k not in skip}

    @classmethod
    def build(cls, values: dict[str, Any], where: str = "finetune") -> FinetuneConfig:
        """`Settings.build`, after a preset's values fill the settings not given."""
        if values.get("preset"):
            from mlsm.evaluate.finetune.protocol import get_preset

            values = {**get_preset(values["preset"]).values, **values}
        return super().build(values, where)


def config_of(config: FinetuneConfig | None, settings: dict[str, Any]) -> FinetuneConfig:
    """`finetune()`'s settings (`Settings.over`); data_dir=None is the default (HF datasets)."""
    if settings.get("data_dir", "") is None:
        settings = {**settings, "data_dir": ""}
    return FinetuneConfig.over(config, settings)
