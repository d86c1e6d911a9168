"""What the ZMQ broker knows and the rules it applies, with no sockets.

Kept apart from the event loop so the gate, drop and membership arithmetic reads as plain
code, and so the loop only moves messages. Time comes from an injectable monotonic clock.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncrl.config.schema import BufferConfig
from asyncrl.staleness import StalenessGate
from asyncrl.wire import Rejections, WireError, decode_group
from buffers.protocol import DONE, RUNNING

logger = logging.getLogger(__name__)

RUN_STATUS_KEY = "run/status"


class StateError(ValueError):
    """A well-formed request the rules refuse (e.g. a version going backwards)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass
class QueuedGroup:
    """An accepted group, kept as the validated frames it arrived in (never re-encoded)."""

    frames: list[bytes]
    min_version: int

    def staleness(self, learner_version: int) -> int:
        return learner_version - self.min_version if self.min_version >= 0 else 0


@dataclass
class Member:
    role: str
    last_seen: float
    info: dict[str, Any] = field(default_factory=dict)
    alive: bool = True


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
    """Small JSON values with per-key sequence numbers that only go up."""

    def __init__(self) -> None:
        self._values: dict[str, tuple[int, dict[str, Any]]] = {}

    def set(self, key: str, value: dict[str, Any]) -> int:
        seq = self._values.get(key, (0, {}))[0] + 1
        self._values[key] = (seq, value)
        return seq

    def get(self, key: str, newer_than: int = 0) -> tuple[int, dict[str, Any]] | None:
        entry = self._values.get(key)
        return entry if entry is not None and entry[0] > newer_than else None

    def names(self) -> list[str]:
        return sorted(self._values)


class BrokerState:
    """Queue, gate counters, published version, members and keys of one run."""

    def __init__(self, config: BufferConfig, groups_per_step: int, run_id: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.gate = StalenessGate(config.max_staleness, groups_per_step)
        self.run_id = run_id
        self.clock = clock
        self.started = clock()
        self.queue: deque[QueuedGroup] = deque()
        self.version = 0
        self.run_status = RUNNING
        self.accepted = 0
        self.consumed = 0
        self.dropped_stale = 0
        self.in_flight: Counter[str] = Counter()
        self.rejections = Rejections()
        self.staleness_hist: Counter[int] = Counter()
        self.members: dict[str, Member] = {}
        self.keys = KeyStore()
        self.gate_clock = GateClock()
        self._dropped_for: Counter[str] = Counter()  # per consumer, since its last batch

    # --- gate ---------------------------------------------------------------------------

    @property
    def in_flight_total(self) -> int:
        return sum(self.in_flight.values())

    def allowance(self) -> int:
        return self.gate.allowance(self.version, self.accepted, self.in_flight_total)

    def update_gate_clock(self) -> None:
        """Call after every change: the gate is 'closed' while running with allowance 0."""
        self.gate_clock.update(self.run_status == RUNNING and self.allowance() == 0,
                               self.clock())

    def acquire(self, producer: str, want: int, engine_version: int) -> int:
        self.touch(producer)
        if self.run_status != RUNNING or not self.gate.engine_may_start(self.version,
                                                                        engine_version):
            return 0
        room = self.config.max_groups - len(self.queue) - self.in_flight_total
        granted = max(0, min(want, self.allowance(), room))
        self.in_flight[producer] += granted
        return granted

    def release(self, producer: str, count: int) -> None:
        self.touch(producer)
        self.in_flight[producer] = max(0, self.in_flight[producer] - count)

    def put(self, producer: str, frames: Sequence[bytes]) -> str:
        """Validate and enqueue one group; returns "" or the rejection reason (counted)."""
        self.release(producer, 1)  # the slot is used up, accepted or not
        try:
            group = decode_group(frames)
            self._check_run(group.run_id)
        except WireError as exc:
            self.rejections.add(exc, producer)
            return exc.reason
        self.queue.append(QueuedGroup([bytes(f) for f in frames], group.min_version()))
        self.accepted += 1
        return ""

    def _check_run(self, group_run_id: str) -> None:
        if self.run_status != RUNNING:
            raise WireError("run", "the run is done")
        if self.run_id and group_run_id and group_run_id != self.run_id:
            raise WireError("run", f"group of run {group_run_id!r}, broker is {self.run_id!r}")
        if len(self.queue) >= self.config.max_groups:
            raise WireError("full", f"buffer holds max_groups={self.config.max_groups}")

    # --- consumption ----------------------------------------------------------------------

    def take(self, consumer: str, count: int, learner_version: int) -> list[QueuedGroup] | None:
        """Drop every stale group, then pop the ``count`` oldest if there are that many."""
        fresh = deque(g for g in self.queue
                      if g.staleness(learner_version) <= self.gate.max_staleness)
        dropped = len(self.queue) - len(fresh)
        if dropped:
            self.queue = fresh
            self.dropped_stale += dropped
            self._dropped_for[consumer] += dropped
            logger.warning("dropped %d groups staler than %d at learner version %d",
                           dropped, self.gate.max_staleness, learner_version)
        if len(self.queue) < count:
            return None
        groups = [self.queue.popleft() for _ in range(count)]
        self.consumed += count
        self.staleness_hist.update(g.staleness(learner_version) for g in groups)
        return groups

    def pop_dropped(self, consumer: str) -> int:
        return self._dropped_for.pop(consumer, 0)

    # --- control plane --------------------------------------------------------------------

    def publish_version(self, version: int) -> None:
        if version < self.version:
            raise StateError("version", f"version {version} is behind {self.version}")
        self.version = version

    def set_key(self, key: str, value: dict[str, Any]) -> int:
        if key == RUN_STATUS_KEY:
            status = value.get("status")
            if status not in (RUNNING, DONE):
                raise StateError("run_status", f"unknown run status {status!r}")
            if status != self.run_status:
                logger.info("run status %s -> %s", self.run_status, status)
            self.run_status = status
        return self.keys.set(key, value)

    def heartbeat(self, member: str, role: str, info: dict[str, Any]) -> None:
        self.touch(member, role)
        self.members[member].info = info

    def touch(self, member: str, role: str = "") -> None:
        """``member`` was seen now (any heartbeat, acquire, put or release)."""
        entry = self.members.get(member)
        if entry is None:
            entry = self.members[member] = Member(role=role or "producer", last_seen=0.0)
        elif role:
            entry.role = role
        if not entry.alive:
            logger.info("member %s is back", member)
        entry.last_seen = self.clock()
        entry.alive = True

    def reap(self) -> None:
        """Mark silent members dead and give back their in-flight groups."""
        now = self.clock()
        for name, entry in self.members.items():
            if entry.alive and now - entry.last_seen > self.config.heartbeat_timeout_s:
                entry.alive = False
                released = self.in_flight.pop(name, 0)
                logger.warning("member %s (%s) silent for %.1fs: dead, released %d in flight",
                               name, entry.role, now - entry.last_seen, released)

    def batch_stats(self) -> dict[str, Any]:
        return {"depth": len(self.queue), "accepted": self.accepted,
                "in_flight": self.in_flight_total, "consumed": self.consumed,
                "dropped_stale": self.dropped_stale, "version": self.version,
                "run_status": self.run_status}

    def status(self) -> dict[str, Any]:
        now = self.clock()
        allowance = self.allowance()
        members = {name: {"role": m.role, "alive": m.alive, "last_seen_s_ago": now - m.last_seen,
                          "in_flight": self.in_flight.get(name, 0), "info": m.info}
                   for name, m in self.members.items()}
        return {**self.batch_stats(),
                "run_id": self.run_id, "max_staleness": self.gate.max_staleness,
                "groups_per_step": self.gate.groups_per_step,
                "max_groups": self.config.max_groups,
                "rejected": dict(self.rejections.counts),
                "gate_open": self.run_status == RUNNING and allowance > 0,
                "gate_allowance": allowance, "gate_closed_s": self.gate_clock.seconds(now),
                "staleness_hist": {str(k): n for k, n in sorted(self.staleness_hist.items())},
                "members": members, "uptime_s": now - self.started, "keys": self.keys.names()}
