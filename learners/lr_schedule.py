"""The learning rate of each optimizer step: a linear warmup, then constant, cosine or linear.

The rate is a pure function of the number of optimizer steps already taken (the learner's
version V), so it needs no state of its own: a learner resumed at version V from a checkpoint
(which restores V) takes exactly the rates of the run it continues. Step V + 1 (the update made
at version V) uses

    warmup (V < W):   lr · (V + 1) / W
    then, with progress q = (V − W) / (total_steps − W) clipped to [0, 1]:
      constant        lr
      linear          lr · (m + (1 − m) · (1 − q))
      cosine          lr · (m + (1 − m) · ½ · (1 + cos(π q)))

where W = ``learner.lr_warmup_steps``, m = ``learner.lr_min_ratio`` and lr = ``learner.lr``.
The first update already moves (warmup starts at lr / W, not 0), and the last decaying update
(V = total_steps − 1) is just above lr · m.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LrSchedule:
    """``learner.lr``, ``lr_warmup_steps``, ``lr_schedule``, ``lr_min_ratio``, ``total_steps``."""

    lr: float
    warmup_steps: int = 0
    schedule: str = "constant"
    min_ratio: float = 0.0
    total_steps: int = 1

    @classmethod
    def from_config(cls, cfg, lr: float | None = None) -> LrSchedule:
        """The schedule of a :class:`~asyncrl.config.schema.LearnerConfig` (peak rate ``lr``
        if given, e.g. the critic's own)."""
        return cls(cfg.lr if lr is None else lr, cfg.lr_warmup_steps, cfg.lr_schedule,
                   cfg.lr_min_ratio, cfg.total_steps)

    def factor(self, steps_taken: int) -> float:
        """The multiplier of ``lr`` for the update made after ``steps_taken`` updates."""
        if steps_taken < self.warmup_steps:
            return (steps_taken + 1) / self.warmup_steps
        if self.schedule == "constant":
            return 1.0
        span = max(self.total_steps - self.warmup_steps, 1)
        progress = min(max((steps_taken - self.warmup_steps) / span, 0.0), 1.0)
        shape = 1.0 - progress if self.schedule == "linear" else \
            0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_ratio + (1.0 - self.min_ratio) * shape

    def rate(self, steps_taken: int) -> float:
        return self.lr * self.factor(steps_taken)

    def apply(self, optimizer: torch.optim.Optimizer, steps_taken: int) -> float:
        """Set every parameter group's rate for the next ``optimizer.step()``; returns it."""
        rate = self.rate(steps_taken)
        for group in optimizer.param_groups:
            group["lr"] = rate
        return rate


__all__ = ["LrSchedule"]
