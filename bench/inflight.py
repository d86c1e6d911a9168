"""The buffer benchmark's consumer and producer with several requests in flight.

Why they exist: ``bench/buffer_throughput.py`` measures what a buffer backend can move, and
a consumer that asks for a batch, waits, and asks again (or a producer that puts, waits for
the answer and puts again) leaves the buffer idle for a round trip per request. On a host
with idle cores that round trip, not the buffer's CPU, bounds small groups
(bench/RESULTS.md, "Buffer throughput": ``--take-depth`` and ``--put-depth``).

Why they live here and not in ``buffers/``: no role of the product uses them. The learner
overlaps its one ``get_batch`` with the step on a thread (``learners/prefetch.py``), and a
rollout worker puts once per engine batch, after seconds of generation, where the ~1 ms the
answer takes is nothing and its data position is simplest saved right after its put. What
they rely on is product code, held by the buffer tests: the ZMQ client's
``send_get_batch``/``receive_batch`` and ``send_put_many``/``receive_puts``, and a broker that
serves one consumer's requests in the order they were sent.

:class:`TakeAhead` keeps ``depth`` batch requests in flight for one consumer. Staleness stays
exact: the request sent ``k`` steps ahead of version ``V`` names ``V + k``, the version its
batch will be trained at, so the buffer drops what it would have dropped had it been asked
then. The broker serves one consumer's requests in order, so a request for a later version
never drops groups an earlier one will take. What is traded: a batch served ahead is chosen
from the groups there at the time, not from those that arrive before its step; and it is
leased from then, so ``depth`` steps must fit in ``buffer.reclaim_idle_s``.

:class:`PutAhead` keeps ``depth`` ``put_many`` calls in flight for one producer. What is kept:
FIFO per producer (a client's calls reach the broker in the order sent, and it takes one
producer's requests in that order), backpressure (the client bounds the requests in flight
over all calls, so a full buffer still stops the producer) and the rule on lost answers (puts
are never re-sent; a call whose answer is lost is in doubt, as a put that timed out, see
:class:`buffers.protocol.Buffer`). What is traded: results come ``depth - 1`` calls late, so a
producer that records progress once its groups are handed over must record it when the
results come, not when it sends.

Backends that cannot send a request without waiting for it (Redis: one blocking command per
connection) get one request at a time, with the same calls.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from asyncrl.wire import TrajectoryGroup
from buffers.protocol import Batch, Buffer, PutResult

logger = logging.getLogger(__name__)


@runtime_checkable
class SendsAhead(Protocol):
    """A client that can send a batch request and receive its answer later
    (:class:`buffers.zmq_client.ZmqBufferClient`)."""

    def send_get_batch(self, consumer: str, count: int, learner_version: int,
                       timeout_s: float, ack: Batch | None = None) -> Any: ...

    def receive_batch(self, pending: Any) -> Batch | None: ...

    def forget_batch(self, pending: Any) -> None: ...


class TakeAhead:
    """``take(V)`` returns the batch to train at version ``V``, with the requests for
    ``V + 1 .. V + depth - 1`` already sent; versions must be asked for in order (the same one
    again after a ``None``).

    ``ack``, the batch whose step is done, rides on the first request sent (or goes alone).
    A request that comes back empty (no ``count`` fresh groups within ``timeout_s``) ends the
    run of requests: the ones behind it are received (they waited as long) and their batches
    kept for their versions, so every request is again sent in version order. Batches served
    ahead and never taken (the consumer stops) are never acked: redelivered after
    ``reclaim_idle_s``, as a dead consumer's are.

    Not thread-safe, as the client it uses.
    """

    def __init__(self, client: Buffer, consumer: str, count: int, depth: int,
                 timeout_s: float) -> None:
        if depth < 1:
            raise ValueError(f"depth {depth} must be >= 1")
        self._client, self._consumer, self._count = client, consumer, count
        self._timeout_s = timeout_s
        # checked once: isinstance against a runtime Protocol looks up every member
        self._sender = client if isinstance(client, SendsAhead) else None
        self.depth = depth if self._sender is not None else 1
        self._flight: deque[tuple[int, Any]] = deque()  # (version, pending), in send order
        self._ready: dict[int, Batch] = {}  # served ahead, received: by version

    @property
    def in_flight(self) -> int:
        return len(self._flight)

    def take(self, version: int, ack: Batch | None = None) -> Batch | None:
        """The batch for ``version``, or None if none came within ``timeout_s``."""
        sender = self._sender
        if sender is None:
            return self._client.get_batch(self._consumer, self._count, version,
                                          self._timeout_s, ack)
        if self._flight and self._flight[0][0] != version and (
                version not in self._ready or self._flight[0][0] < version):
            raise ValueError(f"take({version}): requests are in flight for versions "
                             f"{self._flight[0][0]}..{self._flight[-1][0]}; versions must be "
                             "taken in order")
        skipped = [v for v in self._ready if v < version]
        if skipped:  # not acked: redelivered after reclaim_idle_s, as a dead consumer's
            logger.warning("batches served ahead for versions %s were never taken (now at "
                           "version %d)", skipped, version)
            for v in skipped:
                del self._ready[v]
        ack = self._send_up_to(sender, version, ack)
        if ack is not None:
            self._client.ack(self._consumer, ack)
        if version in self._ready:
            return self._ready.pop(version)
        _, pending = self._flight.popleft()
        try:
            batch = sender.receive_batch(pending)
            if batch is None:
                self._drain(sender)
        except BaseException:
            # the requests still in flight are given up (the caller decides whether to go
            # on); batches served to them come back after reclaim_idle_s
            while self._flight:
                sender.forget_batch(self._flight.popleft()[1])
            raise
        return batch

    def _send_up_to(self, sender: SendsAhead, version: int,
                    ack: Batch | None) -> Batch | None:
        """Send the requests for ``version .. version + depth - 1`` that are neither in flight
        nor received, in version order; returns ``ack`` if no request carried it."""
        newest = self._flight[-1][0] if self._flight else version - 1
        for wanted in range(version, version + self.depth):
            if wanted <= newest or wanted in self._ready:
                continue
            pending = sender.send_get_batch(self._consumer, self._count, wanted,
                                            self._timeout_s, ack)
            self._flight.append((wanted, pending))
            ack = None
        return ack

    def _drain(self, sender: SendsAhead) -> None:
        """Receive every request still in flight and keep the batches they bring."""
        while self._flight:
            wanted, pending = self._flight[0]
            batch = sender.receive_batch(pending)
            self._flight.popleft()
            if batch is not None:
                self._ready[wanted] = batch


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
