"""Requests the ZMQ broker answers later: long polls and puts waiting for room.

The broker has one thread and never blocks, so a request that cannot be answered yet is
*parked* here with its deadline: ``get_batch`` until enough groups are queued, ``get_key``
until the key changes, ``put`` and ``put_many`` while the buffer holds ``max_groups``
(backpressure). Each kind keeps arrival order, which is what makes puts FIFO per producer and
batches first come, first served.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from buffers.zmq_protocol import Request, arg_float


@dataclass(eq=False)
class Parked:
    """A parked request: who to answer, what it waits for, until when."""

    identity: bytes
    request_id: bytes
    name: str  # consumer (get_batch), key (get_key) or producer (put)
    wanted: int  # count (get_batch) or newer_than (get_key)
    learner_version: int
    deadline: float
    since: float
    job: PutJob | None = None  # put, put_many: the groups waiting for room


@dataclass(eq=False)
class PutJob:
    """The groups of one put or put_many request, accepted in order as room appears; the
    request is answered once every group has its result. ``items`` holds each group as
    checked on arrival: a group to accept (a ``QueuedGroup``) or the reason it was rejected
    (already counted, its slot given back), so results keep the order of the request."""

    producer: str
    items: list[Any]
    single: bool  # a ``put``: answered as one result, not a list
    results: list[tuple[bool, str]] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.results) == len(self.items)

    def next_item(self) -> Any:
        return self.items[len(self.results)]


def park(request: Request, name: str, now: float, wanted: int = 0, learner_version: int = 0,
         default_timeout_s: float = 0.0) -> Parked:
    """A request's wait, until ``now + args["timeout_s"]`` (a zero timeout expires at once)."""
    timeout = max(0.0, arg_float(request.args, "timeout_s", default_timeout_s))
    return Parked(request.identity, request.request_id, name, wanted, learner_version,
                  now + timeout, now)


class Waits:
    """The parked requests of each kind, in arrival order."""

    def __init__(self) -> None:
        self.batches: list[Parked] = []
        self.keys: list[Parked] = []
        self.puts: deque[Parked] = deque()
        self.backpressure = {"waits": 0, "expired": 0, "wait_s": 0.0}  # puts, for status

    def __iter__(self) -> Iterator[Parked]:  # every parked request, any kind
        yield from (*self.batches, *self.keys, *self.puts)

    def next_deadline(self) -> float | None:
        return min((p.deadline for p in self), default=None)

    def pop_expired(self, now: float) -> tuple[list[Parked], list[Parked], list[Parked]]:
        """Remove and return the expired (batches, keys, puts)."""
        expired = [p for p in self.batches if p.deadline <= now], \
            [p for p in self.keys if p.deadline <= now], \
            [p for p in self.puts if p.deadline <= now]
        for waiting, gone in zip((self.batches, self.keys, self.puts), expired, strict=True):
            for p in gone:
                waiting.remove(p)
        self.backpressure["expired"] += len(expired[2])
        self.backpressure["wait_s"] += sum(now - p.since for p in expired[2])
        return expired

    def add_put(self, parked: Parked) -> None:
        self.puts.append(parked)
        self.backpressure["waits"] += 1

    def pop_put(self, now: float) -> Parked:
        """The oldest waiting put, now that there is room for it."""
        parked = self.puts.popleft()
        self.backpressure["wait_s"] += now - parked.since
        return parked

    def pop_key_waiters(self, key: str, seq: int) -> list[Parked]:
        """Remove and return the get_key polls that key's new sequence number answers."""
        woken = [p for p in self.keys if p.name == key and p.wanted < seq]
        for p in woken:
            self.keys.remove(p)
        return woken

    def clear(self) -> None:
        self.batches.clear()
        self.keys.clear()
        self.puts.clear()

    def counts(self) -> dict[str, int]:
        return {"get_batch": len(self.batches), "get_key": len(self.keys),
                "put": len(self.puts)}
