"""The learning-rate schedule: a pure function of the step (so it needs no state of its own
in a checkpoint beyond the step)."""

from __future__ import annotations

import math


def learning_rate(
    step: int, *, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float
) -> float:
    """Linear warmup over ``warmup_steps``, then cosine decay to ``min_lr_ratio * lr`` at
    ``total_steps``. ``step`` counts from 0 (the first optimizer step)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    decay_steps = max(total_steps - warmup_steps, 1)
    progress = min((step - warmup_steps) / decay_steps, 1.0)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * cosine)
