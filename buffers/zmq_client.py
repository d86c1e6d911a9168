"""Client of the embedded ZMQ broker: :class:`~buffers.protocol.BufferClient` over one DEALER.

Not thread-safe, by design (ZMQ sockets are not): open one client per thread. Every request
waits for its reply; a request that times out raises :class:`TimeoutError` and the socket is
replaced, so a late reply can never be mistaken for the answer to a later request (request
ids guard the same thing on a live socket).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, NoReturn

import zmq

from asyncrl.wire import TrajectoryGroup, decode_group, encode_group
from buffers.protocol import Batch, Grant, PutResult
from buffers.zmq_protocol import GROUP_FRAMES, BrokerError, Reply, decode_reply, encode_request

logger = logging.getLogger(__name__)


class ZmqBufferClient:
    """Talks to :class:`~buffers.zmq_broker.ZmqBroker` at ``address`` (``tcp://host:port``)."""

    def __init__(self, address: str, timeout_s: float = 30.0,
                 context: zmq.Context | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._own_context = context is None
        self._context = context or zmq.Context()
        self._next_id = 0
        self._socket = self._connect()

    def _connect(self) -> zmq.Socket:
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDTIMEO, int(self.timeout_s * 1000))
        socket.connect(self.address)
        return socket

    def close(self) -> None:
        self._socket.close(linger=0)
        if self._own_context:
            self._context.term()

    def __enter__(self) -> ZmqBufferClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- one request, one reply -----------------------------------------------------------

    def _call(self, command: str, args: dict[str, Any], payload: Sequence[bytes] = (),
              wait_s: float = 0.0) -> Reply:
        """Send and wait up to ``timeout_s + wait_s`` for the matching reply."""
        self._next_id += 1
        request_id = self._next_id.to_bytes(8, "little")
        try:
            self._socket.send_multipart(encode_request(request_id, command, args, payload))
        except zmq.Again:
            self._timed_out(command, "send")
        deadline = time.monotonic() + self.timeout_s + wait_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._socket.poll(max(1, int(remaining * 1000))):
                self._timed_out(command, "reply")
            reply_id, reply = decode_reply(self._socket.recv_multipart())
            if reply_id == request_id:
                break
            logger.debug("discarding a late reply to request %s", reply_id.hex())
        if not reply.ok:
            raise BrokerError(f"buffer broker {self.address} refused {command}: "
                              f"{reply.body.get('error', reply.body)}")
        return reply

    def _timed_out(self, command: str, stage: str) -> NoReturn:
        self._socket.close(linger=0)
        self._socket = self._connect()
        raise TimeoutError(f"buffer broker {self.address}: no {stage} for {command!r} "
                           f"within {self.timeout_s:.1f}s")

    # --- Buffer -------------------------------------------------------------------------------

    def acquire(self, producer: str, want: int, engine_version: int) -> Grant:
        body = self._call("acquire", {"producer": producer, "want": want,
                                      "engine_version": engine_version}).body
        return Grant(granted=body["granted"], version=body["version"],
                     run_status=body["run_status"])

    def put(self, producer: str, group: TrajectoryGroup) -> PutResult:
        body = self._call("put", {"producer": producer}, encode_group(group)).body
        return PutResult(accepted=body["accepted"], reason=body["reason"])

    def put_frames(self, producer: str, frames: Sequence[bytes]) -> PutResult:
        """Put already-encoded frames as they are (forwarding, and tests of bad input)."""
        body = self._call("put", {"producer": producer}, frames).body
        return PutResult(accepted=body["accepted"], reason=body["reason"])

    def release(self, producer: str, count: int) -> None:
        self._call("release", {"producer": producer, "count": count})

    def get_batch(self, consumer: str, count: int, learner_version: int,
                  timeout_s: float) -> Batch | None:
        reply = self._call("get_batch", {"consumer": consumer, "count": count,
                                         "learner_version": learner_version,
                                         "timeout_s": timeout_s}, wait_s=timeout_s)
        if not reply.body["found"]:
            return None
        frames = reply.payload
        groups = [decode_group(frames[i:i + GROUP_FRAMES])
                  for i in range(0, len(frames), GROUP_FRAMES)]
        return Batch(groups=groups, dropped_stale=reply.body["dropped_stale"],
                     stats=reply.body["stats"])

    # --- ControlPlane -------------------------------------------------------------------------

    def publish_version(self, version: int) -> None:
        self._call("publish_version", {"version": version})

    def heartbeat(self, member: str, role: str, info: dict[str, Any]) -> dict[str, Any]:
        return self._call("heartbeat", {"member": member, "role": role, "info": info}).body

    def set_key(self, key: str, value: dict[str, Any]) -> int:
        return int(self._call("set_key", {"key": key, "value": value}).body["seq"])

    def get_key(self, key: str, newer_than: int = 0,
                timeout_s: float = 0.0) -> tuple[int, dict[str, Any]] | None:
        body = self._call("get_key", {"key": key, "newer_than": newer_than,
                                      "timeout_s": timeout_s}, wait_s=timeout_s).body
        return (int(body["seq"]), body["value"]) if body["found"] else None

    def status(self) -> dict[str, Any]:
        return self._call("status", {}).body

    def shutdown(self) -> None:
        """Ask the broker to stop serving (it answers first)."""
        self._call("shutdown", {})
