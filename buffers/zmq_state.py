"""What the ZMQ broker knows and the rules it applies, with no sockets.

Kept apart from the event loop so the gate, drop, ack and membership arithmetic reads as plain
code, and so the loop only moves messages. Time comes from an injectable monotonic clock.

Delivery is at-least-once, like a Redis consumer group: a served group moves from the FIFO
``queue`` to ``pending`` (keyed by its sequence number, which its receipt names) and leaves
only when acked after the optimizer step; one not acked within ``reclaim_idle_s`` goes back to
the front of the queue. With a :class:`~buffers.zmq_spill.SpillLog` every change that must
survive a restart is journaled before the broker replies.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.config.schema import BufferConfig
from asyncrl.staleness import StalenessGate, pace_allows, pace_holds, staleness
from asyncrl.wire import Rejections, WireError, oversized
from buffers.inflight_versions import InFlightVersions
from buffers.protocol import DONE, RUN_STATUS_KEY, RUNNING
from buffers.zmq_control import GateClock, KeyStore, Members
from buffers.zmq_protocol import check_put
from buffers.zmq_queue import GroupQueue
from buffers.zmq_replay import restore, snapshot_of
from buffers.zmq_spill import ACKED, DROP, Recovered, SpillLog

logger = logging.getLogger(__name__)



class StateError(ValueError):
    """A well-formed request the rules refuse (e.g. a version going backwards)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(eq=False)
class QueuedGroup:
    """An accepted group, kept as the validated frames it arrived in (never re-encoded).

    Frames may be ``zmq.Frame`` objects: the broker forwards them without copying.
    """

    frames: list[Any]
    min_version: int
    nbytes: int
    seq: int = 0
    consumer: str = ""  # set while delivered and not acked
    producer: str = ""  # who put it (restored groups: unknown, one shared FIFO)
    delivered_staleness: int = 0
    delivered_at: float = 0.0

    def staleness(self, learner_version: int) -> int:
        return staleness(learner_version, self.min_version)


class BrokerState:
    """Queue, pending deliveries, gate counters, published version, members and keys."""

    def __init__(self, config: BufferConfig, groups_per_step: int, run_id: str = "",
                 clock: Callable[[], float] = time.monotonic, journal: SpillLog | None = None,
                 recovered: Recovered | None = None) -> None:
        self.config = config
        self.gate = StalenessGate(config.max_staleness, groups_per_step)
        self.run_id = run_id
        self.clock = clock
        self.started = clock()
        self.epoch = secrets.token_hex(4)  # in receipts: a restarted broker never mis-acks
        self.next_seq = 1
        self.queue: GroupQueue[QueuedGroup] = GroupQueue()
        self.pending: dict[int, QueuedGroup] = {}  # by seq, in delivery order
        self.held_bytes = 0
        self.version = 0
        self.run_status = RUNNING
        self.accepted = self.consumed = self.dropped_stale = 0
        self.redelivered = self.acks_unknown = 0
        self.in_flight: Counter[str] = Counter()
        self.in_flight_versions = InFlightVersions()  # what pace waits on
        self.pace_clock = GateClock()  # seconds takes were held by pace
        self.rejections = Rejections()
        self.staleness_hist: Counter[int] = Counter()
        self.members = Members(config.heartbeat_timeout_s, clock)
        self.keys = KeyStore(floor=time.time_ns() // 1_000)  # above any earlier broker's
        self.gate_clock = GateClock()
        self.journal = journal
        self.requeued: set[int] = set()  # queued seqs that may have been delivered: ackable
        self._dropped_for: Counter[str] = Counter()  # per consumer, since its last batch
        if recovered is not None:
            restore(self, recovered)
        self._journal_state()

    # --- gate and admission ----------------------------------------------------------------

    @property
    def in_flight_total(self) -> int:
        return sum(self.in_flight.values())

    @property
    def held(self) -> int:
        """Groups the broker holds: queued plus delivered-but-unacked (both bounded)."""
        return len(self.queue) + len(self.pending)

    def has_room(self) -> bool:
        return self.held < self.config.max_groups

    def answers_puts(self) -> bool:
        """A put gets its result now: there is room, or the run is over (refused, "run")."""
        return self.run_status != RUNNING or self.has_room()

    def allowance(self) -> int:
        """A group dropped as stale gives its slot back (``asyncrl.staleness``)."""
        return self.gate.allowance(self.version, self.accepted - self.dropped_stale,
                                   self.in_flight_total)

    def update_gate_clock(self) -> None:
        """Call after changes: the gate is 'closed' while running with allowance 0."""
        self.gate_clock.update(self.run_status == RUNNING and self.allowance() == 0,
                               self.clock())

    def require_member(self, producer: str) -> None:
        """Producers register first (``hello`` or a heartbeat: :class:`Members`); the broker
        refuses an acquire, put or release of an unknown name before it changes anything."""
        if not self.members.known(producer):
            raise StateError("unregistered", f"{producer!r} is not a member of this broker "
                                             "(a producer says hello or heartbeats first)")

    def acquire(self, producer: str, want: int, engine_version: int) -> int:
        self.members.touch(producer)
        if self.run_status != RUNNING or not self.gate.engine_may_start(self.version,
                                                                        engine_version):
            return 0
        room = self.config.max_groups - self.held - self.in_flight_total
        granted = max(0, min(want, self.allowance(), room))
        self.in_flight[producer] += granted
        self.in_flight_versions.grant(producer, engine_version, granted)
        return granted

    def release(self, producer: str, count: int) -> None:
        self.members.touch(producer)
        self._free_slots(producer, count)

    def _free_slots(self, producer: str, count: int, oldest: int | None = None) -> None:
        """``count`` of ``producer``'s grants are used up: by a group whose oldest version is
        ``oldest``, or (None) released or rejected (:class:`InFlightVersions`)."""
        self.in_flight[producer] = max(0, self.in_flight[producer] - count)
        if oldest is None:
            self.in_flight_versions.release(producer, count)
        else:
            self.in_flight_versions.settle(producer, oldest)
        self.in_flight_versions.keep_at_most(producer, self.in_flight[producer])

    def check(self, producer: str, payload: Sequence[Any]) -> QueuedGroup | str:
        """Validate a put (one packed group) before it may wait for room; a rejection
        (counted) returns its reason and uses up the producer's slot. Size is checked before
        anything is decoded. The caller marks the producer seen, once per request."""
        try:
            group = check_put(payload, self.config.max_message_bytes)
            if self.run_id and group.run_id and group.run_id != self.run_id:
                raise WireError("run", f"group of run {group.run_id!r}, broker is "
                                       f"{self.run_id!r}")
        except WireError as exc:
            return self.reject(producer, exc)
        return QueuedGroup(list(payload), group.min_version, group.nbytes)

    def refuse_oversized(self, producer: str, nbytes: int) -> str:
        """A group the producer's client refused to send, over ``max_message_bytes``
        (:class:`~buffers.zmq_client.ZmqBufferClient`): counted as the broker's own check
        would count it, and its slot used up."""
        return self.reject(producer, oversized(nbytes, self.config.max_message_bytes))

    def accept(self, producer: str, group: QueuedGroup) -> str:
        """Enqueue a checked group (journaled first); returns "" or the rejection reason.
        The caller marks the producer seen, once per request (not once per group)."""
        if self.run_status != RUNNING:
            return self.reject(producer, WireError("run", "the run is done"))
        if self.journal is not None:
            try:
                self.journal.put(self.next_seq, group.min_version, group.frames)
            except OSError as exc:  # disk full: refused, never "accepted" (zmq_spill)
                return self.reject(producer, WireError("spill", f"not journaled: {exc}"))
        group.seq, self.next_seq = self.next_seq, self.next_seq + 1
        self._free_slots(producer, 1, group.min_version)
        group.producer = producer
        self.queue.append(group)
        self.held_bytes += group.nbytes
        self.accepted += 1
        return ""

    def reject(self, producer: str, exc: WireError) -> str:
        self._free_slots(producer, 1)  # the slot is used up (the caller marked it seen)
        self.rejections.add(exc, producer)
        self._journal_state()
        return exc.reason

    # --- consumption ----------------------------------------------------------------------

    def take(self, consumer: str, count: int, learner_version: int) -> list[QueuedGroup] | None:
        """Drop every stale group, then deliver the ``count`` oldest if there are that many.

        Oldest by version, then by arrival (earliest deadline first: a group's deadline is
        ``min_version + max_staleness``), keeping each producer's groups in their order.
        Groups arrive in the order they finish, not the order the gate admitted them: with a
        full buffer (a learner slower than its engines), a long-tailed group admitted in the
        gate's last slots is overtaken by groups admitted one version later, and served by
        arrival it is consumed one step late, staler than s, and dropped: bench/pipeline.py
        counted 8 % of the groups at s = 4, all of them the longest answers."""
        self._drop_stale(consumer, learner_version)
        if len(self.queue) < count:
            return None
        now = self.clock()
        groups = self._pace_take(count, learner_version, now) \
            if self.config.staleness_mode == "pace" else self.queue.pop_oldest(count)
        if groups is None:
            return None
        for g in groups:
            g.consumer, g.delivered_at = consumer, now
            g.delivered_staleness = g.staleness(learner_version)
            self.pending[g.seq] = g
            self.requeued.discard(g.seq)
        self._journal_delivered(consumer, groups)
        return groups

    def _pace_take(self, count: int, learner_version: int, now: float
                   ) -> list[QueuedGroup] | None:
        """``pace``: the batch :meth:`take` serves, or None while serving would leave a group
        in flight to go stale that waiting could save (:func:`asyncrl.staleness.pace_holds`);
        that wait is timed (``pace_held_s``).

        The usual order first (each producer's groups in their order), if it leaves no group
        alive (queued or in flight) to go stale. Else the ``count`` oldest by version alone,
        whoever put them: without that, a version-0 group queued behind its own producer's
        version-1 group would be left to go stale. They are served unless waiting for the
        groups in flight could save one (the Redis twin: ``TAKE`` in
        ``buffers.redis_data_scripts``). A queue that alone holds more old groups than the
        learner can train in time is served: waiting saves none, and the groups left are
        dropped when stale, counted, as in ``drop`` mode (holding such a take was a hang)."""
        s, per_step = self.gate.max_staleness, self.gate.groups_per_step
        in_flight = self.in_flight_versions.totals()
        first = self.queue.oldest(count)
        if pace_allows(learner_version, s, per_step, self._queued_without(first) + in_flight):
            chosen: list[QueuedGroup] | None = first
        else:
            oldest = self.queue.oldest_by_version(count)
            held = pace_holds(learner_version, s, per_step, self._queued_without(oldest),
                              in_flight)
            chosen = None if held else oldest
        self.pace_clock.update(chosen is None, now)
        if chosen is None:
            return None
        return [self.queue.remove(g.seq) for g in chosen]  # type: ignore[misc]

    def _queued_without(self, batch: Sequence[QueuedGroup]) -> Counter[int]:
        """Queued groups by oldest version, but for ``batch``."""
        left = self.queue.version_counts()
        left.subtract(g.min_version for g in batch)
        return left

    def _drop_stale(self, consumer: str, learner_version: int) -> None:
        stale = self.queue.drop_below(self.gate.stale_below(learner_version))
        if not stale:
            return
        self._forget(stale)
        self.dropped_stale += len(stale)
        self._dropped_for[consumer] += len(stale)
        logger.warning("dropped %d groups staler than %d at learner version %d",
                       len(stale), self.gate.max_staleness, learner_version)
        self._journal_removed(DROP, [(g.seq, g.staleness(learner_version)) for g in stale])

    def pop_dropped(self, consumer: str) -> int:
        return self._dropped_for.pop(consumer, 0)

    def receipt(self, group: QueuedGroup) -> str:
        return f"{self.epoch}:{group.seq}"

    def ack(self, consumer: str, receipts: Sequence[str], consumed: int | None = None) -> int:
        """Settle delivered groups (idempotent: unknown receipts are only counted).

        Receipts of another epoch were delivered by a broker that this one replaced without
        its spill file: their groups were accepted and served there and count nowhere here.
        With the consumer's own ``consumed`` count (the learner's ``version ×
        groups_per_step``) this broker takes that progress over, as a resume would. Without
        it, the groups a learner had prefetched from the old broker and trained on after
        the restart were missing from the gate's count for the rest of the run: it admitted
        one or two steps too many, and the quickstart dropped ~1,600 stale groups."""
        self.members.touch(consumer, "learner")
        done = [g for g in map(self._settle, receipts) if g is not None]
        self.acks_unknown += len(receipts) - len(done)
        self._forget(done)
        self.consumed += len(done)
        self.staleness_hist.update(g.delivered_staleness for g in done)
        self._journal_removed(ACKED, [(g.seq, g.delivered_staleness) for g in done])
        if consumed is not None and any(map(self._foreign, receipts)):
            self.restore_progress(self.version, consumed)
        return len(done)

    def renew(self, consumer: str, receipts: Sequence[str]) -> int:
        """Reset the idle time of the deliveries ``consumer`` still holds; returns how many.
        A renewed group moves to the end of ``pending``, which so stays in ``delivered_at``
        order (what lets :meth:`reclaim` stop at the first recent one). Not journaled: a
        restart replays every delivery as just made."""
        self.members.touch(consumer, "learner")
        now, held = self.clock(), 0
        for seq in filter(None, map(self._seq_of, receipts)):
            group = self.pending.get(seq)
            if group is not None and group.consumer == consumer:
                del self.pending[seq]
                group.delivered_at = now
                self.pending[seq] = group
                held += 1
        return held

    def _foreign(self, receipt: str) -> bool:
        """A well-formed receipt of another broker epoch (see :meth:`ack`)."""
        parsed = _parse_receipt(receipt)
        return parsed is not None and parsed[0] != self.epoch

    def _seq_of(self, receipt: str) -> int | None:
        parsed = _parse_receipt(receipt)
        return parsed[1] if parsed is not None and parsed[0] == self.epoch else None

    def _settle(self, receipt: str) -> QueuedGroup | None:
        seq = self._seq_of(receipt)
        if seq is None:
            return None
        group = self.pending.pop(seq, None)
        if group is None and seq in self.requeued:  # its first consumer was slow, not dead
            self.requeued.discard(seq)
            group = self.queue.remove(seq)
        return group

    def _forget(self, groups: Sequence[QueuedGroup]) -> None:
        for g in groups:
            self.held_bytes -= g.nbytes
            self.requeued.discard(g.seq)

    def reclaim(self) -> int:
        """Requeue, oldest first at the front, deliveries not acked within reclaim_idle_s."""
        deadline = self.clock() - self.config.reclaim_idle_s
        expired = []
        for group in self.pending.values():  # delivery order: stop at the first recent one
            if group.delivered_at > deadline:
                break
            expired.append(group)
        if not expired:
            return 0
        for group in expired:
            del self.pending[group.seq]
            self.requeued.add(group.seq)
        self.queue.extend_front(sorted(expired, key=lambda g: g.seq))
        self.redelivered += len(expired)
        self._journal_delivered("", expired)
        logger.warning("%d groups delivered to %s not acked within %.1fs: requeued",
                       len(expired), sorted({g.consumer for g in expired}),
                       self.config.reclaim_idle_s)
        self._journal_state()
        return len(expired)

    # --- control plane --------------------------------------------------------------------

    def publish_version(self, version: int) -> None:
        """The learner's new version. A broker with no progress at all (version 0, nothing
        consumed) told of a version past the first step was restarted without its spill file
        while the learner trained: it takes those steps over as a resume would
        (:meth:`restore_progress` with ``version × groups_per_step`` consumed). Without that,
        its gate counted only what it had accepted itself and admitted ``version ×
        groups_per_step`` groups too many for the rest of the run: stale groups dropped give
        their slots back, so rollouts kept generating ahead and the quickstart, its broker
        SIGKILLed at step 20, dropped 4,000 groups. (In a run that was not interrupted the
        first step's groups are acked before version 2 exists.) The batches the learner held
        from the old broker are taken over when it acks them (:meth:`ack`); an ack that came
        first has taken the steps over already, and this seed then does nothing."""
        if version < self.version:
            raise StateError("version", f"version {version} is behind {self.version}")
        if self.version == 0 and self.consumed == 0 and version > 1:
            logger.warning("told of version %d with no progress of its own: this broker lost "
                           "the run's state (restarted without buffer.zmq.spill_path?); taking "
                           "over %d steps", version, version)
            self.restore_progress(version, version * self.gate.groups_per_step)
        if version != self.version:
            self.version = version
            self._journal_state()

    def restore_progress(self, version: int, consumed: int) -> int:
        """A learner resumed at ``version`` after ``consumed`` groups (see the protocol): a
        broker that has consumed fewer (it did not live through those steps) takes them over.
        Idempotent; returns the version."""
        deficit = consumed - self.consumed
        if deficit > 0:
            self.accepted += deficit
            self.consumed += deficit
            self.version = max(self.version, version)
            logger.info("took the learner's progress over: version %d, %d groups consumed",
                        self.version, self.consumed)
            self._journal_state()
        return self.version

    def set_key(self, key: str, value: dict[str, Any]) -> int:
        if key == RUN_STATUS_KEY:
            status = value.get("status")
            if status not in (RUNNING, DONE):
                raise StateError("run_status", f"unknown run status {status!r}")
            if status != self.run_status:
                logger.info("run status %s -> %s", self.run_status, status)
            self.run_status = status
        seq = self.keys.set(key, value)
        if self.journal is not None:
            self.journal.key(key, seq, value)
        if key == RUN_STATUS_KEY:
            self._journal_state()
        return seq

    def reap(self) -> None:
        self.members.reap(self.in_flight)
        for producer in self.in_flight_versions.producers():
            self.in_flight_versions.keep_at_most(producer, self.in_flight.get(producer, 0))

    # --- durability -----------------------------------------------------------------------

    def _journal_state(self) -> None:
        if self.journal is not None:
            self.journal.state(snapshot_of(self))

    def _journal_delivered(self, consumer: str, groups: Sequence[QueuedGroup]) -> None:
        """Who holds which groups ("" = back in the queue), so a restart awaits their acks."""
        if self.journal is not None:
            self.journal.delivered(consumer, [(g.seq, g.delivered_staleness) for g in groups])

    def _journal_removed(self, kind: int, items: list[tuple[int, int]]) -> None:
        if self.journal is None or not items:
            return
        self.journal.removed(kind, items)
        if self.journal.needs_compaction():
            live = [*self.queue, *self.pending.values()]
            keys = [(k, *v) for k, v in self.keys.values.items()]
            held: dict[str, list[tuple[int, int]]] = {}
            for g in self.pending.values():
                held.setdefault(g.consumer, []).append((g.seq, g.delivered_staleness))
            self.journal.compact(snapshot_of(self), keys,
                                 [(g.seq, g.min_version, g.frames) for g in live], held.items())


def _parse_receipt(receipt: Any) -> tuple[str, int] | None:
    """``(epoch, seq)`` of a receipt (``"<epoch>:<seq>"``, see :meth:`BrokerState.receipt`);
    None for anything else (receipts come from clients)."""
    epoch, sep, seq_text = receipt.partition(":") if isinstance(receipt, str) else ("", "", "")
    well_formed = sep and seq_text.isascii() and seq_text.isdigit()  # int("²") raises
    return (epoch, int(seq_text)) if well_formed else None
