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

    def full_state_dict(self, every_rank: bool = False) -> dict[str, Tensor]:
        """Full CPU weights with HF names on rank 0; an empty dict on the other ranks, or the
        full weights on every rank with ``every_rank`` (``weights.fanout``:
        ``asyncrl.weights.senders``)."""
        ...

    def save_pretrained(self, path: str | Path,
                        state: dict[str, Tensor] | None = None) -> None:
        """Write an HF ``from_pretrained`` directory (rank 0 writes; returns after a barrier).
        ``state``: this version's :meth:`full_state_dict`, already gathered (rank 0 full,
        the others empty), written as it is instead of gathered again; every rank passes
        one or none (the gather is collective)."""
        ...


@runtime_checkable
class NativeCheckpoint(Protocol):
    """A backend that saves its model and optimizer state in its own format, because only it
    can (DeepSpeed: ZeRO-partitioned optimizer state). ``learners.checkpoint`` keeps its layout
    around it (``step_<V>.tmp`` → ``step_<V>``, ``meta.json``, pruning); backends without these
    methods are saved as torch DCP. Both methods are COLLECTIVE."""

    checkpoint_format: str
    """Recorded in ``meta.json``: a checkpoint is only read by a backend of the same format."""

    def save_training_state(self, path: Path) -> None:
        """Write model + optimizer state under the existing directory ``path``."""
        ...

    def load_training_state(self, path: Path) -> None:
        """Restore what :meth:`save_training_state` wrote into this (freshly built) trainer."""
        ...


__all__ = ["NativeCheckpoint", "Trainer"]
