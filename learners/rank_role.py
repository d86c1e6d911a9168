"""What a learner rank does around the collectives every rank runs: rank 0's part, or the
others'. The step (:func:`learners.loop._train`) calls the same methods on every rank, so it
has one shape and every rank meets the same collectives in the same order.

Rank 0 (:class:`~learners.rank_zero.RankZero`) reads the buffer (prefetch, lease, ack),
publishes the weights, writes the metrics and evaluates. The other ranks
(:class:`OtherRank`) get their share of the batch in the scatter and publish nothing: each
of their methods returns at once, with what stands for "nothing" there (no batch, no record,
no shares, no stop). With ``weights.fanout`` on, they also send each version to their slice
of the engines (:class:`~asyncrl.weights.fanout.SliceSender`, on a thread); rank 0 still
announces, decides and collects the acks, and writes what every rank sent in its records.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from asyncrl.config import Config
from asyncrl.evaluation import EvaluatorFactory
from buffers import BufferClient

if TYPE_CHECKING:
    from asyncrl.weights.fanout import SliceSender
    from learners.lost import Lost

logger = logging.getLogger(__name__)


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

    def left_group(self) -> None:
        """After this rank left the process group (past the barrier of a run's end, when
        rank 0 has closed): let go of what rank 0's last delivery needed (idempotent)."""

    def sent_totals(self) -> list[int]:
        """What this rank sent the engines so far: ``[bytes x engines, engines]``."""

    def ranks_sent(self, totals: list[list[int]]) -> None:
        """Every rank's :meth:`sent_totals`, one row per rank (rank 0 records them)."""


class OtherRank:
    """A rank other than 0: no batch (its share comes in the scatter), no record, no eval.
    ``reached`` stays None: the eval target is rank 0's to decide, and only rank 0's
    ``reached`` reaches the checkpoint's meta. ``sender`` (``weights.fanout``): this rank's
    :class:`~asyncrl.weights.fanout.SliceSender`, started, on a buffer client of its own
    (``client``, closed with it); each version's state is offered to it. Without one, no
    weights to publish."""

    def __init__(self, sender: SliceSender | None = None,
                 client: BufferClient | None = None) -> None:
        self.reached: dict[str, Any] | None = None
        self.last_record: dict[str, Any] = {}
        self._sender, self._client = sender, client

    def starting(self, version: int, reached: dict[str, Any] | None) -> None:
        pass

    def resumed(self, state: Any, version: int) -> None:
        if self._sender is not None:   # rank 0 delivers the restored weights at once
            self._sender.offer(state, version)

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
        if self._sender is not None:   # sent when rank 0 announces it
            self._sender.offer(state, version)
        return False

    def next_shares(self, version: int) -> Any | None:
        return None

    def finish(self, state: Any, version: int, done: bool) -> None:
        pass

    def close(self, buffer_lost: bool = False) -> None:
        pass   # the sender serves rank 0's last delivery until the group is left

    def left_group(self) -> None:
        sender, self._sender = self._sender, None
        if sender is not None:
            sender.stop()
            logger.info("weights: learner rank %d sent %d versions to %d engines in all "
                        "(%.1f MB)", sender.rank, len(sender.sent_versions),
                        sender.sent_engines, sender.sent_bytes / 1e6)
        if self._client is not None:
            self._client.close()
            self._client = None

    def sent_totals(self) -> list[int]:
        sender = self._sender
        return [sender.sent_bytes, sender.sent_engines] if sender is not None else [0, 0]

    def ranks_sent(self, totals: list[list[int]]) -> None:
        pass


def make_role(ctx: RankContext, model_dir: Path, evaluator: EvaluatorFactory) -> RankRole:
    """Rank 0's role (``evaluator`` builds its periodic eval), or the other ranks' (with
    ``weights.fanout`` on, each with a :class:`~asyncrl.weights.fanout.SliceSender`)."""
    if ctx.rank != 0:
        return OtherRank(*_slice_sender(ctx))
    from learners.rank_zero import RankZero

    return RankZero(ctx, model_dir, evaluator)


def _slice_sender(ctx: RankContext) -> tuple[SliceSender | None, BufferClient | None]:
    """This rank's started sender and its own buffer client, or none without fan-out."""
    from asyncrl.weights.senders import fanout_senders

    if fanout_senders(ctx.cfg, ctx.world) <= 1:
        return None, None
    from asyncrl.devices import resolve_device
    from asyncrl.net import broadcast_host
    from asyncrl.weights.fanout import SliceSender
    from buffers import connect_buffer

    client = connect_buffer(ctx.cfg, ctx.address, ctx.stop)
    sender = SliceSender(client, ctx.rank, host=broadcast_host(ctx.cfg, ctx.address),
                         device=resolve_device(ctx.cfg.learner.device, ctx.rank))
    sender.start()
    return sender, client
