"""Message framing between :class:`~buffers.zmq_client.ZmqBufferClient` and the broker.

One request, one reply, both ZMQ multipart (the DEALER client talks straight to the ROUTER
broker, so there is no empty delimiter frame)::

    request  [request_id, command, orjson args, *payload]
    reply    [request_id, b"ok" | b"err", orjson body, *payload]

The ROUTER prepends the client's identity frame on receive and strips it on send. A payload
frame is one trajectory group: the 5 frames of :func:`asyncrl.wire.encode_group` packed as
``<u16 count><count × u32 length>`` + the frames (:func:`buffers.packing.pack_group`, each
frame aligned to 8 bytes, so received arrays are aligned). One ZMQ frame per group
rather than five because ZMQ over TCP costs about 10 µs per frame of this size (measured on
loopback: packed groups move ~25 % faster than multipart ones). The broker validates and
forwards the packed bytes without re-encoding them, and nothing is ever unpickled.

The request id lets a client discard late replies to requests it already gave up on.

Frames may arrive as ``zmq.Frame`` objects (``copy=False``): the small routing and argument
frames are turned into bytes here, the payload is passed on untouched (no copy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from asyncrl.wire import WireError, oversized
from buffers.group_check import GroupFacts, check_packed
from buffers.packing import pack_group, unpack_group
from buffers.protocol import RUN_STATUS_KEY

__all__ = ["pack_group", "unpack_group"]  # re-exported: the packed frame is this protocol's

OK = b"ok"
ERR = b"err"
GUARDED = frozenset({"shutdown", "publish_version", "restore_progress"})
"""Commands that change the run, which the broker serves only with the run's token
(:mod:`buffers.run_token`): stopping the broker, moving the learner's version (it never goes
back, so a forged one would stall the run for good), taking progress over. A ``set_key`` of
the run's status (done, running again) is guarded too (:func:`needs_token`). ZMQ has no reset
command: a fresh run is a fresh broker, its spill file set aside."""
TOKEN_ARG = "token"
REFUSED_ARG = "oversized"  # a put's groups its client refused to send (:func:`arg_refusals`)


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


def decode_request(frames: Sequence[bytes], max_args_bytes: int | None = None) -> Request:
    """Parse what the ROUTER received; raises :class:`ProtocolError` when malformed, or
    ``oversized`` when its arguments are over ``max_args_bytes`` (not parsed then).

    Callers can still answer a malformed request if it has at least identity and request id.
    """
    if len(frames) < 4:
        raise ProtocolError("frames", f"expected at least 4 frames, got {len(frames)}")
    args_bytes = memoryview(frames[3]).nbytes
    if max_args_bytes is not None and args_bytes > max_args_bytes:
        raise ProtocolError("oversized", f"request arguments of {args_bytes} bytes > "
                                         f"buffer.max_message_bytes {max_args_bytes}")
    identity, request_id, command, args = (_bytes(f) for f in frames[:4])
    try:
        name = command.decode("ascii")
    except UnicodeDecodeError:
        raise ProtocolError("command", "command is not ASCII") from None
    return Request(identity=identity, request_id=request_id, command=name,
                   args=_loads_object(args, "args"), payload=list(frames[4:]))


def _bytes(frame: Any) -> bytes:
    """``zmq.Frame.bytes`` is cached by pyzmq; plain bytes pass through."""
    value = getattr(frame, "bytes", frame)
    return value if isinstance(value, bytes) else bytes(value)


def encode_reply(identity: bytes, request_id: bytes, reply: Reply) -> list[bytes]:
    return [identity, request_id, OK if reply.ok else ERR, dumps(reply.body), *reply.payload]


def decode_reply(frames: Sequence[bytes]) -> tuple[bytes, Reply]:
    """Parse what the DEALER received into (request id, reply)."""
    status = _bytes(frames[1]) if len(frames) >= 3 else b""
    if status not in (OK, ERR):
        raise ProtocolError("frames", f"malformed reply of {len(frames)} frames")
    body = _loads_object(_bytes(frames[2]), "reply body")
    return _bytes(frames[0]), Reply(ok=status == OK, body=body, payload=list(frames[3:]))


def check_put(payload: Sequence[Any], max_bytes: int) -> GroupFacts:
    """Validate a put's payload (one packed group), its size first, before anything else."""
    if len(payload) == 1:
        return check_packed(payload[0], max_bytes)
    nbytes = sum(memoryview(f).nbytes for f in payload)
    if nbytes > max_bytes:
        raise oversized(nbytes, max_bytes)
    raise WireError("frames", f"a put carries 1 packed group, not {len(payload)}")


def needs_token(command: str, args: dict[str, Any]) -> bool:
    """Whether the broker serves this request only with the run's token (:data:`GUARDED`)."""
    return command in GUARDED or (command == "set_key" and args.get("key") == RUN_STATUS_KEY)


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


def arg_str_list(args: dict[str, Any], name: str) -> list[str]:
    value = args.get(name)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ProtocolError("args", f"{name!r} must be a list of strings")
    return value


def arg_float(args: dict[str, Any], name: str, default: float | None = None) -> float:
    value = args.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProtocolError("args", f"{name!r} must be a number, got {value!r}")
    return float(value)


def arg_refusals(args: dict[str, Any], count: int) -> dict[int, int]:
    """A put's groups that its client refused to send, over ``max_message_bytes``: payload
    index → the group's packed size (the frame at that index is an empty placeholder)."""
    value = args.get(REFUSED_ARG, [])
    refused: dict[int, int] = {}
    for item in value if isinstance(value, list) else [value]:  # not a list: refused below
        if not (isinstance(item, list) and len(item) == 2 and
                all(isinstance(v, int) and not isinstance(v, bool) for v in item) and
                0 <= item[0] < count and item[1] >= 0):
            raise ProtocolError("args", f"{REFUSED_ARG!r} must be [index, bytes] pairs, each "
                                        f"index one of the {count} payload frames")
        refused[item[0]] = item[1]
    return refused


def arg_dict(args: dict[str, Any], name: str) -> dict[str, Any]:
    value = args.get(name, {})
    if not isinstance(value, dict):
        raise ProtocolError("args", f"{name!r} must be an object, got {type(value).__name__}")
    return value
