"""Control-plane bookkeeping of the ZMQ broker: members and their liveness, keys, gate clock,
and the status report.

Separate from :mod:`buffers.zmq_state` (the data plane: queue, deliveries, acks) because none of
it touches a trajectory group; it is small arithmetic on an injectable monotonic clock.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from buffers.protocol import RUNNING

if TYPE_CHECKING:
    from buffers.zmq_state import BrokerState

logger = logging.getLogger(__name__)


@dataclass
class Member:
    role: str
    last_seen: float
    info: dict[str, Any] = field(default_factory=dict)
    alive: bool = True


class Members:
    """Who was seen when; a member silent past ``timeout_s`` is dead until seen again.

    A name becomes a member only through the handshake (:meth:`register`: a ``hello`` or a
    heartbeat); any other request (a put, an ack) only marks a member seen. A put from any
    process that reached the port created a member of its producer name before, so garbage
    puts filled the status with phantom producers."""

    def __init__(self, timeout_s: float, clock: Callable[[], float]) -> None:
        self.timeout_s = timeout_s
        self.clock = clock
        self.by_name: dict[str, Member] = {}

    def known(self, name: str) -> bool:
        return name in self.by_name

    def register(self, name: str, role: str = "") -> None:
        """The handshake: ``name`` is a member (of ``role``, else "producer"), seen now."""
        if name not in self.by_name:
            self.by_name[name] = Member(role=role or "producer", last_seen=0.0)
        self.touch(name, role)

    def touch(self, name: str, role: str = "") -> None:
        """A member was seen now (any heartbeat, acquire, put, release or ack); a name that
        never registered stays unknown."""
        entry = self.by_name.get(name)
        if entry is None:
            return
        if role:
            entry.role = role
        if not entry.alive:
            logger.info("member %s is back", name)
        entry.last_seen = self.clock()
        entry.alive = True

    def heartbeat(self, name: str, role: str, info: dict[str, Any]) -> None:
        self.register(name, role)
        self.by_name[name].info = info

    def reap(self, in_flight: Counter[str]) -> None:
        """Mark silent members dead and give back their in-flight groups."""
        now = self.clock()
        for name, entry in self.by_name.items():
            if entry.alive and now - entry.last_seen > self.timeout_s:
                entry.alive = False
                released = in_flight.pop(name, 0)
                logger.warning("member %s (%s) silent for %.1fs: dead, released %d in flight",
                               name, entry.role, now - entry.last_seen, released)

    def status(self, in_flight: Counter[str]) -> dict[str, Any]:
        now = self.clock()
        return {name: {"role": m.role, "alive": m.alive, "last_seen_s_ago": now - m.last_seen,
                       "in_flight": in_flight.get(name, 0), "info": m.info}
                for name, m in self.by_name.items()}


class GateClock:
    """Wall seconds the gate spent closed, accumulated on open/closed transitions."""

    def __init__(self) -> None:
        self._closed_since: float | None = None
        self._total = 0.0

    def update(self, closed: bool, now: float) -> None:
        if closed and self._closed_since is None:
            self._closed_since = now
        elif not closed and self._closed_since is not None:
            self._total += now - self._closed_since
            self._closed_since = None

    def seconds(self, now: float) -> float:
        ongoing = now - self._closed_since if self._closed_since is not None else 0.0
        return self._total + ongoing


class KeyStore:
    """Small JSON values with per-key sequence numbers that only go up, also from one broker
    to the next.

    Why across brokers: clients wait for news with ``get_key(key, newer_than=seq)``. A broker
    restarted without a spill file has lost its keys; had it counted from 1 again, a rollout
    worker waiting for weight announcements newer than the 36th would have waited forever
    while the learner announced the 1st, 2nd, ... (the run stalled for good). So a key's first
    number is above ``floor``, which the broker takes from the wall clock in microseconds:
    above every number an earlier broker issued (one set per microsecond of its life at
    most), unless the clock stepped back by more than the time between the two brokers.
    """

    def __init__(self, floor: int = 0) -> None:
        self.values: dict[str, tuple[int, dict[str, Any]]] = {}
        self.floor = floor

    def set(self, key: str, value: dict[str, Any]) -> int:
        seq = max(self.values.get(key, (0, {}))[0], self.floor) + 1
        self.values[key] = (seq, value)
        return seq

    def get(self, key: str, newer_than: int = 0) -> tuple[int, dict[str, Any]] | None:
        entry = self.values.get(key)
        return entry if entry is not None and entry[0] > newer_than else None

    def lookup(self, key: str, newer_than: int = 0) -> dict[str, Any]:
        """The get_key reply body."""
        entry = self.get(key, newer_than)
        if entry is None:
            return {"found": False}
        return {"found": True, "seq": entry[0], "value": entry[1]}

    def names(self) -> list[str]:
        return sorted(self.values)


def batch_stats(state: BrokerState) -> dict[str, Any]:
    """What every batch reply carries (cheap: no per-member or per-key work)."""
    return {"depth": state.held, "queued": len(state.queue), "pending": len(state.pending),
            "accepted": state.accepted, "in_flight": state.in_flight_total,
            "consumed": state.consumed, "dropped_stale": state.dropped_stale,
            "redelivered": state.redelivered, "version": state.version,
            "run_status": state.run_status,
            "pace_held_s": state.pace_clock.seconds(state.clock())}



def status_of(state: BrokerState) -> dict[str, Any]:
    """Everything the monitor shows about the broker state, JSON-able."""
    now = state.clock()
    allowance = state.allowance()
    spill = None if state.journal is None else {
        "path": str(state.journal.path), "bytes": state.journal.file_bytes,
        "live_bytes": state.journal.live_bytes, "compactions": state.journal.compactions,
        "write_errors": state.journal.write_errors}
    return {**batch_stats(state),
            "run_id": state.run_id, "max_staleness": state.gate.max_staleness,
            "staleness_mode": state.config.staleness_mode,
            "groups_per_step": state.gate.groups_per_step,
            "max_groups": state.config.max_groups, "held_bytes": state.held_bytes,
            "acks_unknown": state.acks_unknown, "rejected": dict(state.rejections.counts),
            "gate_open": state.run_status == RUNNING and allowance > 0,
            "gate_allowance": allowance, "gate_closed_s": state.gate_clock.seconds(now),
            "staleness_hist": {str(k): n for k, n in sorted(state.staleness_hist.items())},
            "members": state.members.status(state.in_flight), "spill": spill,
            "uptime_s": now - state.started, "keys": state.keys.names()}
