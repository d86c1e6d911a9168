"""Client of the embedded ZMQ broker: :class:`~buffers.protocol.BufferClient` over one DEALER.

Not thread-safe, by design (ZMQ sockets are not): open one client per thread. Every request
waits for its reply; a request that times out raises :class:`TimeoutError` and the socket is
replaced, so a late reply can never be mistaken for the answer to a later request (request
ids guard the same thing on a live socket).

Delivery is at-least-once: every :class:`~buffers.protocol.Batch` carries receipts, and
:meth:`ZmqBufferClient.ack` after the optimizer step settles them (or the next ``get_batch``
carries them: one round trip for both); unacked groups come back after
``buffer.reclaim_idle_s``. A put into a full buffer waits (backpressure) up to the
request timeout and then raises :class:`TimeoutError`: the group was not accepted and is still
the producer's to put again or release (:meth:`ZmqBufferClient.put_many` is all or error:
after a TimeoutError its groups are in doubt, see :class:`~buffers.protocol.Buffer`).

A broker that restarts (the launcher restarts a dead one at the same address, and it replays
its spill file) loses the requests it had not answered. With ``reconnect_s`` the client
re-sends a request that got no reply for up to that long, but only requests that are safe to
repeat: reads, heartbeats, acks, lease renewals and progress restores (idempotent), versions
and keys (last write wins), ``acquire``
(a restarted broker starts with no grants in flight) and ``get_batch`` (a batch whose reply was
lost is redelivered after ``reclaim_idle_s``; an ack it carries is idempotent). Puts are never
re-sent: a lost put is in doubt and the producer's to handle (a rollout worker exits and its
supervisor restarts it). The client watches its connection (a ZMQ socket monitor): a request
whose connection dropped while it waited gives up at once instead of after the whole
``request_timeout_s`` (default 30 s), so a restarted broker is asked again as soon as it
listens.

A broker gone for good still costs each request ``request_timeout_s`` and its re-sends: too
long for a role told to stop. A client given the role's ``stop`` event looks at it every
:data:`STOP_POLL_S` while it waits; once it is set, a request waits no longer than it asked
the broker to hold it (a long poll's ``timeout_s``, a put's :data:`PUT_MARGIN_S`) plus
:data:`STOP_GRACE_S`, is never re-sent, and raises :class:`~buffers.BufferStopped`. A live
broker answers within that, so a stopping role still gets its last requests through (a rollout
worker's final heartbeat, the learner's long poll for data); only an unanswered one ends
early, and a put into a full buffer, given up in doubt as after a timeout. Without a stop
event nothing changes.

A consumer may keep several ``get_batch`` requests in flight
(:meth:`ZmqBufferClient.send_get_batch`, :meth:`ZmqBufferClient.receive_batch`; the buffer
benchmark's ``TakeAhead``, ``bench/inflight.py``, uses them): the broker serves one consumer's
requests in the order they were sent, and replies that arrive while another request waits are
kept for theirs. Requests lost with a connection are re-sent, in order, within ``reconnect_s``.
A producer may likewise keep several ``put_many`` calls in flight
(:meth:`ZmqBufferClient.send_put_many`, :meth:`ZmqBufferClient.receive_puts`; the benchmark's
``PutAhead`` uses them), never re-sent: one lost with its connection is in doubt, as a put
that timed out.

A group travels as one packed frame
(:func:`~buffers.packing.pack_group`): one copy when the producer packs it, none after (the
consumer's arrays are views of the received frame); ``put_many`` sends about a megabyte of
them per request, never more than ``buffer.max_message_bytes``. A group over that limit is
refused here, before it is sent, and the broker told in its place (counted as ``oversized``).

A producer's acquires, puts and releases go after its handshake (``hello``, once per
connection, unless it heartbeated): the broker makes members of registered names only. The
commands that change the run carry the run's token (:mod:`buffers.run_token`). An outage of
the broker is one warning when it starts and one when it ends (:mod:`buffers.outage`).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import zmq
from zmq.utils.monitor import recv_monitor_message

from asyncrl.config.schema import BufferConfig
from asyncrl.wire import Rejections, TrajectoryGroup, decode_group, encode_group_views
from buffers import BufferStopped
from buffers.outage import OutageWatch
from buffers.packing import packed_size, refused_oversized
from buffers.protocol import Batch, Grant, PutResult
from buffers.zmq_auth import apply_curve_client
from buffers.zmq_frames import recv_frames, send_frames
from buffers.zmq_protocol import (
    REFUSED_ARG,
    TOKEN_ARG,
    BrokerError,
    Reply,
    decode_reply,
    encode_request,
    needs_token,
    pack_group,
    unpack_group,
)

logger = logging.getLogger(__name__)

PUT_WINDOW = 8  # put_many: requests in flight (a bound on what waits in socket buffers)
PUT_CHUNK_BYTES = 1 << 20  # put_many: groups per request up to about this many bytes
PUT_MARGIN_S = 1.0  # a full broker answers a put at timeout_s; we wait this much longer
STOP_POLL_S = 0.25  # with a stop event: how often a waiting request looks at it
STOP_GRACE_S = 0.5  # once stopping: how long past its long poll a request still waits
OUTAGE_GRACE_S = 1.0  # a dropped connection not back within this long is an outage (warned)
RETRYABLE = frozenset({"hello", "acquire", "get_batch", "ack", "renew", "publish_version",
                       "restore_progress", "heartbeat",
                       "set_key", "get_key", "get_keys", "status"})
PRODUCER_COMMANDS = frozenset({"acquire", "put", "put_many", "release"})  # after the handshake
DEFAULT_MAX_MESSAGE_BYTES = BufferConfig.model_fields["max_message_bytes"].default


class NoReply(TimeoutError):
    """The broker did not answer in time (it is down, restarting or unreachable)."""


class Unregistered(BrokerError):
    """The broker does not know the producer (it restarted and lost its members): nothing of
    the request was done, so it is sent again after the handshake."""


@dataclass(eq=False)
class PendingPut:
    """A ``put_many`` call sent and not yet answered (:meth:`ZmqBufferClient.send_put_many`).

    ``sent``: its requests (id, groups in it), in order; ``replies``: theirs, kept as they
    come while the client waits for something else. A request of the call that is neither
    answered nor still awaited by the client was lost with its connection: in doubt."""

    sent: list[tuple[bytes, int]]
    replies: dict[bytes, Reply]


@dataclass(eq=False)
class PendingBatch:
    """A ``get_batch`` request sent and not yet answered (:meth:`ZmqBufferClient.send_get_batch`).

    ``generation``: the client's connection generation it was sent on; a dropped connection
    or a replaced socket moves the client on, and a request of an older generation is lost and
    must be sent again (with the same arguments, its ack included: acks are idempotent)."""

    request_id: bytes
    args: dict[str, Any]  # as sent (its long poll: ``args["timeout_s"]``)
    generation: int
    give_up: float  # re-sent on a new connection until then (``reconnect_s`` after the send)


@dataclass
class _Link:
    """A client's connection: its DEALER and the monitor that hears the connection drop.

    The client's finalizer holds this, not the client. A client dropped without
    :meth:`ZmqBufferClient.close` inside a reference cycle (an exception's traceback is
    enough) would otherwise leave its context and sockets to the garbage collector, which
    finalizes them in any order: pyzmq's context finalizer, run first, no longer sees the
    sockets (weakly held) and waits in ``term()`` for them to close, for ever, in whichever
    thread the collection happened to run (a CI run lost a learner's batch request that way).
    Held here, the sockets are closed first, then the context ended."""

    socket: zmq.Socket
    monitor: zmq.Socket

    def close(self) -> None:
        if self.socket.closed:   # closed already, and a new connection failed to open
            return
        self.socket.disable_monitor()
        self.monitor.close(linger=0)
        self.socket.close(linger=0)


def _release(link: _Link, context: zmq.Context | None) -> None:
    """Close ``link``, then end ``context`` (the client's own; None for one it was given)."""
    link.close()
    if context is not None:
        context.term()


class ZmqBufferClient:
    """Talks to :class:`~buffers.zmq_broker.ZmqBroker` at ``address`` (``tcp://host:port``)."""

    def __init__(self, address: str, timeout_s: float = 30.0,
                 context: zmq.Context | None = None, curve_keys_dir: str | None = None,
                 curve_name: str = "client", reconnect_s: float = 0.0,
                 stop: threading.Event | None = None, put_window: int = PUT_WINDOW,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 token: str | None = None) -> None:
        """``curve_keys_dir``: CURVE keys (see :mod:`buffers.zmq_auth`) for a broker with
        ``buffer.zmq.auth = "curve"``; the client key pair is ``<curve_name>.key_secret``.
        ``reconnect_s``: how long to keep re-sending a safe request that got no reply.
        ``stop``: the owner's stop event; once set, requests stop waiting for a broker that
        does not answer (see the module docstring). ``put_window``: at most this many put
        requests (about a megabyte each) in flight, over all :meth:`send_put_many` calls.
        ``max_message_bytes``: a group larger than this (packed) is refused here, not sent
        (the broker's ``buffer.max_message_bytes``). ``token``: the run's token
        (:mod:`buffers.run_token`), sent with the commands that change the run."""
        if put_window < 1:
            raise ValueError(f"put_window {put_window} must be >= 1")
        self.address = address
        self.timeout_s = timeout_s
        self.reconnect_s = reconnect_s
        self._stop = stop
        self._curve = (curve_keys_dir, curve_name) if curve_keys_dir else None
        self._own_context = context is None
        self._context = context or zmq.Context()
        self._next_id = 0
        self._link = _Link(*self._connect())
        # Closes the sockets, then ends the context, also for a client dropped unclosed: see
        # _Link. Not at interpreter exit, where a daemon thread may still use the sockets.
        self._finalizer = weakref.finalize(self, _release, self._link,
                                         self._context if self._own_context else None)
        self._finalizer.atexit = False
        self._generation = 0  # moves on whenever requests in flight may have been lost
        self._ahead: dict[bytes, PendingBatch] = {}  # get_batch requests sent, not received
        self._early: dict[bytes, Reply] = {}  # their replies, come while another one waited
        # put_many requests sent and not answered, oldest first, each with its call; cleared
        # when a connection drops (their calls are then in doubt: puts are never re-sent)
        self._puts: dict[bytes, PendingPut] = {}
        self.put_window = put_window
        self.max_message_bytes = max_message_bytes
        self._token = token
        self._rejections = Rejections()  # groups refused here, logged as the broker logs its
        self._members: set[str] = set()  # producers registered on this connection
        self._roles: dict[str, str] = {}  # their roles, as last heartbeated
        self._outage = OutageWatch(address)

    @classmethod
    def from_config(cls, config: BufferConfig, address: str | None = None,
                    stop: threading.Event | None = None,
                    token: str | None = None) -> ZmqBufferClient:
        """The client a :class:`BufferConfig` describes (address, timeout, CURVE keys, size
        limit); ``token``: the run's (:mod:`buffers.run_token`)."""
        zmq_cfg = config.zmq
        keys = zmq_cfg.curve_keys_dir if zmq_cfg.auth == "curve" else None
        if zmq_cfg.auth == "curve" and not keys:
            raise ValueError("buffer.zmq.auth = \"curve\" needs buffer.zmq.curve_keys_dir")
        return cls(address or f"tcp://{zmq_cfg.host}:{zmq_cfg.port}",
                   timeout_s=config.request_timeout_s, curve_keys_dir=keys,
                   reconnect_s=zmq_cfg.reconnect_s, stop=stop,
                   max_message_bytes=config.max_message_bytes, token=token)

    def _connect(self) -> tuple[zmq.Socket, zmq.Socket]:
        """A DEALER to the broker, and a monitor that hears when its connection drops."""
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDTIMEO, int(self.timeout_s * 1000))
        if self._curve is not None:
            apply_curve_client(socket, *self._curve)
        monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED |
                                            zmq.EVENT_HANDSHAKE_SUCCEEDED)
        socket.connect(self.address)
        return socket, monitor

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> ZmqBufferClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- one request, one reply -----------------------------------------------------------

    def _call(self, command: str, args: dict[str, Any], payload: Sequence[Any] = (),
              wait_s: float = 0.0) -> Reply:
        """Send and wait up to ``timeout_s + wait_s`` for the matching reply; a request that is
        safe to repeat is re-sent (on a fresh socket) for up to ``reconnect_s``. A producer's
        request goes after the handshake (:meth:`_register`), and once more after it if the
        broker did not know the producer (it restarted unheard: nothing was done)."""
        give_up = time.monotonic() + self.reconnect_s
        producer = args.get("producer") if command in PRODUCER_COMMANDS else None
        registered_again = False
        while True:
            try:
                self._forget_drops()
                if isinstance(producer, str):
                    self._register(producer)
                request_id = self._send(command, args, payload)
                return self._receive({request_id}, command, wait_s)[request_id]
            except NoReply as exc:
                if command not in RETRYABLE or time.monotonic() >= give_up:
                    raise
                logger.debug("%s; re-sending (is the broker restarting?)", exc)
            except Unregistered:
                if not isinstance(producer, str) or registered_again:
                    raise
                registered_again = True
                self._members.discard(producer)

    def _register(self, producer: str) -> None:
        """The handshake, once per connection: the broker serves a producer's acquires,
        puts and releases only once it is a member (a heartbeat makes it one too). After a
        dropped connection it is done again, and waits for the broker (re-sent, as a safe
        request, for up to ``reconnect_s``) before the request behind it is sent: a put after
        a broker restart goes to the new broker instead of being lost in doubt."""
        if producer not in self._members:
            self._call("hello", {"member": producer,
                                 "role": self._roles.get(producer, "producer")})
            self._members.add(producer)

    def _heard(self) -> bool:
        """Read one event of the connection's monitor: True for a drop. A handshake (the
        connection is up, again) tells the outage watch that the broker is reachable."""
        if recv_monitor_message(self._link.monitor)["event"] == zmq.EVENT_DISCONNECTED:
            return True
        self._outage.answered()
        return False

    def _forget_drops(self) -> None:
        """Drops heard before a request was sent: the DEALER reconnects by itself, so only a
        drop while a request waits means its reply is lost (an idle client whose broker was
        restarted would otherwise fail its next put, in doubt, at once). Batch requests sent
        ahead were waiting: a drop loses them, so they are marked to be sent again."""
        while self._link.monitor.poll(0):
            if not self._heard():
                continue
            if self._ahead:
                self._generation += 1
            self._puts.clear()  # their replies are lost with the connection
            self._members.clear()  # a broker that restarted knows none of them
            self._outage.suspect()  # an outage if not back within OUTAGE_GRACE_S

    def _send(self, command: str, args: dict[str, Any], payload: Sequence[Any] = ()) -> bytes:
        self._next_id += 1
        request_id = self._next_id.to_bytes(8, "little")
        if self._token is not None and needs_token(command, args):
            args = {**args, TOKEN_ARG: self._token}
        try:
            send_frames(self._link.socket, encode_request(request_id, command, args, payload))
        except zmq.Again:
            self._timed_out(command, "send")
        return request_id

    def _receive(self, request_ids: set[bytes], command: str, wait_s: float = 0.0,
                 check: bool = True) -> dict[bytes, Reply]:
        """The replies to ``request_ids``, each checked (``check``) for a refusal; a late
        reply to a request given up on is discarded."""
        replies = {i: self._early.pop(i) for i in request_ids if i in self._early}
        start = time.monotonic()
        deadline = start + self.timeout_s + wait_s
        stop_deadline = start + wait_s + STOP_GRACE_S  # once stopping (see the module doc)
        poller = zmq.Poller()
        poller.register(self._link.socket, zmq.POLLIN)
        poller.register(self._link.monitor, zmq.POLLIN)
        while len(replies) < len(request_ids):
            remaining = deadline - time.monotonic()
            if self._stop is not None:
                remaining = min(remaining, STOP_POLL_S)
            if self._outage.suspected:
                remaining = min(remaining, OUTAGE_GRACE_S)
            ready = dict(poller.poll(max(1, int(remaining * 1000)))) if remaining > 0 else {}
            if self._link.socket not in ready:
                if self._link.monitor in ready and self._heard():
                    self._timed_out(command, "reply", "the connection dropped while waiting",
                                    dropped=True)
                self._outage.overdue(OUTAGE_GRACE_S, "the connection dropped and is not back")
                if self._stopping() and time.monotonic() >= stop_deadline:
                    self._timed_out(command, "reply")
                if time.monotonic() < deadline:
                    continue
                self._timed_out(command, "reply")
            reply_id, reply = decode_reply(recv_frames(self._link.socket))
            self._outage.answered()
            if reply_id not in request_ids:
                if reply_id in self._ahead:
                    self._early[reply_id] = reply  # a batch sent ahead: kept for its receive
                elif reply_id in self._puts:  # a put sent ahead: kept for its call
                    self._puts.pop(reply_id).replies[reply_id] = reply
                else:
                    logger.debug("discarding a late reply to request %s", reply_id.hex())
                continue
            replies[reply_id] = reply
        if check:
            for reply in replies.values():
                self._checked(command, reply)
        return replies

    def _checked(self, command: str, reply: Reply) -> Reply:
        if not reply.ok and reply.body.get("reason") == "full":
            raise TimeoutError(f"buffer broker {self.address}: {command} waited for room: "
                               f"{reply.body.get('error')}")
        if not reply.ok:
            error = Unregistered if reply.body.get("reason") == "unregistered" else BrokerError
            raise error(f"buffer broker {self.address} refused {command}: "
                        f"{reply.body.get('error', reply.body)}")
        return reply

    def _stopping(self) -> bool:
        return self._stop is not None and self._stop.is_set()

    def _timed_out(self, command: str, stage: str, why: str = "",
                   dropped: bool = False) -> NoReturn:
        """Give the request up: a fresh socket, so its late reply never answers another one.
        Once stopping, whatever the cause, :class:`~buffers.BufferStopped` (never re-sent).
        An outage (:mod:`buffers.outage`) when no answer came in time; a ``dropped``
        connection (a broker restarting) is one if it is not back within
        :data:`OUTAGE_GRACE_S`."""
        self._link.close()
        self._link.socket, self._link.monitor = self._connect()
        self._generation += 1  # batch requests sent ahead went with the old socket
        self._puts.clear()  # and puts in flight: in doubt
        self._members.clear()  # the broker may have restarted meanwhile
        if self._stopping():
            raise BufferStopped(f"buffer broker {self.address}: stopped waiting for the "
                                f"{stage} to {command!r}: stopping ({why or 'no answer'})")
        why = why or f"not within {self.timeout_s:.1f}s"
        if dropped:
            self._outage.suspect()
        else:
            self._outage.failed(f"no {stage} for {command!r} ({why})")
        raise NoReply(f"buffer broker {self.address}: no {stage} for {command!r} ({why})")

    # --- Buffer -------------------------------------------------------------------------------

    def acquire(self, producer: str, want: int, engine_version: int) -> Grant:
        body = self._call("acquire", {"producer": producer, "want": want,
                                      "engine_version": engine_version}).body
        return Grant(granted=body["granted"], version=body["version"],
                     run_status=body["run_status"])

    def put(self, producer: str, group: TrajectoryGroup) -> PutResult:
        """Hand a group in; waits while the buffer is full (TimeoutError after the timeout)."""
        return self.put_frames(producer, encode_group_views(group), group.group_id)

    def put_frames(self, producer: str, frames: Sequence[Any], name: str = "") -> PutResult:
        """Put already-encoded frames as they are (forwarding, and tests of bad input); a
        group over ``max_message_bytes`` is refused here (see :meth:`_pack`)."""
        item = self._pack(producer, frames, name)
        body = self._call("put", _put_args(producer, self.timeout_s, [item]), [_frame(item)],
                          wait_s=PUT_MARGIN_S).body
        return PutResult(accepted=body["accepted"], reason=body["reason"])

    def _pack(self, producer: str, frames: Sequence[Any], name: str) -> bytes | int:
        """The group packed, or, over ``max_message_bytes``, its packed size: such a group
        is refused here, logged naming the key and the size, and never sent (the broker's
        socket would drop the connection of a frame well over the limit: the producer saw
        "the connection dropped" and crash-looped). The request still tells the broker, which
        counts it as ``oversized`` and frees its slot, and answers it in its place."""
        size = packed_size(frames)
        if size <= self.max_message_bytes:
            return pack_group(frames)
        self._rejections.add(refused_oversized(size, self.max_message_bytes, name), producer)
        return size

    def put_many(self, producer: str, groups: Sequence[TrajectoryGroup]) -> list[PutResult]:
        """:meth:`Buffer.put_many <buffers.protocol.Buffer.put_many>`: groups go in
        ``put_many`` requests of about :data:`PUT_CHUNK_BYTES` (one group's frame each), up
        to ``put_window`` requests in flight, so packing and sending overlap the broker's
        work while the broker still takes them in order (parking them, in order, while it
        is full). Small groups so cost one round trip per chunk instead of one per group.

        All or error, as the protocol says: a request that waited ``timeout_s`` for room,
        or no reply at all, raises :class:`TimeoutError` with the groups in doubt (requests
        already sent may still be accepted after it; the rest are never sent)."""
        return self.receive_puts(self.send_put_many(producer, groups))

    def send_put_many(self, producer: str, groups: Sequence[TrajectoryGroup]) -> PendingPut:
        """Send a :meth:`put_many` without waiting for its results; :meth:`receive_puts`
        gives them. Calls in flight together keep their order at the broker (one socket), so
        FIFO per producer holds across them, and backpressure still holds: at most
        ``put_window`` requests of all calls are in flight, so this waits for the oldest
        answer before sending more (about ``put_window`` MB in socket buffers at most).

        Why: a producer that waits for each call's answer leaves itself idle for a round trip
        per call and the broker idle while it packs the next (bench/RESULTS.md: the ZMQ
        row of one producer of 1k-token groups). A failure seen while sending (a request of
        any call refused, for room within ``timeout_s`` or otherwise, or no answer) raises
        here as in :meth:`put_many` and sends nothing more, with this call's groups in doubt;
        the calls in flight raise from their own :meth:`receive_puts`."""
        pending = PendingPut([], {})
        self._forget_drops()  # a drop heard now lost the answers of the calls in flight
        self._register(producer)
        packed = (self._pack(producer, encode_group_views(g), g.group_id) for g in groups)
        try:
            for chunk in _chunks(packed, min(PUT_CHUNK_BYTES, self.max_message_bytes)):
                while len(self._puts) >= self.put_window:
                    oldest = next(iter(self._puts))
                    owner = self._puts.pop(oldest)
                    reply = self._receive({oldest}, "put_many", PUT_MARGIN_S, check=False)
                    owner.replies.update(reply)  # the answer is its own call's
                    if not reply[oldest].ok:  # none after a refused one: FIFO per producer
                        self._checked("put_many", reply[oldest])
                request_id = self._send("put_many", _put_args(producer, self.timeout_s, chunk),
                                        [_frame(item) for item in chunk])
                pending.sent.append((request_id, len(chunk)))
                self._puts[request_id] = pending
        except BaseException:
            self.forget_puts(pending)
            raise
        return pending

    def receive_puts(self, pending: PendingPut) -> list[PutResult]:
        """The results of a :meth:`send_put_many`, one per group in order (all or error, as
        :meth:`put_many`). A request of the call lost with its connection raises
        :class:`TimeoutError` at once (in doubt): puts are never re-sent."""
        try:
            waiting = {i for i, _ in pending.sent if i not in pending.replies and i in self._puts}
            if waiting:
                for request_id in waiting:
                    del self._puts[request_id]
                pending.replies.update(self._receive(waiting, "put_many", PUT_MARGIN_S,
                                                     check=False))
            results: list[PutResult] = []
            for request_id, count in pending.sent:
                if request_id not in pending.replies:
                    raise NoReply(f"buffer broker {self.address}: the answer to a put_many of "
                                  f"{count} groups was lost (its connection dropped, or a "
                                  "request before it got no answer): its groups are in doubt "
                                  "(puts are never re-sent)")
                answers = self._checked("put_many", pending.replies[request_id]).body.get(
                    "results")
                if not isinstance(answers, list) or len(answers) != count:
                    raise BrokerError(f"buffer broker {self.address}: put_many of {count} "
                                      f"groups answered {answers!r}")
                results += [PutResult(accepted=bool(ok), reason=str(reason))
                            for ok, reason in answers]
            return results
        finally:
            self.forget_puts(pending)

    def forget_puts(self, pending: PendingPut) -> None:
        """Give up on a :meth:`send_put_many` (its groups in doubt): later answers to it are
        discarded."""
        for request_id, _ in pending.sent:
            self._puts.pop(request_id, None)

    def release(self, producer: str, count: int) -> None:
        self._call("release", {"producer": producer, "count": count})

    def get_batch(self, consumer: str, count: int, learner_version: int,
                  timeout_s: float, ack: Batch | None = None) -> Batch | None:
        return self.receive_batch(self.send_get_batch(consumer, count, learner_version,
                                                      timeout_s, ack))

    def send_get_batch(self, consumer: str, count: int, learner_version: int,
                       timeout_s: float, ack: Batch | None = None) -> PendingBatch:
        """Send a :meth:`get_batch` request without waiting for its batch: several may be in
        flight, and the broker serves a consumer's requests in the order they were sent (a
        request for a later version never drops groups an earlier one of the same consumer
        will take). Each is answered by :meth:`receive_batch`, in any order.

        A batch is leased from the moment the broker serves it, received or not: a consumer
        that asks ahead must receive and train it within ``buffer.reclaim_idle_s`` (or renew
        it), else it is redelivered elsewhere (at-least-once, as for any batch)."""
        args: dict[str, Any] = {"consumer": consumer, "count": count,
                                "learner_version": learner_version, "timeout_s": timeout_s}
        if ack is not None and ack.receipts:
            args["ack"] = ack.receipts  # settled by the broker before it serves this one
        if not self._ahead:
            self._forget_drops()
        elif any(p.generation != self._generation for p in self._ahead.values()):
            self._resend_lost()  # first: the broker must see them before this one
        pending = PendingBatch(self._send("get_batch", args), args, self._generation,
                               time.monotonic() + self.reconnect_s)
        self._ahead[pending.request_id] = pending
        return pending

    def receive_batch(self, pending: PendingBatch) -> Batch | None:
        """The answer to a :meth:`send_get_batch`: its batch, or None if ``count`` fresh groups
        did not come within its ``timeout_s``. A request lost with its connection is sent
        again (with every other one lost with it, in their order) until ``reconnect_s`` after
        it was first sent; then :class:`TimeoutError`, as :meth:`get_batch` raises."""
        while True:
            try:
                if pending.generation != self._generation:
                    if time.monotonic() >= pending.give_up:
                        raise NoReply(f"buffer broker {self.address}: a 'get_batch' request "
                                      f"was lost with its connection, and reconnect_s="
                                      f"{self.reconnect_s:g} is over")
                    self._resend_lost()
                reply_id = pending.request_id
                reply = self._receive({reply_id}, "get_batch",
                                      pending.args["timeout_s"])[reply_id]
                break
            except NoReply as exc:
                if time.monotonic() >= pending.give_up:
                    self._ahead.pop(pending.request_id, None)
                    raise
                logger.warning("%s; re-sending (is the broker restarting?)", exc)
            except BaseException:
                self._ahead.pop(pending.request_id, None)
                raise
        del self._ahead[reply_id]
        if not reply.body["found"]:
            return None
        # The broker ran the full check on accept (and its spill holds only accepted
        # frames): the structure is re-checked here, the values are not scanned twice.
        groups = [decode_group(unpack_group(packed), check_values=False)
                  for packed in reply.payload]
        return Batch(groups=groups, dropped_stale=reply.body["dropped_stale"],
                     stats=reply.body["stats"], receipts=list(reply.body["receipts"]))

    def forget_batch(self, pending: PendingBatch) -> None:
        """Give up on a request sent ahead: never re-sent, its reply discarded if it comes (a
        batch served to it is leased to nobody and redelivered after ``reclaim_idle_s``)."""
        self._ahead.pop(pending.request_id, None)
        self._early.pop(pending.request_id, None)

    def _resend_lost(self) -> None:
        """Send again, in their order, every batch request of an older generation (lost with
        a connection), so the broker still serves them in the order they were first sent."""
        lost = []
        for p in self._ahead.values():
            if p.generation != self._generation:
                if p.request_id in self._early:  # answered before the drop: not lost
                    p.generation = self._generation
                else:
                    lost.append(p)
        for p in lost:
            del self._ahead[p.request_id]
        self._forget_drops()
        for p in lost:
            p.request_id, p.generation = self._send("get_batch", p.args), self._generation
            self._ahead[p.request_id] = p

    def ack(self, consumer: str, batch: Batch, consumed: int | None = None) -> None:
        """The step that used ``batch`` is done: its groups are never redelivered
        (``consumed``: see the protocol)."""
        if batch.receipts:
            args: dict[str, Any] = {"consumer": consumer, "receipts": batch.receipts}
            if consumed is not None:
                args["consumed"] = consumed
            self._call("ack", args)

    def renew(self, consumer: str, batch: Batch) -> int:
        """Keep ``batch`` from being reclaimed during a long step (see the protocol)."""
        if not batch.receipts:
            return 0
        return int(self._call("renew", {"consumer": consumer,
                                        "receipts": batch.receipts}).body["held"])

    # --- ControlPlane -------------------------------------------------------------------------

    def publish_version(self, version: int) -> None:
        self._call("publish_version", {"version": version})

    def restore_progress(self, version: int, consumed: int) -> int:
        return int(self._call("restore_progress", {"version": version,
                                                   "consumed": consumed}).body["version"])

    def heartbeat(self, member: str, role: str, info: dict[str, Any]) -> dict[str, Any]:
        """Also the handshake: the member is registered (see :meth:`_register`)."""
        body = self._call("heartbeat", {"member": member, "role": role, "info": info}).body
        self._members.add(member)
        self._roles[member] = role
        return body

    def set_key(self, key: str, value: dict[str, Any]) -> int:
        return int(self._call("set_key", {"key": key, "value": value}).body["seq"])

    def get_key(self, key: str, newer_than: int = 0,
                timeout_s: float = 0.0) -> tuple[int, dict[str, Any]] | None:
        body = self._call("get_key", {"key": key, "newer_than": newer_than,
                                      "timeout_s": timeout_s}, wait_s=timeout_s).body
        return (int(body["seq"]), body["value"]) if body["found"] else None

    def get_keys(self, keys: Sequence[str]) -> dict[str, tuple[int, dict[str, Any]]]:
        values = self._call("get_keys", {"keys": list(keys)}).body["values"]
        return {key: (int(seq), value) for key, (seq, value) in values.items()}

    def status(self) -> dict[str, Any]:
        return self._call("status", {}).body

    def shutdown(self) -> None:
        """Ask the broker to stop serving (it answers first)."""
        self._call("shutdown", {})


def _put_args(producer: str, timeout_s: float, items: Sequence[bytes | int]
              ) -> dict[str, Any]:
    """A put's arguments; the groups refused as oversized (:meth:`ZmqBufferClient._pack`)
    named by their index and size."""
    args: dict[str, Any] = {"producer": producer, "timeout_s": timeout_s}
    refused = [[i, item] for i, item in enumerate(items) if isinstance(item, int)]
    if refused:
        args[REFUSED_ARG] = refused
    return args


def _frame(item: bytes | int) -> bytes:
    """A packed group's frame; an empty placeholder for a group refused as oversized."""
    return b"" if isinstance(item, int) else item


def _chunks(items: Iterable[bytes | int], chunk_bytes: int) -> Iterator[list[bytes | int]]:
    """Packed groups (refused ones as their size) in order, in lists whose frames add up to
    at most ``chunk_bytes`` (a group larger than that alone): each list is one request, so
    one request stays within ``buffer.max_message_bytes`` too. ``items`` is consumed lazily:
    a group is packed only when its request is about to be sent."""
    chunk: list[bytes | int] = []
    size = 0
    for item in items:
        nbytes = len(_frame(item))
        if chunk and size + nbytes > chunk_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append(item)
        size += nbytes
    if chunk:
        yield chunk
