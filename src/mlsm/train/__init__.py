"""Training: the loop, schedules, checkpoints, distributed helpers."""
