"""The embedded ZMQ broker: the buffer's data and control plane in one event loop.

One ROUTER socket, one thread, no locks: every request is handled to completion in turn, so
the gate counters can never race. Requests that have to wait are parked
(:mod:`buffers.zmq_waits`): batches until enough groups are queued, keys until they change,
puts while ``max_groups`` are held (backpressure). The rules live in
:class:`~buffers.zmq_state.BrokerState`, the socket's hardening in
:func:`~buffers.zmq_auth.bind_router`; this module only moves messages. Groups are received as
``zmq.Frame`` objects, kept as such and sent on with ``copy=False``: never copied in Python
(:mod:`buffers.zmq_frames`: pyzmq's multipart calls without their Python layer).

Who may do what: the commands that change the run need the run's token
(:data:`~buffers.zmq_protocol.GUARDED`, :mod:`buffers.run_token`), a producer must have said
``hello`` (or heartbeated) before it acquires, puts or releases, and a request's arguments
over ``buffer.max_message_bytes`` are refused unread; each refusal is counted in
``bad_requests`` and its first few logged.
"""

from __future__ import annotations

import hmac
import logging
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from asyncrl.config.schema import BufferConfig
from buffers import group_check
from buffers.protocol import RUN_STATUS_KEY
from buffers.run_token import TOKEN_ENV, TOKEN_FILE
from buffers.zmq_auth import CurveServer, bind_router
from buffers.zmq_control import batch_stats, status_of
from buffers.zmq_frames import recv_frames, send_frames
from buffers.zmq_protocol import (
    TOKEN_ARG,
    ProtocolError,
    Reply,
    Request,
    arg_dict,
    arg_int,
    arg_str,
    arg_str_list,
    decode_request,
    encode_reply,
    error,
    needs_token,
)
from buffers.zmq_replay import open_spill, snapshot_of, spill_file
from buffers.zmq_state import BrokerState, QueuedGroup, StateError
from buffers.zmq_puts import PutDesk
from buffers.zmq_waits import Parked, Waits, park

logger = logging.getLogger(__name__)

POLL_S = 0.05  # upper bound on how late a stop event or a deadline is noticed
COMMANDS = ("hello", "acquire", "put", "put_many", "release", "get_batch", "ack", "renew",
            "publish_version", "restore_progress", "heartbeat", "set_key", "get_key", "get_keys",
            "status", "shutdown")
TICK_S = 0.01  # member liveness, reclaim of unacked groups and fsync: at most this often
DRAIN_MAX = 64  # requests handled per wake-up before the housekeeping runs again
CLOSE_LINGER_MS = 500  # lets the last replies (shutdown, failed long polls) leave the socket
_NOBLOCK = int(zmq.NOBLOCK)


class ZmqBroker:
    """Serves :class:`~buffers.zmq_client.ZmqBufferClient` requests until stopped."""

    def __init__(self, config: BufferConfig, groups_per_step: int, run_id: str = "",
                 run_dir: Path | None = None, token: str | None = None) -> None:
        """``run_dir`` is where ``buffer.zmq.spill_path = "auto"`` journals (none: memory only).
        ``token``: the run's token (:mod:`buffers.run_token`), without which the commands that
        change the run are refused; every broker a launcher or `asyncrl buffer` starts has
        one. None (a broker inside a test or a benchmark) checks none."""
        self.config = config
        self._token = token
        if token is None:
            logger.info("no run token: the commands that change the run are served to anyone "
                        "(a broker in a test or benchmark; the roles' brokers have one)")
        self.spill = spill_file(config.zmq.spill_path, run_dir)
        journal, recovered = open_spill(self.spill) if self.spill else (None, None)
        if self.spill:
            logger.info("journaling accepted groups to %s", self.spill)
        (logger.info if group_check.COMPILED else logger.warning)(
            "checking groups: %s", group_check.describe())
        self.state = BrokerState(config, groups_per_step, run_id, journal=journal,
                                 recovered=recovered)
        self.bad_requests: Counter[str] = Counter()
        self._context = zmq.Context(config.zmq.io_threads)
        self._curve: CurveServer | None = None
        self._socket: zmq.Socket | None = None
        self._waits = Waits()
        self._puts = PutDesk(self.state, self._waits, self._answer, self._serve_batches,
                             config.request_timeout_s)
        self._next_tick = 0.0
        self._stopping = False
        self._handlers: dict[str, Callable[[Request], Reply | None]] = {
            name: getattr(self, f"_{name}") for name in COMMANDS}

    def bind(self) -> str:
        """Bind ``tcp://host:port`` (port 0 picks a free one); returns the address to dial."""
        self._socket, self._curve, address = bind_router(self._context, self.config)
        return address

    def serve(self, stop: threading.Event | None = None) -> None:
        """Handle requests until ``stop`` is set or a client sends ``shutdown``."""
        if self._socket is None:
            raise RuntimeError("ZmqBroker.serve() called before bind()")
        try:
            while not self._stopping and not (stop is not None and stop.is_set()):
                if self._socket.poll(self._poll_ms()):
                    self._drain()
                self._housekeeping()
        except BaseException as exc:  # a failed fsync (zmq_spill): nobody is left waiting
            self._fail_pending(f"broker failed: {exc!r}")
            raise
        self._fail_pending("broker shutting down")
        logger.info("buffer broker stopped")

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=CLOSE_LINGER_MS)
            self._socket = None
        if self._curve is not None:
            self._curve.stop()
            self._curve = None
        if self.state.journal is not None:
            self.state.journal.state(snapshot_of(self.state))
            self.state.journal.close()
        self._context.term()

    def _poll_ms(self) -> int:
        now = self.state.clock()
        deadline = self._waits.next_deadline()
        wait = min(POLL_S, deadline - now) if deadline is not None else POLL_S
        return max(0, int(wait * 1000))

    def _drain(self) -> None:
        assert self._socket is not None
        for _ in range(DRAIN_MAX):
            try:
                frames = recv_frames(self._socket, _NOBLOCK)
            except zmq.Again:
                return
            self._handle(frames)

    def _housekeeping(self) -> None:
        """Deadlines and the gate clock every time; liveness, reclaim, fsync every TICK_S."""
        self._expire()
        self.state.update_gate_clock()
        now = self.state.clock()
        if now < self._next_tick:
            return
        self._next_tick = now + TICK_S
        self.state.reap()
        self.state.reclaim()
        self._serve_batches()  # reclaimed groups, or (pace) a reaped producer's grants
        self._admit_parked_puts()
        if self.state.journal is not None:
            self.state.journal.sync_if_due()

    def _handle(self, frames: list[Any]) -> None:
        try:
            request = decode_request(frames, self.config.max_message_bytes)
            handler = self._handlers.get(request.command)
            if handler is None:
                raise ProtocolError("command", f"unknown command {request.command!r}")
            if needs_token(request.command, request.args):
                self._check_token(request)
            reply = handler(request)
        except (ProtocolError, StateError) as exc:
            reply = self._reject(exc.reason, str(exc))
        except Exception as exc:  # a bug must cost one request, not the run: logged, counted
            logger.exception("broker failed on a request")
            reply = self._reject("internal", repr(exc))
        if reply is not None and len(frames) >= 2:
            self._send(frames[0].bytes, frames[1].bytes, reply)

    def _check_token(self, request: Request) -> None:
        """A command that changes the run carries the run's token (:mod:`buffers.run_token`),
        whatever ``buffer.zmq.auth`` says; refused (counted as ``token``, logged) otherwise."""
        given = request.args.get(TOKEN_ARG)
        if self._token is None or (isinstance(given, str) and
                                   hmac.compare_digest(given.encode(), self._token.encode())):
            return
        what = "without the run token" if given is None else "with a wrong run token"
        raise ProtocolError("token", f"{request.command!r} {what} refused (a client reads it "
                                     f"from ${TOKEN_ENV} or the run directory's {TOKEN_FILE})")

    def _reject(self, reason: str, detail: str) -> Reply:
        self.bad_requests[reason] += 1
        if self.bad_requests[reason] <= 5:
            logger.warning("bad request (%s): %s", reason, detail)
        return error(reason, detail)

    def _send(self, identity: bytes, request_id: bytes, reply: Reply) -> None:
        assert self._socket is not None
        send_frames(self._socket, encode_reply(identity, request_id, reply))

    def _answer(self, parked: Parked, reply: Reply) -> None:
        self._send(parked.identity, parked.request_id, reply)

    def _expire(self) -> None:
        now = self.state.clock()
        batches, keys, puts = self._waits.pop_expired(now)
        for p in batches:
            self._answer(p, self._batch_reply(p.name, None))
        for p in keys:
            self._answer(p, Reply(True, {"found": False}))
        for p in puts:
            self._answer(p, error("full", f"the buffer held max_groups="
                                          f"{self.config.max_groups} for {now - p.since:.1f}s"))

    def _fail_pending(self, detail: str) -> None:
        for p in self._waits:
            self._answer(p, error("shutdown", detail))
        self._waits.clear()

    def _hello(self, request: Request) -> Reply:
        """The handshake: a producer becomes a member before it acquires or puts (its client
        sends this once per connection, unless it heartbeated)."""
        args = request.args
        self.state.members.register(arg_str(args, "member"), arg_str(args, "role", ""))
        return Reply(True, {"version": self.state.version, "run_status": self.state.run_status})

    def _acquire(self, request: Request) -> Reply:
        args = request.args
        self.state.require_member(arg_str(args, "producer"))
        granted = self.state.acquire(arg_str(args, "producer"),
                                     arg_int(args, "want", minimum=0),
                                     arg_int(args, "engine_version"))
        return Reply(True, {"granted": granted, "version": self.state.version,
                            "run_status": self.state.run_status})

    def _put(self, request: Request) -> Reply | None:
        return self._puts.put(request, single=True)

    def _put_many(self, request: Request) -> Reply | None:
        return self._puts.put(request, single=False)

    def _admit_parked_puts(self) -> None:
        self._puts.admit_parked()

    def _release(self, request: Request) -> Reply:
        self.state.require_member(arg_str(request.args, "producer"))
        self.state.release(arg_str(request.args, "producer"),
                           arg_int(request.args, "count", minimum=0))
        self._serve_batches()  # pace: a take may have waited on these groups
        return Reply(True, {})

    def _get_batch(self, request: Request) -> None:
        """Park a batch request; an ``ack`` list in it settles the previous batch first,
        exactly as an ``ack`` request would (one round trip instead of two)."""
        args = request.args
        count = arg_int(args, "count", minimum=1)
        if count > self.config.max_groups:
            raise ProtocolError("args", f"count {count} > max_groups {self.config.max_groups}")
        if "ack" in args:
            self.state.ack(arg_str(args, "consumer"), arg_str_list(args, "ack"))
        self._waits.batches.append(park(request, arg_str(args, "consumer"), self.state.clock(),
                                        count, arg_int(args, "learner_version")))
        self._serve_batches()
        self._admit_parked_puts()  # stale drops may have made room
        self._expire()  # a zero timeout answers now

    def _serve_batches(self) -> None:
        """Answer parked batch requests in arrival order, each as soon as it can be filled;
        a consumer's requests strictly in its order. A consumer may have several in flight,
        each for the version it will train at, and a request for a later version drops the
        groups stale at it: were it tried while an earlier one waits, it could drop groups
        that one would have taken (still fresh at its version)."""
        waiting: set[str] = set()  # consumers whose earliest request could not be filled
        for p in list(self._waits.batches):
            if p.name in waiting:
                continue
            groups = self.state.take(p.name, p.wanted, p.learner_version)
            if groups is None:
                waiting.add(p.name)
            else:
                self._waits.batches.remove(p)
                self._answer(p, self._batch_reply(p.name, groups))

    def _batch_reply(self, consumer: str, groups: list[QueuedGroup] | None) -> Reply:
        groups = groups or []
        body: dict[str, Any] = {"found": bool(groups), "count": len(groups),
                                "receipts": [self.state.receipt(g) for g in groups],
                                "dropped_stale": self.state.pop_dropped(consumer) if groups
                                else 0, "stats": batch_stats(self.state)}
        return Reply(True, body, [f for g in groups for f in g.frames])

    def _ack(self, request: Request) -> Reply:
        args = request.args
        consumed = arg_int(args, "consumed", minimum=0) if "consumed" in args else None
        acked = self.state.ack(arg_str(args, "consumer"), arg_str_list(args, "receipts"),
                               consumed)
        self._admit_parked_puts()
        return Reply(True, {"acked": acked})

    def _renew(self, request: Request) -> Reply:
        held = self.state.renew(arg_str(request.args, "consumer"),
                                arg_str_list(request.args, "receipts"))
        return Reply(True, {"held": held})

    def _publish_version(self, request: Request) -> Reply:
        self.state.publish_version(arg_int(request.args, "version", minimum=0))
        return Reply(True, {"version": self.state.version})

    def _restore_progress(self, request: Request) -> Reply:
        version = self.state.restore_progress(arg_int(request.args, "version", minimum=0),
                                              arg_int(request.args, "consumed", minimum=0))
        return Reply(True, {"version": version})

    def _heartbeat(self, request: Request) -> Reply:
        args = request.args
        self.state.members.heartbeat(arg_str(args, "member"), arg_str(args, "role", ""),
                                     arg_dict(args, "info"))
        return Reply(True, {"version": self.state.version, "run_status": self.state.run_status})

    def _set_key(self, request: Request) -> Reply:
        key = arg_str(request.args, "key")
        seq = self.state.set_key(key, arg_dict(request.args, "value"))
        for p in self._waits.pop_key_waiters(key, seq):
            self._answer(p, Reply(True, self.state.keys.lookup(key, p.wanted)))
        if key == RUN_STATUS_KEY:  # a run done refuses the puts waiting for room, now
            self._admit_parked_puts()
        return Reply(True, {"seq": seq})

    def _get_key(self, request: Request) -> Reply | None:
        key = arg_str(request.args, "key")
        newer_than = arg_int(request.args, "newer_than", 0)
        if self.state.keys.get(key, newer_than) is not None:
            return Reply(True, self.state.keys.lookup(key, newer_than))
        self._waits.keys.append(park(request, key, self.state.clock(), newer_than))
        self._expire()
        return None

    def _get_keys(self, request: Request) -> Reply:
        found = {}
        for key in arg_str_list(request.args, "keys"):
            entry = self.state.keys.get(key)
            if entry is not None:
                found[key] = list(entry)
        return Reply(True, {"values": found})

    def _status(self, request: Request) -> Reply:
        return Reply(True, {**status_of(self.state), "bad_requests": dict(self.bad_requests),
                            "waiting": self._waits.counts(),
                            "backpressure": dict(self._waits.backpressure),
                            "auth": self.config.zmq.auth})

    def _shutdown(self, request: Request) -> Reply:
        logger.info("shutdown requested")
        self._stopping = True
        return Reply(True, {})


def start_broker_thread(config: BufferConfig, groups_per_step: int, run_id: str = "",
                        token: str | None = None) -> tuple[str, Callable[[], None]]:
    """Bind a broker and serve it on a daemon thread; returns (address, stop-and-join).

    The socket is bound here and handed to the thread (thread start is a memory barrier, which
    is what ZMQ asks for when a socket changes threads), so the address is ready on return.
    """
    broker = ZmqBroker(config, groups_per_step, run_id, token=token)
    address = broker.bind()
    stop = threading.Event()
    thread = threading.Thread(target=broker.serve, args=(stop,), name="zmq-broker", daemon=True)
    thread.start()

    def stop_and_join() -> None:
        stop.set()
        thread.join()
        broker.close()

    return address, stop_and_join
