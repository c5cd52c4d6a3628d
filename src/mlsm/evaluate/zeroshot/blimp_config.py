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

from dataclasses import dataclass, field
from typing import Any, Literal

from mlsm.config import POSITIVE_INT, Settings, deciding, whole
from mlsm.limits import MAX_SENTENCE_CHARS


def _scoring_only(default: int, what: str) -> Any:
    """A positive whole-number setting that changes how pairs are processed, never a score."""
    return field(default=default, metadata={"check": (POSITIVE_INT[0], what), "decides": False})


@dataclass
class BlimpConfig(Settings):
    """How minimal pairs (BLiMP's format) are scored by pseudo-log-likelihood. `evaluate_blimp()`
    takes it as `BlimpConfig.over(config, keywords, ...)`."""

    SECTION = "evaluate_blimp()"

    limit_per_phenomenon: int = field(default=0, metadata={
        "check": (lambda v: whole(v) and v >= 0, "a whole number 0 or more (0 = every pair)"),
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
