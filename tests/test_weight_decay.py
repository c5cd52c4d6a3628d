"""`optim.decay_all`: BERT's convention (no decay on 1-D tensors) by default, every parameter
decayed as the official MLSM `pretrainer.py` when set. Checked by what one AdamW step does to the
weights: with zero gradients Adam's update is 0, a parameter moves only by its decoupled decay."""

from __future__ import annotations

import pytest
import torch

from mlsm.run_config import load_config
from mlsm.train import loop

LR, WD = 0.1, 0.5


@pytest.mark.parametrize("decay_all", [False, True])
def test_decay_reaches_norms_and_biases_only_when_asked(decay_all: bool) -> None:
    cfg = load_config(None, [f"optim.lr={LR}", f"optim.weight_decay={WD}",
                             f"optim.decay_all={str(decay_all).lower()}"])
    module = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    opt = loop._optimizer(module, cfg)
    for p in module.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for name, p in module.named_parameters():
        decayed = p.ndim >= 2 or decay_all
        expected = before[name] * (1 - LR * WD) if decayed else before[name]
        torch.testing.assert_close(p.detach(), expected, msg=name)


def test_hitchhiker_recipes_decay_every_parameter() -> None:
    from pathlib import Path

    for recipe in sorted(Path(__file__).parents[1].glob("configs/hitchhiker/*.yaml")):
        assert load_config(recipe).optim.decay_all, recipe.name
