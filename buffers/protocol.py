"""What rollouters and learners need from a buffer, whatever carries it (ZMQ broker, Redis).

Two small protocols: :class:`Buffer` is the data plane (the gate, groups in, batches out),
:class:`ControlPlane` the rest (the published version, heartbeats, rendezvous keys, status;
defined in :mod:`asyncrl.control_plane`, since the weight sync in the core speaks to it too).
A client object implements both; it is not thread-safe, so each thread opens its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from asyncrl.control_plane import ControlPlane
from asyncrl.wire import TrajectoryGroup

RUN_STATUS_KEY = "run/status"  # the key the learner marks the run done with: {"status": ...}
RUNNING = "running"
DONE = "done"
# The ``exit`` of a rollout worker's last heartbeat when its share of data.path ran out
# (data.epochs passes), with ``shard``: [its index, the fleet's worker count]. The learner
# ends the run once every share ran out (learners.batch_feed.data_ran_out).
DATA_EXHAUSTED = "data exhausted"


@dataclass(frozen=True)
class Grant:
    """Answer to :meth:`Buffer.acquire`: how many groups may start, at which version."""

    granted: int
    version: int
    run_status: str = RUNNING


@dataclass(frozen=True)
class PutResult:
    accepted: bool
    reason: str = ""  # rejection reason when not accepted (a WireError reason, or "run")


@dataclass
class Batch:
    """Groups served to one learner consumer for one step."""

    groups: list[TrajectoryGroup]
    dropped_stale: int = 0  # stale groups dropped while serving this batch
    stats: dict[str, Any] = field(default_factory=dict)  # buffer depth, gate counters, ...
    receipts: list[str] = field(default_factory=list)  # opaque ids to ack, one per group


@runtime_checkable
class Buffer(Protocol):
    def acquire(self, producer: str, want: int, engine_version: int) -> Grant:
        """Ask the staleness gate to start up to ``want`` groups. Granted groups count as
        in flight until :meth:`put` or :meth:`release`."""

    def put(self, producer: str, group: TrajectoryGroup) -> PutResult:
        """Hand one finished group in (it leaves ``in_flight``). While the buffer holds
        ``max_groups`` the put waits (backpressure; data is never trimmed) and raises
        :class:`TimeoutError` after ``buffer.request_timeout_s``."""

    def put_many(self, producer: str, groups: Sequence[TrajectoryGroup]) -> list[PutResult]:
        """Hand several groups in: one result per group, in order, exactly as calling
        :meth:`put` for each in turn would give (FIFO, backpressure, counted rejections),
        but without a round trip per group, which is what limits a producer on loopback.

        All or error: results come back only when every group has its answer. On
        :class:`TimeoutError` (the buffer stayed full for ``request_timeout_s`` with no
        progress, or the server did not answer) the groups of the call are *in doubt*: each
        may or may not have been accepted (at most once). The caller must treat all their
        slots as used: put none of them again (a duplicate) and release none (it could free
        slots of groups that were accepted, over-filling the gate). The clean way out is the
        rollout worker's: let the error end the producer; the gate's in-flight for its
        unaccepted groups is then reaped by the heartbeat timeout, as a dead producer's is.
        """

    def release(self, producer: str, count: int) -> None:
        """Give back granted groups that will never be put (filtered, failed)."""

    def get_batch(self, consumer: str, count: int, learner_version: int,
                  timeout_s: float, ack: Batch | None = None) -> Batch | None:
        """Exactly ``count`` fresh groups, oldest first, or None after ``timeout_s``.
        Groups staler than ``max_staleness`` at ``learner_version`` are dropped and counted.
        Served groups stay pending until :meth:`ack`; a consumer that dies before acking has
        them redelivered to another consumer after ``buffer.reclaim_idle_s`` (at-least-once).

        ``ack``: a batch whose optimizer step is done, acked first exactly as :meth:`ack`
        would (also when no batch comes back), in the same round trip: a consumer that
        takes, trains and acks in turn pays one round trip per step instead of two."""

    def ack(self, consumer: str, batch: Batch, consumed: int | None = None) -> None:
        """The optimizer step that used ``batch`` is done: its groups are never redelivered.

        ``consumed``: the consumer's own count of groups consumed, this batch included (a
        learner's ``version × groups_per_step``). A ZMQ broker that lost its state (restarted
        without its spill file) takes that progress over from acks of an earlier broker's
        receipts: without it, groups the learner fetched before the restart and trained
        after it would count nowhere, and the staleness gate admit that many too many.
        Redis ignores it: its counters live in the same server as its stream."""

    def renew(self, consumer: str, batch: Batch) -> int:
        """Extend the lease on ``batch``: reset the idle time of its unacked groups, so a step
        longer than ``buffer.reclaim_idle_s`` does not see them redelivered and trained twice
        (call it every ``reclaim_idle_s / 3``; :func:`buffers.lease.keep_leased` does).
        Returns how many of them ``consumer`` still holds: fewer means the rest were already
        reclaimed by another consumer (at-least-once; their ack will count them once). A
        consumer that stops renewing (dead) loses its groups after ``reclaim_idle_s``."""


class BufferClient(Buffer, ControlPlane, Protocol):
    def close(self) -> None: ...
