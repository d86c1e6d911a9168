"""Groups over ``buffer.max_message_bytes`` (issue 37): refused by the producer's client before
they are sent, naming the key and the size; counted by the buffer, which also answers and counts
what a foreign peer sends over the limit instead of dropping its connection in silence.

Before: a ZMQ producer's group well over the limit made libzmq drop the connection (the
socket's hard limit was 64 KiB above it), the put raised "the connection dropped", the worker
crash-looped, and the status counted nothing.
"""

from __future__ import annotations

import logging
import re

import orjson
import zmq as pyzmq

from asyncrl.wire import encode_group_views
from buffers.packing import pack_group, packed_size
from buffers.protocol import PutResult
from buffers.zmq_client import _chunks
from tests.buffers import make_group
from tests.buffers.test_contract import ids

LIMIT = 16 << 10
HUGE_TOKENS = 4000  # 2 samples x 4 arrays x 4000 x 4 bytes: ~128 KiB, over LIMIT + 64 KiB


def test_an_oversized_group_is_refused_before_it_is_sent_and_counted(backend, caplog):
    """Within a ``put_many`` the oversized group gets its refusal in its place and the others
    go on; a single ``put`` likewise. The worker sees results, not a dropped connection."""
    caplog.set_level(logging.WARNING)
    c = backend.start(groups_per_step=8, max_message_bytes=LIMIT).client()
    assert c.acquire("w", 4, 0).granted == 4
    groups = [make_group("g0"), make_group("huge", tokens=HUGE_TOKENS), make_group("g1")]
    results = c.put_many("w", groups)
    assert [r.accepted for r in results] == [True, False, True]
    assert results[1].reason == "oversized"
    assert c.put("w", make_group("huge-2", tokens=HUGE_TOKENS)) == \
        PutResult(accepted=False, reason="oversized")
    refusals = [r.getMessage() for r in caplog.records if "'huge" in r.getMessage()]
    assert len(refusals) == 2, caplog.text
    assert re.search(rf"group 'huge' of \d{{6}} bytes is over buffer.max_message_bytes = "
                     rf"{LIMIT}: refused, not sent", refusals[0]), refusals[0]
    status = c.status()
    assert status["rejected"] == {"oversized": 2}
    assert (status["accepted"], status["in_flight"]) == (2, 0)  # every slot was used up
    assert ids(c.get_batch("learner", 2, 0, timeout_s=5.0)) == ["g0", "g1"]


def test_put_many_requests_stay_within_max_message_bytes():
    """Each ``put_many`` request the client sends carries at most ``max_message_bytes`` of
    groups (a refused one travels as its size, in its place)."""
    packed = [pack_group(encode_group_views(make_group(f"g{i}", tokens=300))) for i in range(9)]
    items: list[bytes | int] = [*packed[:4], 123_456, *packed[4:]]
    limit = 3 * len(packed[0]) + 10
    chunks = list(_chunks(iter(items), limit))
    assert [item for chunk in chunks for item in chunk] == items  # in order, nothing lost
    assert all(sum(len(i) for i in chunk if isinstance(i, bytes)) <= limit for chunk in chunks)
    assert [len(chunk) for chunk in chunks] == [3, 4, 3]  # the refused one rides along


def _raw(address: str) -> tuple[pyzmq.Context, pyzmq.Socket]:
    context = pyzmq.Context()
    socket = context.socket(pyzmq.DEALER)
    socket.setsockopt(pyzmq.LINGER, 0)
    socket.connect(address)
    return context, socket


def _ask(socket: pyzmq.Socket, request_id: bytes, command: bytes, args: bytes,
         *payload: bytes) -> tuple[bytes, dict]:
    socket.send_multipart([request_id, command, args, *payload])
    assert socket.poll(10_000), f"no reply to {command!r}: the connection was dropped"
    reply_id, status, body, *_ = socket.recv_multipart()
    assert reply_id == request_id
    return status, orjson.loads(body)


def test_a_raw_oversized_message_is_answered_and_counted_not_dropped(zmq):
    """A peer that is not our client (it sends what it likes): a put of one frame well over
    the limit, and a request whose arguments are, each get a reply and a count. Both are
    over the old hard limit (limit + 64 KiB) and within the new one (2 x limit + 64 KiB)."""
    limit = 256 << 10
    d = zmq.start(groups_per_step=8, max_message_bytes=limit)
    context, socket = _raw(d.address)
    try:
        assert _ask(socket, b"1", b"hello", b'{"member": "raw"}')[0] == b"ok"
        status, body = _ask(socket, b"2", b"put", b'{"producer": "raw", "timeout_s": 5}',
                            bytes(limit + (150 << 10)))
        assert (status, body) == (b"ok", {"accepted": False, "reason": "oversized"})
        padded = b'{"pad": "' + b"x" * (limit + (150 << 10)) + b'"}'
        status, body = _ask(socket, b"3", b"status", padded)
        assert status == b"err" and body["reason"] == "oversized"
        assert "buffer.max_message_bytes" in body["error"]
        counted = d.client().status()
        assert counted["rejected"] == {"oversized": 1}
        assert counted["bad_requests"] == {"oversized": 1}
    finally:
        socket.close()
        context.term()


def test_the_client_checks_the_size_the_broker_checks():
    frames = encode_group_views(make_group("x", tokens=37))
    assert packed_size(frames) == len(pack_group(frames))
    assert packed_size([]) == len(pack_group([]))
