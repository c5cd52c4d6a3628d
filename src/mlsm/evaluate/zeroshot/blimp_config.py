"""The settings of minimal-pair scoring by PLL, declared once.

`BlimpConfig` is the one declaration: the flags of `mlsm blimp` are generated from its fields
(`mlsm.cli.dataclass_flags`), `evaluate_blimp(model, tokenizer, data, config, **settings)` takes it,
and a study's `blimp:` group (`mlsm.study.spec.BlimpSpec`) is a subclass that adds only the study's
own keys (which pair sets, which checkpoints). Each field's range sits beside it
(`metadata["check"]`); `metadata["decides"] = False` marks the settings that cannot change a score
(batching, an input-size refusal), which a study's fingerprint leaves out
(`mlsm.config.deciding`). Imports no torch: the CLI builds its parser from it before anything
heavy is loaded.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from mlsm.config import INT_LIMIT, build_dataclass, deciding
from mlsm.errors import UserError
from mlsm.limits import MAX_SENTENCE_CHARS


def _whole(v: Any, least: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and least <= v < INT_LIMIT


def _scoring_only(default: int, what: str) -> Any:
    """A positive whole-number setting that changes how pairs are processed, never a score."""
    return field(default=default, metadata={"check": (lambda v: _whole(v, 1), what),
                                            "decides": False})


@dataclass
class BlimpConfig:
    """How minimal pairs (BLiMP's format) are scored by pseudo-log-likelihood."""

    limit_per_phenomenon: int = field(default=0, metadata={
        "check": (lambda v: _whole(v, 0), "a whole number 0 or more (0 = every pair)"),
        "aliases": ("--limit",), "metavar": "N"})
    """First N pairs of each phenomenon (0 = all; BLiMP has 1000 per phenomenon)."""
    phenomena: list[str] = field(default_factory=list, metadata={"nargs": "+", "metavar": "UID"})
    """Phenomenon UIDs to score (of the first pair set, in a study); empty = all (67 for BLiMP)."""
    variant: Literal["original", "within_word_l2r"] = "original"
    """PLL variant: original (Salazar et al. 2020) or within_word_l2r (Kauf & Ivanova 2023: the
    later pieces of the scored word are masked too)."""
    token_budget: int = _scoring_only(8192, "a positive number of tokens")
    """Padded tokens per forward pass (memory, not scores)."""
    max_sentence_chars: int = _scoring_only(MAX_SENTENCE_CHARS, "a positive number of characters")
    """A longer sentence is refused before it is tokenised."""

    def decisive(self) -> dict[str, Any]:
        """The settings (a subclass's too) that can change a score, for fingerprints."""
        return deciding(self)


def blimp_config(config: BlimpConfig | None, settings: dict[str, Any],
                 where: str = "evaluate_blimp()") -> BlimpConfig:
    """`evaluate_blimp()`'s settings: `config`'s (or the defaults) with the keywords given on top
    (None = not given; a tuple of phenomena becomes a list), as a plain, range-checked BlimpConfig
    (a study's subclass is narrowed to the shared fields)."""
    if config is not None and not isinstance(config, BlimpConfig):
        raise UserError(f"{where}: config must be a BlimpConfig, got {type(config).__name__}")
    names = [f.name for f in dataclasses.fields(BlimpConfig)]
    base = {} if config is None else {n: getattr(config, n) for n in names}
    given = {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()
             if v is not None}
    return build_dataclass(BlimpConfig, {**base, **given}, where)
