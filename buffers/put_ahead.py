"""A producer that keeps several ``put_many`` calls in flight.

Why: a producer that puts, waits for the answer, packs the next groups and puts again leaves
itself idle for a round trip per call, and the buffer idle while it packs. Where groups come
faster than that (one process forwarding many engines' groups, small groups), the round trip
is the bound: bench/RESULTS.md measured one ZMQ producer of 1k-token groups at 0.27-0.32 of
the raw transport on 16 cores, waiting for each answer.

What is kept: FIFO per producer (a client's calls reach the broker in the order sent, and it
takes one producer's requests in that order), backpressure (the client bounds the requests in
flight over all calls, so a full buffer still stops the producer) and the rule on lost
answers (puts are never re-sent; a call whose answer is lost is in doubt, as a put that timed
out, see :class:`buffers.protocol.Buffer`). What is traded: results come ``depth - 1`` calls late,
so a producer that records progress once its groups are handed over (the rollout worker saves
its data position) must record it when the results come, not when it sends.

The rollout worker does not use it: it puts once per engine batch, after seconds of
generation, where the ~1 ms the answer takes is nothing and the data position is simplest
saved right after its put. Backends that cannot send without waiting (Redis: one blocking
command per connection) get one call at a time, with the same calls.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from asyncrl.wire import TrajectoryGroup
from buffers.protocol import Buffer, PutResult


@runtime_checkable
class SendsPuts(Protocol):
    """A client that can send a ``put_many`` and receive its results later
    (:class:`buffers.zmq_client.ZmqBufferClient`)."""

    def send_put_many(self, producer: str, groups: Sequence[TrajectoryGroup]) -> Any: ...

    def receive_puts(self, pending: Any) -> list[PutResult]: ...

    def forget_puts(self, pending: Any) -> None: ...


class PutAhead:
    """``put_many(groups)`` sends the groups and returns the results of the calls settled
    meanwhile (oldest first, one per group, in order), leaving at most ``depth - 1`` calls in
    flight; ``flush()`` waits for all of them. With ``depth`` 1 each call returns its own
    results, as the client's ``put_many`` does.

    A call that fails (no room within the timeout, no answer) raises from the ``put_many`` or
    ``flush`` that waits for it, and the calls behind it are given up with it: all their
    groups are in doubt (see :class:`buffers.protocol.Buffer`); the caller ends the producer,
    as a rollout worker does on a failed put. Not thread-safe, as the client it uses.
    """

    def __init__(self, client: Buffer, producer: str, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"depth {depth} must be >= 1")
        self._client, self._producer = client, producer
        # checked once: isinstance against a runtime Protocol looks up every member
        self._sender = client if isinstance(client, SendsPuts) else None
        self.depth = depth if self._sender is not None else 1
        self._flight: deque[Any] = deque()

    @property
    def in_flight(self) -> int:
        """Calls sent whose results were not returned yet."""
        return len(self._flight)

    def put_many(self, groups: Sequence[TrajectoryGroup]) -> list[PutResult]:
        """Send ``groups``; the results of the calls this had to wait for (possibly none)."""
        sender = self._sender
        if sender is None:
            return self._client.put_many(self._producer, groups)
        try:
            self._flight.append(sender.send_put_many(self._producer, groups))
        except BaseException:
            self._give_up(sender)
            raise
        return self._settle(sender, self.depth - 1)

    def flush(self) -> list[PutResult]:
        """Wait for every call in flight: their results, oldest first."""
        return self._settle(self._sender, 0) if self._sender is not None else []

    def _settle(self, sender: SendsPuts, leave: int) -> list[PutResult]:
        results: list[PutResult] = []
        try:
            while len(self._flight) > leave:
                results += sender.receive_puts(self._flight[0])
                self._flight.popleft()
        except BaseException:
            self._give_up(sender)
            raise
        return results

    def _give_up(self, sender: SendsPuts) -> None:
        """Every call in flight, given up with a failed one: in doubt."""
        while self._flight:
            sender.forget_puts(self._flight.popleft())
