"""Learning-rate schedules as pure functions of the step (so resuming needs no scheduler state)."""

from __future__ import annotations

from mlsm.config import OptimConfig
from mlsm.errors import UserError


def _steps(value: float, total: int) -> int:
    return round(value * total) if value < 1 else int(value)


def lr_factor(step: int, total: int, cfg: OptimConfig) -> float:
    """Multiplier of cfg.lr at `step` (0-based) of `total` optimizer steps.

    linear: warmup 0 -> 1, then linear decay to min_lr_ratio at the last step (BERT; the paper's
    recipe with 2 % warmup). wsd: warmup, constant 1, and a final linear decay of `decay` steps
    (Hu et al. 2024, MiniCPM; Gisserot-Boukhlef et al. 2025's CLM->MLM runs keep one such
    schedule across the switch).
    """
    warmup = _steps(cfg.warmup, total)
    floor = cfg.min_lr_ratio
    if step < warmup:
        return (step + 1) / warmup
    if cfg.schedule == "linear":
        span = max(1, total - warmup)
        return floor + (1 - floor) * max(0.0, (total - step) / span)
    if cfg.schedule == "wsd":
        decay = _steps(cfg.decay, total)
        start = total - decay
        if step < start:
            return 1.0
        return floor + (1 - floor) * max(0.0, (total - step) / max(1, decay))
    raise UserError(f"optim.schedule={cfg.schedule!r} is unknown; use linear or wsd")
