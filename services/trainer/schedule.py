"""Learning-rate schedules with AReaL's names and meanings, as pure functions of the step.

`lr_scheduler_type` is `constant`, `linear` or `cosine`; the warm-up lasts `warmup_steps`
optimiser steps when that is set, else `int(warmup_steps_proportion * total_train_steps)`.
The multipliers are AReaL's (its FSDP engine takes `constant` and `linear` from transformers
and has its own `cosine`), so a config ported from AReaL gets the same LR at every step:

- warm-up: `step / warmup` (the first step runs at LR 0, as in AReaL/transformers); for
  cosine it starts from `min_lr_ratio` instead: `min_lr_ratio + (1 - min_lr_ratio) * step / warmup`;
- then constant: 1; linear: `(total - step) / (total - warmup)`, down to 0 at `total`
  (`min_lr_ratio` does not apply, as in AReaL's FSDP engine); cosine: half a cosine from 1 to
  `min_lr_ratio` at `total`, never below it.

A trainer restarted at step s rebuilds the same LR by stepping the scheduler s times.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from services.config.schema import OptimizerConfig

SCHEDULES = ("constant", "linear", "cosine")


def warmup_steps(opt: OptimizerConfig, total_train_steps: int) -> int:
    """Warm-up length in optimiser steps: `warmup_steps` wins over the proportion."""
    if opt.warmup_steps is not None:
        return opt.warmup_steps
    return int(opt.warmup_steps_proportion * total_train_steps)


def lr_multiplier(opt: OptimizerConfig, total_train_steps: int) -> Callable[[int], float]:
    """step (0-based) -> factor applied to `opt.lr` for that step."""
    kind, floor = opt.lr_scheduler_type, opt.min_lr_ratio
    if kind not in SCHEDULES:
        raise ValueError(f"actor.optimizer.lr_scheduler_type: {kind!r} is not one of {', '.join(SCHEDULES)}")
    warmup = warmup_steps(opt, total_train_steps)
    decay = max(1, total_train_steps - warmup)

    def constant(step: int) -> float:
        return step / max(1, warmup) if step < warmup else 1.0

    def linear(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        return max(0.0, (total_train_steps - step) / decay)

    def cosine(step: int) -> float:
        if step < warmup:
            return floor + (1.0 - floor) * step / max(1, warmup)
        progress = (step - warmup) / decay
        return max(floor, floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress)))

    return {"constant": constant, "linear": linear, "cosine": cosine}[kind]


def make_scheduler(
    optimizer: torch.optim.Optimizer, opt: OptimizerConfig, total_train_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A `LambdaLR` whose `get_last_lr()` is the LR of the step about to run."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(opt, total_train_steps))
