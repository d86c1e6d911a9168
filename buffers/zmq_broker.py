"""The embedded ZMQ broker: the buffer's data and control plane in one event loop.

One ROUTER socket, one thread, no locks: every request is handled to completion in turn, so
the gate counters can never race. Requests that have to wait (``get_batch``, ``get_key``) are
parked as *pending* and answered when a ``put``/``set_key`` makes them servable or when their
deadline passes: a learner waiting for data costs the broker nothing. The rules themselves live
in :class:`~buffers.zmq_state.BrokerState`; this module only moves messages.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from asyncrl.config.schema import BufferConfig
from buffers.zmq_protocol import (
    ProtocolError,
    Reply,
    Request,
    arg_dict,
    arg_float,
    arg_int,
    arg_str,
    decode_request,
    encode_reply,
    error,
)
from buffers.zmq_state import BrokerState, QueuedGroup, StateError

logger = logging.getLogger(__name__)

POLL_S = 0.05  # upper bound on how late a stop event or a deadline is noticed
CLOSE_LINGER_MS = 500  # lets the last replies (shutdown, failed long polls) leave the socket


@dataclass
class _Pending:
    """A parked long-poll request: who to answer, what it waits for, until when."""

    identity: bytes
    request_id: bytes
    name: str  # consumer (get_batch) or key (get_key)
    wanted: int  # count (get_batch) or newer_than (get_key)
    learner_version: int
    deadline: float


class ZmqBroker:
    """Serves :class:`~buffers.zmq_client.ZmqBufferClient` requests until stopped."""

    def __init__(self, config: BufferConfig, groups_per_step: int, run_id: str = "") -> None:
        self.config = config
        self.state = BrokerState(config, groups_per_step, run_id)
        self.bad_requests: Counter[str] = Counter()
        self._context = zmq.Context()
        self._socket: zmq.Socket | None = None
        self._batches: list[_Pending] = []
        self._key_waits: list[_Pending] = []
        self._shutdown = False
        self._handlers: dict[str, Callable[[Request], Reply | None]] = {
            "acquire": self._acquire, "put": self._put, "release": self._release,
            "get_batch": self._get_batch, "publish_version": self._publish_version,
            "heartbeat": self._heartbeat, "set_key": self._set_key, "get_key": self._get_key,
            "status": self._status, "shutdown": self._shutdown_cmd,
        }

    def bind(self) -> str:
        """Bind ``tcp://host:port`` (port 0 picks a free one); returns the address to dial."""
        socket = self._context.socket(zmq.ROUTER)
        port = self.config.port or "*"
        socket.bind(f"tcp://{self.config.host}:{port}")
        self._socket = socket
        endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        actual_port = int(endpoint.rsplit(":", 1)[1])
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "*", "") else self.config.host
        address = f"tcp://{host}:{actual_port}"
        logger.info("buffer broker listening on %s (bound %s)", address, endpoint)
        return address

    def serve(self, stop: threading.Event | None = None) -> None:
        """Handle requests until ``stop`` is set or a client sends ``shutdown``."""
        if self._socket is None:
            raise RuntimeError("ZmqBroker.serve() called before bind()")
        while not self._shutdown and not (stop is not None and stop.is_set()):
            if self._socket.poll(self._poll_ms()):
                self._handle(self._socket.recv_multipart())
            self.state.reap()
            self._expire()
            self.state.update_gate_clock()
        self._fail_pending("broker shutting down")
        logger.info("buffer broker stopped")

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=CLOSE_LINGER_MS)
            self._socket = None
        self._context.term()

    # --- the loop's plumbing ----------------------------------------------------------------

    def _poll_ms(self) -> int:
        now = self.state.clock()
        deadlines = [p.deadline for p in self._batches + self._key_waits]
        wait = min([POLL_S, *(d - now for d in deadlines)])
        return max(0, int(wait * 1000))

    def _handle(self, frames: list[bytes]) -> None:
        try:
            request = decode_request(frames)
            handler = self._handlers.get(request.command)
            if handler is None:
                raise ProtocolError("command", f"unknown command {request.command!r}")
            reply = handler(request)
        except (ProtocolError, StateError) as exc:
            reply = self._reject(exc.reason, str(exc))
        except Exception as exc:  # a bug must cost one request, not the run: logged, counted
            logger.exception("broker failed on a request")
            reply = self._reject("internal", repr(exc))
        if reply is not None and len(frames) >= 2:
            self._send(frames[0], frames[1], reply)

    def _reject(self, reason: str, detail: str) -> Reply:
        self.bad_requests[reason] += 1
        if self.bad_requests[reason] <= 5:
            logger.warning("bad request (%s): %s", reason, detail)
        return error(reason, detail)

    def _send(self, identity: bytes, request_id: bytes, reply: Reply) -> None:
        assert self._socket is not None
        self._socket.send_multipart(encode_reply(identity, request_id, reply))

    def _answer(self, pending: _Pending, reply: Reply) -> None:
        self._send(pending.identity, pending.request_id, reply)

    def _expire(self) -> None:
        now = self.state.clock()
        for p in [p for p in self._batches if p.deadline <= now]:
            self._batches.remove(p)
            self._answer(p, self._batch_reply(p.name, None))
        for p in [p for p in self._key_waits if p.deadline <= now]:
            self._key_waits.remove(p)
            self._answer(p, Reply(True, {"found": False}))

    def _fail_pending(self, detail: str) -> None:
        for p in self._batches + self._key_waits:
            self._answer(p, error("shutdown", detail))
        self._batches.clear()
        self._key_waits.clear()

    def _park(self, request: Request, name: str, wanted: int, learner_version: int = 0
              ) -> _Pending:
        timeout = max(0.0, arg_float(request.args, "timeout_s", 0.0))
        return _Pending(request.identity, request.request_id, name, wanted, learner_version,
                        self.state.clock() + timeout)

    # --- data plane -------------------------------------------------------------------------

    def _acquire(self, request: Request) -> Reply:
        args = request.args
        granted = self.state.acquire(arg_str(args, "producer"),
                                     arg_int(args, "want", minimum=0),
                                     arg_int(args, "engine_version"))
        return Reply(True, {"granted": granted, "version": self.state.version,
                            "run_status": self.state.run_status})

    def _put(self, request: Request) -> Reply:
        reason = self.state.put(arg_str(request.args, "producer"), request.payload)
        if not reason:
            self._serve_batches()
        return Reply(True, {"accepted": not reason, "reason": reason})

    def _release(self, request: Request) -> Reply:
        self.state.release(arg_str(request.args, "producer"),
                           arg_int(request.args, "count", minimum=0))
        return Reply(True, {})

    def _get_batch(self, request: Request) -> None:
        args = request.args
        count = arg_int(args, "count", minimum=1)
        if count > self.config.max_groups:
            raise ProtocolError("args", f"count {count} > max_groups {self.config.max_groups}")
        self._batches.append(self._park(request, arg_str(args, "consumer"), count,
                                        arg_int(args, "learner_version")))
        self._serve_batches()
        self._expire()  # a zero timeout answers now
        return None

    def _serve_batches(self) -> None:
        """Answer parked batch requests in arrival order, each as soon as it can be filled."""
        for p in list(self._batches):
            groups = self.state.take(p.name, p.wanted, p.learner_version)
            if groups is not None:
                self._batches.remove(p)
                self._answer(p, self._batch_reply(p.name, groups))

    def _batch_reply(self, consumer: str, groups: list[QueuedGroup] | None) -> Reply:
        body: dict[str, Any] = {"found": groups is not None,
                                "count": len(groups) if groups else 0,
                                "dropped_stale": self.state.pop_dropped(consumer) if groups
                                else 0, "stats": self.state.batch_stats()}
        return Reply(True, body, [f for g in groups or () for f in g.frames])

    # --- control plane ----------------------------------------------------------------------

    def _publish_version(self, request: Request) -> Reply:
        self.state.publish_version(arg_int(request.args, "version", minimum=0))
        return Reply(True, {"version": self.state.version})

    def _heartbeat(self, request: Request) -> Reply:
        args = request.args
        self.state.heartbeat(arg_str(args, "member"), arg_str(args, "role", ""),
                             arg_dict(args, "info"))
        return Reply(True, {"version": self.state.version, "run_status": self.state.run_status})

    def _set_key(self, request: Request) -> Reply:
        key = arg_str(request.args, "key")
        seq = self.state.set_key(key, arg_dict(request.args, "value"))
        for p in [p for p in self._key_waits if p.name == key and p.wanted < seq]:
            self._key_waits.remove(p)
            self._answer(p, self._key_reply(key, p.wanted))
        return Reply(True, {"seq": seq})

    def _get_key(self, request: Request) -> Reply | None:
        key = arg_str(request.args, "key")
        newer_than = arg_int(request.args, "newer_than", 0)
        if self.state.keys.get(key, newer_than) is not None:
            return self._key_reply(key, newer_than)
        self._key_waits.append(self._park(request, key, newer_than))
        self._expire()
        return None

    def _key_reply(self, key: str, newer_than: int) -> Reply:
        entry = self.state.keys.get(key, newer_than)
        if entry is None:
            return Reply(True, {"found": False})
        return Reply(True, {"found": True, "seq": entry[0], "value": entry[1]})

    def _status(self, request: Request) -> Reply:
        waiting = {"get_batch": len(self._batches), "get_key": len(self._key_waits)}
        return Reply(True, {**self.state.status(), "bad_requests": dict(self.bad_requests),
                            "waiting": waiting})

    def _shutdown_cmd(self, request: Request) -> Reply:
        logger.info("shutdown requested")
        self._shutdown = True
        return Reply(True, {})


def start_broker_thread(config: BufferConfig, groups_per_step: int, run_id: str = ""
                        ) -> tuple[str, Callable[[], None]]:
    """Bind a broker and serve it on a daemon thread; returns (address, stop-and-join).

    The socket is bound here and handed to the thread (thread start is a memory barrier, which
    is what ZMQ asks for when a socket changes threads), so the address is ready on return.
    """
    broker = ZmqBroker(config, groups_per_step, run_id)
    address = broker.bind()
    stop = threading.Event()
    thread = threading.Thread(target=broker.serve, args=(stop,), name="zmq-broker", daemon=True)
    thread.start()

    def stop_and_join() -> None:
        stop.set()
        thread.join()
        broker.close()

    return address, stop_and_join
