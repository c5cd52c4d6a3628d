"""The MLSM dictionary's defaults, in one place: the teacher layer, λ of the ℓ1 penalty and the
number of atoms per hidden dimension: k ≈ 4d, as the Hitchhikers' Guide to Masked Latent Semantic
Modeling's k = 3072 for d = 768 (it says the original implementation of MLSM used k = 3000, the
official `train_dict.py --num_dict_atoms` default), and λ = 0.05 (the official code's `--lda`).

Torch-free on purpose: the CLI's argument defaults, the study runner, the dictionary learner, the
teacher loader and the objectives all read these numbers, and `mlsm --help` must stay fast.
"""

from __future__ import annotations

from collections.abc import Callable

TEACHER_LAYER = 5
"""Teacher layer l (HF hidden_states numbering, 0 = embeddings) when neither the run nor the
dictionary names one: the packaged all-MiniLM-L6-v2's second-to-last layer (early exit)."""

LAM = 0.05
"""λ of the dictionary's ℓ1 penalty (also the sparse codes' λ unless a run overrides it)."""



def lam_range(zero_means: str = "") -> tuple[Callable[[float], bool], str]:
    """λ's range, declared once, as a field's check (predicate, what it must be): 0 < λ < 1,
    since |⟨d_j, x⟩| ≤ 1 for unit atoms and ℓ2-normalised states, so a λ of 1 or more makes every
    code zero. zero_means: what 0 stands for, where a setting may leave λ to the dictionary."""

    def ok(lam: float) -> bool:
        return 0 < lam < 1 or (lam == 0 and bool(zero_means))

    why = "1 or more makes every sparse code zero"
    return ok, (f"in [0, 1) (0 = {zero_means}; {why})" if zero_means else f"in (0, 1) ({why})")


ATOMS_PER_DIM = 4
"""k = ATOMS_PER_DIM × d atoms when k is not given (k = 3072 for d = 768)."""


def default_k(d: int) -> int:
    """Number of dictionary atoms for a teacher of hidden size d."""
    return ATOMS_PER_DIM * d
# how the states a dictionary is learned on are drawn (mlsm.teacher.states.collect_vectors)
SAMPLINGS = ("windows", "documents")
# what the k -> |V| probe reads of the latent head (mlsm.objectives.probe.probe_input)
PROBE_INPUTS = ("probs", "logprobs", "logits")
# how a checkpoint's unigram control is estimated (mlsm.evaluate.zeroshot.unigram.run_unigram),
# in the fingerprints of the study stages that record it: rows of another estimate (before: a
# prefix of the store) are computed again, never mixed with these
UNIGRAM_ESTIMATE = "tokens the run consumed"
# heads a probe fits (mlsm.objectives.probe): MLSM's k -> |V|, and the two readout controls
PROBE_HEADS = ("latent", "vocab", "factored")
