"""The settings of the plateau probe fit, declared once.

`ProbeFitConfig` is the one declaration: the flags of `mlsm probe` are generated from its fields
(`mlsm.cli.dataclass_flags`), `train_probe_to_plateau(checkpoint, out, config, **settings)` takes
it,
and a study's `probe:` group (`mlsm.study.spec.ProbeSpec`) is a subclass that adds the paper
recipe's keys and its own batch size. Each field's range sits beside it (`metadata["check"]`, read
by `build_dataclass` and by the flag parser). Named apart from the probe *objective*'s
`mlsm.objectives.probe.ProbeConfig` (the objective group of a probe run), which the fit also uses.

Imports no torch (`mlsm.evaluate.probe.probe_fit` does): the CLI builds its parser from it before
anything heavy is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mlsm.config import NON_NEGATIVE_INT, POSITIVE_INT, Settings, ranged, whole
from mlsm.defaults import PROBE_HEADS, PROBE_INPUTS

_INPUTS = (lambda v: bool(v) and len(set(v)) == len(v) and set(v) <= set(PROBE_INPUTS),
           "distinct input kinds among " + ", ".join(PROBE_INPUTS))


PAPER_PROBE_STEPS = 10_000
"""Steps of the Hitchhikers' Guide's probe (§4.3, Fig. 6): a fixed length with readiness
checkpoints, no plateau stop (`mlsm probe --recipe paper`)."""


@dataclass
class ProbeRecipe:
    """Which probe is trained: ours, fitted to a held-out plateau, or a fixed number of steps
    through the training loop (the paper's). `mlsm probe`'s --recipe and --steps, `run_probe()`'s
    keywords and a study's `probe.recipe` / `probe.steps` come from these fields."""

    recipe: Literal["plateau", "paper"] = "plateau"
    """plateau (ours): trained to a held-out loss plateau, at most max_steps, with the
    `ProbeFitConfig` settings; paper: the Hitchhikers' Guide's probe (§4.3), `steps` steps through
    the training loop with readiness checkpoints at 10/25/50/100 % and no plateau stop."""
    steps: int = field(default=0, metadata={
        "check": (lambda v: whole(v) and v >= 0, "a whole number 0 or more (0 = the recipe's)"),
        "metavar": "N"})
    """Fixed probe steps through the training loop; 0 = the recipe's (plateau: to a held-out
    plateau, no fixed length; paper: 10,000, the Hitchhikers' Guide's)."""

    def loop_steps(self) -> int:
        """Steps through the training loop: `steps`, or the paper's 10,000; 0 = the plateau fit."""
        return self.steps or (PAPER_PROBE_STEPS if self.recipe == "paper" else 0)


@dataclass
class ProbeFitConfig(Settings):
    """How the k -> |V| probe is trained to a held-out loss plateau (docs/study.md, "The probe").
    `train_probe_to_plateau()` and `run_probe()` take it as `ProbeFitConfig.over(config, ...)`."""

    SECTION = "probe"

    head: Literal["latent", "vocab", "factored"] = field(default="latent", metadata={
        "check": (lambda v: v in PROBE_HEADS, "one of " + ", ".join(PROBE_HEADS))})
    """Which head is fitted on the frozen checkpoint: latent (MLSM's probe, k -> |V| on the
    checkpoint's latent head); the readout controls, for a checkpoint of any objective: vocab (a
    fresh untied d -> |V| head) or factored (a fresh d -> k -> |V| head of MLSM's readout shape,
    both parts trained). docs/readouts.md, "Readout controls"."""
    rank: int = ranged(0, NON_NEGATIVE_INT)
    """Width k of a factored head; 0 = the checkpoint's latent k (4 x d without a latent head)."""
    lr: float = ranged(0.2, (lambda v: v > 0, "positive"))
    """Adam lr of the k -> |V| probe per unit of mean input L1 norm (inputs are standardised), i.e.
    roughly how far one step may move a logit (see mlsm.evaluate.probe.probe_fit)."""
    inputs: list[str] = field(default_factory=lambda: list(PROBE_INPUTS), metadata={
        "check": _INPUTS, "metavar": "KIND,KIND"})
    """Input kinds tried for `select_steps` steps; the best on held-out chunks continues."""
    select_steps: int = ranged(100, NON_NEGATIVE_INT)
    """Steps every input kind trains before the best is kept."""
    max_steps: int = ranged(2000, POSITIVE_INT)
    """Upper bound on probe steps; training stops earlier at a held-out loss plateau."""
    eval_every: int = ranged(50, POSITIVE_INT)
    """Held-out loss is measured every N steps."""
    patience: int = ranged(3, POSITIVE_INT)
    """Stop after this many evaluations without a relative improvement of `min_delta`."""
    min_delta: float = ranged(0.005, (lambda v: v >= 0, "0 or more"))
    """Relative held-out loss improvement that counts as progress."""
    heldout_batches: int = ranged(4, POSITIVE_INT)
    """Batches of held-out chunks (steps beyond the pre-training run) for the plateau test."""
    batch_size: int | None = field(default=None, metadata={
        "check": (lambda v: v is None or (whole(v) and v > 0),
                  "a positive whole number (null: the pre-training run's)"),
        "metavar": "N"})
    """Probe batch size in sequences (none: the pre-training run's; the k x |V| probe costs ~6 x
    an MLM head per target)."""
