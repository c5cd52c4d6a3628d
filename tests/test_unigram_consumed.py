"""One unigram estimate per checkpoint: the tokens its pre-training run consumed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mlsm.data.batches import BatchSource
from mlsm.data.corpus import TokenStore
from mlsm.evaluate.zeroshot.unigram import UnigramControl, consumed_counts, run_unigram
from mlsm.run_config import config_from_dict

from .helpers import TINY_MODEL


def _cfg(store_dir: Path, out: Path, seed: int, steps: int = 3, objective: str = "mlm") -> object:
    return config_from_dict({
        "objective": {"name": objective},
        "data": {"store": str(store_dir), "max_len": 32, "seed": seed},
        "model": {"arch": "bert", "overrides": dict(TINY_MODEL)},
        "train": {"steps": steps, "batch_size": 4, "out": str(out), "readiness": [0.5, 1.0],
                  "device": "cpu"}})


def test_counts_equal_the_batches_the_run_reads(store_dir: Path) -> None:
    """Parity with the training path: the counts are the tokens of every batch of the run
    (input ids of steps 0 .. S-1, [CLS]/[SEP] left out), across an epoch boundary too."""
    store = TokenStore.open(store_dir)
    tok = store.load_tokenizer()
    cfg = _cfg(store_dir, Path("unused"), seed=3)
    source = BatchSource(store, cfg.data, tok)
    steps = source.n_sequences // 4 + 2  # past the end of the first epoch
    by_batches = np.zeros(len(tok), dtype=np.int64)
    for step in range(steps):
        ids = source.micro_batches(step, 4, 4)[0].input_ids.numpy()
        by_batches += np.bincount(ids.ravel(), minlength=len(tok))[:len(tok)]
    by_batches[[tok.cls_token_id, tok.sep_token_id]] = 0
    got = consumed_counts(source, steps * 4, len(tok), block=5)  # blocks across batches
    assert np.array_equal(got, by_batches)


def test_every_checkpoint_of_a_run_and_every_arm_of_a_seed_share_it(store_dir: Path,
                                                                    tmp_path: Path) -> None:
    from mlsm.train.loop import pretrain

    runs = {}
    for name, seed, objective in (("a", 0, "mlm"), ("b", 0, "clm"), ("c", 1, "mlm")):
        runs[name] = pretrain(_cfg(store_dir, tmp_path / name, seed, objective=objective)) \
            / "checkpoints"
    half, full = runs["a"] / "step-0000002", runs["a"] / "step-0000003"
    counts = run_unigram(full)[0]
    assert np.array_equal(run_unigram(half)[0], counts)  # the run's, not the checkpoint's
    assert np.array_equal(run_unigram(runs["b"] / "step-0000003")[0], counts)
    assert not np.array_equal(run_unigram(runs["c"] / "step-0000003")[0], counts)  # other order
    # steps x batch x (max_len - 2) stream positions, less the separators between documents
    assert 0.9 * 3 * 4 * 30 < counts.sum() <= 3 * 4 * 30
    control = UnigramControl.consumed_by(full)
    assert control.n_tokens == counts.sum()
    assert np.exp(control.log_probs).sum() == pytest.approx(1.0)
