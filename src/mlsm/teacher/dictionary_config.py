"""The settings of dictionary learning, declared once.

`DictionaryConfig` is the one declaration: the flags of `mlsm dictionary` are generated from its
fields (`mlsm.cli.dataclass_flags`), `learn_dictionary(store, teacher, config, **settings)` takes
it,
and a study's `dictionary:` group (`mlsm.study.spec.DictionarySpec`) is a subclass that adds the
study's teacher and its own smaller `n_vectors` default. Each field's range sits beside it
(`metadata["check"]`, read by `build_dataclass` and by the flag parser). The teacher and its layer
are not here: they are `load_teacher`'s, and `learn_dictionary` takes the loaded teacher, which must
have been loaded with `teacher_init` / `teacher_seed` (the two controls' switches sit here so that
`mlsm dictionary` and a study's `dictionary:` group take them like every other setting).

Imports no torch (`mlsm.teacher` loads its other modules on first use): the CLI builds its
parser from it before anything heavy is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from mlsm.config import NON_NEGATIVE_INT, POSITIVE_INT, Settings, ranged, whole
from mlsm.defaults import LAM, SAMPLINGS, lam_range

AtomKind = Literal["learned", "random", "random_nonneg"]
ATOM_KINDS: tuple[str, ...] = get_args(AtomKind)
"""How a dictionary's atoms are made: learned (MLSM), or random directions, a control for what the
learned structure adds (docs/dictionary.md, "Controls")."""
TeacherInit = Literal["pretrained", "random"]
TEACHER_INITS: tuple[str, ...] = get_args(TeacherInit)
"""The teacher's weights: its own (pre-trained), or its architecture randomly initialised, a control
for what the teacher's pre-training adds (`mlsm.teacher.teacher.load_teacher`)."""


_OPTIONAL_POSITIVE = (lambda v: v is None or (whole(v) and v > 0),
                      "a positive whole number (null: the default)")


@dataclass
class DictionaryConfig(Settings):
    """How a dictionary is learned from a teacher's states (Berend 2023; docs/dictionary.md).
    `learn_dictionary()` takes it as `DictionaryConfig.over(config, keywords, ...)`."""

    SECTION = "dictionary"

    k: int | None = field(default=None, metadata={"check": _OPTIONAL_POSITIVE, "metavar": "K"})
    """Number of atoms (none: 4 × the teacher's hidden size, 1536 for MiniLM)."""
    lam: float = ranged(LAM, lam_range())
    """λ of the ℓ1 penalty; larger = sparser codes (the official MLSM code uses 0.05)."""
    n_vectors: int = ranged(2_000_000, POSITIVE_INT)
    """Teacher states collected from the store (paper scale); memory n × d × 4 bytes."""
    max_len: int = ranged(128, (lambda v: whole(v) and v >= 3,
                                "at least 3 (the teacher's two special tokens and one more)"))
    """Window length given to the teacher, special tokens included."""
    batch_size: int = ranged(512, POSITIVE_INT)
    """Mini-batch of the online learner (vectors per update)."""
    n_iter: int | None = field(default=None, metadata={"check": _OPTIONAL_POSITIVE,
                                                       "metavar": "N"})
    """Number of mini-batches (none: one pass over the collected states)."""
    forget: float = ranged(1.0, (lambda v: v >= 0, "0 or more"))
    """ρ of the forgetting factor β_t = (1 − 1/t)^ρ (Mairal et al. 2009 §3.4); larger forgets
    the codes of early dictionaries faster."""
    eval_vectors: int = ranged(20_000, POSITIVE_INT)
    """Collected states on which the final objective in the meta is computed."""
    seed: int = ranged(0, NON_NEGATIVE_INT)
    """Seed of the state sample, the atom initialisation and the mini-batch order."""
    sampling: str = field(default="windows", metadata={
        "check": (lambda v: v in SAMPLINGS, " or ".join(SAMPLINGS)),
        "metavar": "{" + ",".join(SAMPLINGS) + "}"})
    """windows: states at random token positions; documents: each document of 5+ words from
    its start, in store order, as the official train_dict.py."""
    atoms: AtomKind = "learned"
    """learned: atoms learned on the teacher's states (MLSM); random: k random unit-norm atoms
    (Gaussian directions, seeded by `seed`, no states collected), the control for what the learned
    atoms add at the same k, λ, layer and teacher; random_nonneg: |Gaussian| atoms (then ~38 % of
    MiniLM's codes are all zero: docs/dictionary.md, "Controls")."""
    teacher_init: TeacherInit = "pretrained"
    """pretrained: the teacher's own weights; random: the same architecture randomly initialised
    (seeded by teacher_seed), the control for what the teacher's pre-training adds; the teacher
    given must be loaded so (`load_teacher(..., init=, seed=)`)."""
    teacher_seed: int = ranged(0, NON_NEGATIVE_INT)
    """Seed of the random teacher's weights (teacher_init=random; not read otherwise)."""
