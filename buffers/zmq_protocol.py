"""Message framing between :class:`~buffers.zmq_client.ZmqBufferClient` and the broker.

One request, one reply, both ZMQ multipart (the DEALER client talks straight to the ROUTER
broker, so there is no empty delimiter frame)::

    request  [request_id, command, orjson args, *payload]
    reply    [request_id, b"ok" | b"err", orjson body, *payload]

The ROUTER prepends the client's identity frame on receive and strips it on send. Payloads
are trajectory groups as the 5 raw frames of :func:`asyncrl.wire.encode_group`, so the broker
validates and forwards them without re-encoding, and nothing is ever unpickled.

The request id lets a client discard late replies to requests it already gave up on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

OK = b"ok"
ERR = b"err"
GROUP_FRAMES = 5  # header + 4 arrays, see asyncrl.wire.group


class ProtocolError(ValueError):
    """A request the broker cannot act on; ``reason`` is a short, countable label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class BrokerError(RuntimeError):
    """The broker answered a request with an error (bad arguments, version going back...)."""


@dataclass
class Request:
    identity: bytes
    request_id: bytes
    command: str
    args: dict[str, Any]
    payload: list[bytes] = field(default_factory=list)


@dataclass
class Reply:
    ok: bool
    body: dict[str, Any]
    payload: list[bytes] = field(default_factory=list)


def dumps(value: Any) -> bytes:
    """orjson with numpy support, so metrics dicts holding numpy scalars still travel."""
    return orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY)


def encode_request(request_id: bytes, command: str, args: dict[str, Any],
                   payload: Sequence[bytes] = ()) -> list[bytes]:
    return [request_id, command.encode(), dumps(args), *payload]


def _loads_object(frame: bytes, what: str) -> dict[str, Any]:
    try:
        value = orjson.loads(frame)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError("json", f"{what} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ProtocolError("json", f"{what} is not an object")
    return value


def decode_request(frames: Sequence[bytes]) -> Request:
    """Parse what the ROUTER received; raises :class:`ProtocolError` when malformed.

    Callers can still answer a malformed request if it has at least identity and request id.
    """
    if len(frames) < 4:
        raise ProtocolError("frames", f"expected at least 4 frames, got {len(frames)}")
    identity, request_id, command, args = frames[:4]
    try:
        name = bytes(command).decode("ascii")
    except UnicodeDecodeError:
        raise ProtocolError("command", "command is not ASCII") from None
    return Request(identity=bytes(identity), request_id=bytes(request_id), command=name,
                   args=_loads_object(bytes(args), "args"), payload=list(frames[4:]))


def encode_reply(identity: bytes, request_id: bytes, reply: Reply) -> list[bytes]:
    return [identity, request_id, OK if reply.ok else ERR, dumps(reply.body), *reply.payload]


def decode_reply(frames: Sequence[bytes]) -> tuple[bytes, Reply]:
    """Parse what the DEALER received into (request id, reply)."""
    if len(frames) < 3 or frames[1] not in (OK, ERR):
        raise ProtocolError("frames", f"malformed reply of {len(frames)} frames")
    body = _loads_object(bytes(frames[2]), "reply body")
    return bytes(frames[0]), Reply(ok=frames[1] == OK, body=body, payload=list(frames[3:]))


def error(reason: str, detail: str) -> Reply:
    return Reply(ok=False, body={"reason": reason, "error": detail})


# --- typed argument access: a wrong type is a ProtocolError, never a crash -------------------

def arg_str(args: dict[str, Any], name: str, default: str | None = None) -> str:
    value = args.get(name, default)
    if not isinstance(value, str):
        raise ProtocolError("args", f"{name!r} must be a string, got {value!r}")
    return value


def arg_int(args: dict[str, Any], name: str, default: int | None = None,
            minimum: int | None = None) -> int:
    value = args.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError("args", f"{name!r} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ProtocolError("args", f"{name!r} must be >= {minimum}, got {value}")
    return value


def arg_float(args: dict[str, Any], name: str, default: float | None = None) -> float:
    value = args.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProtocolError("args", f"{name!r} must be a number, got {value!r}")
    return float(value)


def arg_dict(args: dict[str, Any], name: str) -> dict[str, Any]:
    value = args.get(name, {})
    if not isinstance(value, dict):
        raise ProtocolError("args", f"{name!r} must be an object, got {type(value).__name__}")
    return value
