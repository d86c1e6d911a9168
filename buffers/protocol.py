"""What rollouters and learners need from a buffer, whatever carries it (ZMQ broker, Redis).

Two small protocols: :class:`Buffer` is the data plane (the gate, groups in, batches out),
:class:`ControlPlane` the rest (the published version, heartbeats, rendezvous keys, status).
A client object implements both; it is not thread-safe, so each thread opens its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from asyncrl.wire import TrajectoryGroup

RUN_STATUS_KEY = "run/status"  # the key the learner marks the run done with: {"status": ...}
RUNNING = "running"
DONE = "done"
STOPPED = "stopped"  # the ``state`` in a member's last heartbeat: it will not come back
# The ``exit`` of a rollout worker's last heartbeat when its share of data.path ran out
# (data.epochs passes), with ``shard``: [its index, the fleet's worker count]. The learner
# ends the run once every share ran out (learners.loop.data_ran_out).
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


@runtime_checkable
class ControlPlane(Protocol):
    def publish_version(self, version: int) -> None:
        """Publish the learner version (after its weights reached the engines). A buffer with
        no progress at all (version 0, nothing consumed) told of a version ``v`` > 1 lost its
        state while the learner trained: it takes the steps over as
        ``restore_progress(v, v × groups_per_step)`` would, so its gate stays right."""

    def restore_progress(self, version: int, consumed: int) -> int:
        """A learner resumed from a checkpoint of ``version``, taken after ``consumed`` groups
        were consumed. A buffer that has consumed fewer did not live through those steps (a
        broker restarted without spill, a reset Redis namespace): it takes them over, so its
        version becomes at least ``version`` and ``accepted`` and ``consumed`` grow by the
        difference; the gate then admits what it would have had it lived through them (no
        flood of ``version × groups_per_step`` groups, no version going back). A buffer that
        did is unchanged. Idempotent. Returns the buffer's version."""

    def heartbeat(self, member: str, role: str, info: dict[str, Any]) -> dict[str, Any]:
        """Say ``member`` is alive; ``info`` carries its metrics. Returns the run state
        (``version``, ``run_status``)."""

    def set_key(self, key: str, value: dict[str, Any]) -> int:
        """Store a small JSON value (rendezvous, announcements); returns its sequence number:
        above every number the key had before, also from a buffer that lost it (restarted
        without its spill file, or a Redis without persistence), so that a waiter's
        ``newer_than`` never outlives the buffer it came from."""

    def get_key(self, key: str, newer_than: int = 0,
                timeout_s: float = 0.0) -> tuple[int, dict[str, Any]] | None:
        """The value with a sequence number above ``newer_than``, waiting up to ``timeout_s``."""

    def get_keys(self, keys: Sequence[str]) -> dict[str, tuple[int, dict[str, Any]]]:
        """The current ``(seq, value)`` of each of ``keys`` that is set, in ONE round trip,
        without waiting: a rendezvous over many members (joins, acks) reads them all at once
        instead of one request per member."""

    def status(self) -> dict[str, Any]:
        """Everything the monitor shows, as one JSON-able dict."""


class BufferClient(Buffer, ControlPlane, Protocol):
    def close(self) -> None: ...
