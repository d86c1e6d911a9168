"""What a learner rank does around the collectives every rank runs: rank 0's part, or the
others'. The step (:func:`learners.loop._train`) calls the same methods on every rank, so it
has one shape and every rank meets the same collectives in the same order.

Rank 0 (:class:`~learners.rank_zero.RankZero`) reads the buffer (prefetch, lease, ack),
publishes the weights, writes the metrics and evaluates. The other ranks
(:class:`OtherRank`) get their share of the batch in the scatter and publish nothing: each
of their methods returns at once, with what stands for "nothing" there (no batch, no record,
no shares, no stop).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from asyncrl.config import Config
from asyncrl.evaluation import EvaluatorFactory
from buffers import BufferClient

if TYPE_CHECKING:
    from learners.lost import Lost


@dataclass
class RankContext:
    """One rank's place in the run: its config, rank, and a buffer client of its own."""

    cfg: Config
    rank: int
    world: int
    client: BufferClient
    member: str
    address: str | None = None
    stop: threading.Event | None = None  # the role's: the rank's buffer clients are given it


class RankRole(Protocol):
    """One rank's part of the run; on ranks other than 0 every method does nothing."""

    reached: dict[str, Any] | None   # the eval that met eval.stop_at_accuracy (rank 0)
    last_record: dict[str, Any]      # the last step's record, kept in the heartbeat

    def starting(self, version: int, reached: dict[str, Any] | None) -> None:
        """Training starts at ``version``, the eval target ``reached`` before it or not."""

    def resumed(self, state: Any, version: int) -> None:
        """Resumed from a checkpoint: give the engines the restored weights."""

    def poll(self, version: int, stop: threading.Event, lost: Lost) -> tuple[bool, bool]:
        """Wait a while for the batch of ``version``: ``(got it, the data ran out)``."""

    def take_ready(self, version: int) -> None:
        """Hold the batch of ``version``, agreed already fetched."""

    def resync_late_joiners(self, version: int) -> None:
        """Give engines that joined since the last step the current weights."""

    def say(self, message: str, *args: Any) -> None:
        """Log one line for the learner (rank 0's), not one per rank."""

    def leased(self) -> contextlib.AbstractContextManager[Any]:
        """The held batch, packed for the scatter (None on other ranks), its lease renewed
        while the step trains it."""

    def prefetch(self, version: int) -> None:
        """Start fetching the batch of ``version`` while this step trains."""

    def ack(self, version: int, metrics: dict[str, Any], lost: Lost) -> dict[str, Any]:
        """Ack the trained batch, add what it was to ``metrics``; returns the buffer's stats."""

    def publish(self, version: int, state: Any, metrics: dict[str, Any], stats: dict[str, Any],
                phase_times: dict[str, float], lost: Lost) -> bool:
        """Publish ``version``'s weights, write its record; whether the eval target is met."""

    def next_shares(self, version: int) -> Any | None:
        """The next batch's shares' sizes if it is fetched already, else None."""

    def finish(self, state: Any, version: int, done: bool) -> None:
        """The run's end, past the last collective: final eval, the run marked done."""

    def close(self, buffer_lost: bool = False) -> None:
        """Let go of what the role holds (idempotent)."""


class OtherRank:
    """A rank other than 0: no batch (its share comes in the scatter), no weights to
    publish, no record, no eval. ``reached`` stays None: the eval target is rank 0's to
    decide, and only rank 0's ``reached`` reaches the checkpoint's meta."""

    def __init__(self) -> None:
        self.reached: dict[str, Any] | None = None
        self.last_record: dict[str, Any] = {}

    def starting(self, version: int, reached: dict[str, Any] | None) -> None:
        pass

    def resumed(self, state: Any, version: int) -> None:
        pass

    def poll(self, version: int, stop: threading.Event, lost: Lost) -> tuple[bool, bool]:
        return False, False

    def take_ready(self, version: int) -> None:
        pass

    def resync_late_joiners(self, version: int) -> None:
        pass

    def say(self, message: str, *args: Any) -> None:
        pass

    @contextlib.contextmanager
    def leased(self) -> Iterator[None]:
        yield None

    def prefetch(self, version: int) -> None:
        pass

    def ack(self, version: int, metrics: dict[str, Any], lost: Lost) -> dict[str, Any]:
        return {}

    def publish(self, version: int, state: Any, metrics: dict[str, Any], stats: dict[str, Any],
                phase_times: dict[str, float], lost: Lost) -> bool:
        return False

    def next_shares(self, version: int) -> Any | None:
        return None

    def finish(self, state: Any, version: int, done: bool) -> None:
        pass

    def close(self, buffer_lost: bool = False) -> None:
        pass


def make_role(ctx: RankContext, model_dir: Path, evaluator: EvaluatorFactory) -> RankRole:
    """Rank 0's role (``evaluator`` builds its periodic eval), or the other ranks'."""
    if ctx.rank != 0:
        return OtherRank()
    from learners.rank_zero import RankZero

    return RankZero(ctx, model_dir, evaluator)
