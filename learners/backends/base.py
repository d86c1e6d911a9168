"""The learner-side contract every training backend satisfies (``learner.backend``).

The loop (``learners.loop``) and the weight publisher only need these members, so a backend is
swappable as long as it keeps their semantics: every method is COLLECTIVE (all ranks call it, in
the same order), metrics are global and identical on every rank, and ``version`` counts optimizer
steps (the policy version of the weights).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from torch import Tensor

from learners.batching import TrainBatch


@runtime_checkable
class Trainer(Protocol):
    """One learner rank of a data-parallel training backend (FSDP2, DeepSpeed ZeRO, ...)."""

    version: int
    """Optimizer steps taken: the policy version of the current weights."""

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on this rank's share of the global batch; global metrics."""
        ...

    def full_state_dict(self) -> dict[str, Tensor]:
        """Full CPU weights with HF names on rank 0; an empty dict on the other ranks."""
        ...

    def save_pretrained(self, path: str | Path) -> None:
        """Write an HF ``from_pretrained`` directory (rank 0 writes; returns after a barrier)."""
        ...


__all__ = ["Trainer"]
