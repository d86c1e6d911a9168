"""The embedded ZMQ broker and its client, end to end over real sockets on loopback.

What every backend must do (gate, drops, long polls, heartbeats, redelivery, backpressure) is
tested once, against both, in ``tests/buffers/``; here only what is the ZMQ broker's own: its
framing and hostile input, parking, receipts, in-thread start and shutdown.
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import zmq

from asyncrl.config.schema import BufferConfig, ZmqBufferConfig
from asyncrl.wire import TrajectoryGroup, decode_group, encode_group
from buffers import Buffer, ControlPlane, PutResult
from buffers.zmq_broker import ZmqBroker, start_broker_thread
from buffers.zmq_client import ZmqBufferClient
from buffers.zmq_protocol import BrokerError, pack_group, unpack_group

pytestmark = pytest.mark.timeout(60)


def make_group(name: str, version: int = 0, versions: list[int] | None = None,
               reward: float = 1.0, generated: int = 2) -> TrajectoryGroup:
    """Two samples of 2 prompt + ``generated`` tokens, generated at ``versions`` (or all at
    ``version``)."""
    gen = versions or [version] * generated
    samples = [{"tokens": list(range(5, 7 + len(gen))), "logprobs": [0.0, 0.0, *[-0.5] * len(gen)],
                "loss_mask": [0, 0, *[1] * len(gen)], "versions": [-1, -1, *gen],
                "reward": reward, "finish_reason": "stop"} for _ in range(2)]
    return TrajectoryGroup.from_samples(name, f"prompt-{name}", samples)


def eventually(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll a condition the broker reaches on its own clock (heartbeat expiry, parking)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


@pytest.fixture
def broker() -> Iterator[Callable[..., str]]:
    """Start brokers on free ports: ``broker(groups_per_step=2, **BufferConfig fields)``."""
    stops: list[Callable[[], None]] = []

    def start(groups_per_step: int = 2, **overrides: Any) -> str:
        config = BufferConfig(**{"max_staleness": 1, "zmq": ZmqBufferConfig(port=0), **overrides})
        address, stop = start_broker_thread(config, groups_per_step)
        stops.append(stop)
        return address

    yield start
    for stop in stops:
        stop()


@pytest.fixture
def client() -> Iterator[Callable[..., ZmqBufferClient]]:
    clients: list[ZmqBufferClient] = []

    def open_client(address: str, timeout_s: float = 5.0, **kwargs: Any) -> ZmqBufferClient:
        clients.append(ZmqBufferClient(address, timeout_s=timeout_s, **kwargs))
        return clients[-1]

    yield open_client
    for c in clients:
        c.close()


def test_put_then_get_in_fifo_order(broker, client):
    c = client(broker())
    assert isinstance(c, Buffer) and isinstance(c, ControlPlane)
    assert c.acquire("w", 3, 0).granted == 3
    for i in range(3):
        assert c.put("w", make_group(f"g{i}")).accepted
    batch = c.get_batch("learner", 2, 0, timeout_s=1.0)
    assert batch is not None and [g.group_id for g in batch.groups] == ["g0", "g1"]
    stats = batch.stats  # served but not acked: still held (pending), not yet consumed
    assert (stats["depth"], stats["queued"], stats["pending"], stats["consumed"]) == (3, 1, 2, 0)
    assert batch.stats["in_flight"] == 0 and batch.dropped_stale == 0
    assert len(set(batch.receipts)) == 2
    c.ack("learner", batch)
    status = c.status()
    assert (status["depth"], status["pending"], status["consumed"]) == (1, 0, 2)
    batch = c.get_batch("learner", 1, 0, timeout_s=1.0)
    assert [g.group_id for g in batch.groups] == ["g2"]
    assert batch.groups[0].rewards == [1.0, 1.0] and batch.groups[0].min_version() == 0


def test_put_many_pipelines_puts_and_keeps_their_order(broker, client):
    address = broker(groups_per_step=8, max_groups=3)
    producer, learner = client(address, put_window=4), client(address)
    groups = [make_group(f"g{i}") for i in range(6)]
    with ThreadPoolExecutor(1) as pool:  # 6 puts into room for 3: the rest wait their turn
        future = pool.submit(producer.put_many, "w", groups)
        taken = []
        while len(taken) < 6:
            batch = learner.get_batch("l", 1, 0, timeout_s=5.0)
            learner.ack("l", batch)
            taken += [g.group_id for g in batch.groups]
        assert all(r.accepted for r in future.result(timeout=5))
    assert taken == [g.group_id for g in groups]
    assert learner.status()["backpressure"]["waits"] >= 1


def test_io_threads_sets_the_brokers_zmq_context_and_it_serves(broker, client):
    config = BufferConfig(zmq=ZmqBufferConfig(port=0, io_threads=2))
    owned = ZmqBroker(config, groups_per_step=1)
    try:
        assert owned._context.get(zmq.IO_THREADS) == 2
    finally:
        owned.close()
    with pytest.raises(ValueError, match="io_threads"):
        ZmqBufferConfig(io_threads=0)
    address = broker(groups_per_step=4, zmq=ZmqBufferConfig(port=0, io_threads=2))
    producers, learner = [client(address) for _ in range(2)], client(address)
    for p, producer in enumerate(producers):
        assert producer.acquire(f"w{p}", 4, 0).granted == 4
        groups = [make_group(f"w{p}-g{i}") for i in range(4)]
        assert all(r.accepted for r in producer.put_many(f"w{p}", groups))
    batch = learner.get_batch("l", 8, 0, timeout_s=5.0)
    names = [g.group_id for g in batch.groups]
    assert sorted(names) == sorted(f"w{p}-g{i}" for p in range(2) for i in range(4))
    for p in range(2):  # each producer's groups in its order
        assert [n for n in names if n.startswith(f"w{p}-")] == [f"w{p}-g{i}" for i in range(4)]


def test_malformed_packing_is_rejected_as_frames(broker, client):
    c = client(broker())
    packed = pack_group(encode_group(make_group("x")))
    for payload in ([packed[:-1]], [packed, packed], [b"\x05"], []):
        reply = c._call("put", {"producer": "w"}, payload).body
        assert (reply["accepted"], reply["reason"]) == (False, "frames")
    assert c.status()["rejected"] == {"frames": 4}


def test_put_many_is_one_request_with_a_result_per_group_in_order(broker, client):
    c = client(broker(groups_per_step=8))
    good = [pack_group(encode_group(make_group(f"g{i}"))) for i in range(2)]
    reply = c._call("put_many", {"producer": "w"}, [good[0], b"\x05", good[1]]).body
    assert reply == {"results": [[True, ""], [False, "frames"], [True, ""]]}
    assert c._call("put_many", {"producer": "w"}).body == {"results": []}
    batch = c.get_batch("l", 2, 0, timeout_s=5.0)
    assert [g.group_id for g in batch.groups] == ["g0", "g1"]
    assert c.status()["rejected"] == {"frames": 1}


def test_put_many_chunks_requests_by_bytes(broker, client, monkeypatch):
    monkeypatch.setattr("buffers.zmq_client.PUT_CHUNK_BYTES", 1)  # one group per request
    address = broker(groups_per_step=8)
    producer, learner = client(address, put_window=2), client(address)
    assert all(r.accepted for r in producer.put_many("w", [make_group(f"g{i}")
                                                           for i in range(5)]))
    assert [g.group_id for g in learner.get_batch("l", 5, 0, timeout_s=5.0).groups] == \
        [f"g{i}" for i in range(5)]


def test_packed_groups_have_aligned_arrays_and_legacy_packing_still_reads():
    frames = encode_group(make_group("x"))
    views = unpack_group(pack_group(frames))
    assert [bytes(v) for v in views] == frames
    group = decode_group(views)
    assert all(a.flags.aligned for a in (group.tokens, group.logprobs, group.versions))
    legacy = struct.pack(f"<H{len(frames)}I", len(frames), *map(len, frames)) + b"".join(frames)
    assert [bytes(v) for v in unpack_group(legacy)] == frames


def test_garbage_requests_get_errors_and_never_crash_the_broker(broker, client):
    address = broker()
    garbage = [[b"x"], [b"id", b"\xff\xfe", b"{}"], [b"id", b"put", b"not json"],
               [b"id", b"nosuch", b"{}"], [b"id", b"acquire", b'{"want": "x"}'],
               [b"id", b"acquire", b"[1]"], [b"id", b"get_batch", b'{"count": 0}'],
               [b"id", b"put", b'{"producer": 1}', b"\x00" * 7], [b"\x00" * 300] * 9]
    context = zmq.Context()
    raw = context.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(address)
    try:
        for frames in garbage:
            raw.send_multipart(frames)
            assert raw.poll(5000), f"no reply to {frames[:3]!r}"
            assert raw.recv_multipart()[1] == b"err"
    finally:
        raw.close()
        context.term()
    c = client(address)
    with pytest.raises(BrokerError, match="nosuch"):
        c._call("nosuch", {})
    status = c.status()
    assert sum(status["bad_requests"].values()) == len(garbage) + 1
    assert "internal" not in status["bad_requests"]
    assert c.put("w", make_group("still-fine")).accepted


def test_status_has_every_documented_key(broker, client):
    c = client(broker())
    c.heartbeat("learner-0", "learner", {"step": 0})
    status = c.status()
    expected = {"version", "run_status", "run_id", "max_staleness", "groups_per_step",
                "max_groups", "depth", "queued", "pending", "redelivered", "acks_unknown",
                "held_bytes", "accepted", "in_flight", "consumed", "dropped_stale",
                "rejected", "gate_open", "gate_allowance", "gate_closed_s", "staleness_hist",
                "members", "uptime_s", "keys", "spill", "backpressure", "waiting", "auth"}
    assert expected <= status.keys()
    assert set(status["members"]["learner-0"]) >= {"role", "alive", "last_seen_s_ago", "info"}
    assert status["gate_open"] is True and status["gate_allowance"] == 4


def test_shutdown_command_ends_serve_and_fails_pending_polls():
    broker = ZmqBroker(BufferConfig(zmq=ZmqBufferConfig(port=0)), groups_per_step=1)
    address = broker.bind()
    thread = threading.Thread(target=broker.serve, daemon=True)
    thread.start()
    with ZmqBufferClient(address, timeout_s=5) as waiter, \
            ZmqBufferClient(address, timeout_s=5) as admin, ThreadPoolExecutor(1) as pool:
        future = pool.submit(waiter.get_batch, "learner", 1, 0, 30.0)
        eventually(lambda: admin.status()["waiting"]["get_batch"] == 1)
        admin.shutdown()
        thread.join(timeout=5)
        assert not thread.is_alive()
        with pytest.raises(BrokerError, match="shutting down"):
            future.result(timeout=5)
    broker.close()


def test_timeout_names_broker_and_recovers_with_a_fresh_socket():
    broker = ZmqBroker(BufferConfig(zmq=ZmqBufferConfig(port=0)), groups_per_step=1)
    address = broker.bind()  # bound but not serving yet: requests queue up unanswered
    stop = threading.Event()
    thread = threading.Thread(target=broker.serve, args=(stop,), daemon=True)
    with ZmqBufferClient(address, timeout_s=0.2) as c:
        with pytest.raises(TimeoutError, match=f"{address}.*'status'"):
            c.status()
        thread.start()
        assert c.status()["version"] == 0  # the late reply went to the discarded socket
    start = time.monotonic()
    stop.set()
    thread.join(timeout=5)
    assert time.monotonic() - start < 1.0  # the stop event is noticed within one poll
    broker.close()


# --- at-least-once: acks and redelivery ----------------------------------------------------

def test_unacked_groups_are_redelivered_first_and_acks_are_idempotent(broker, client):
    address = broker(groups_per_step=8, reclaim_idle_s=0.3)
    c, other = client(address), client(address)
    for name in "abcd":
        c.put("w", make_group(name))
    dead = c.get_batch("dead-learner", 2, 0, timeout_s=1.0)  # never acked
    assert [g.group_id for g in dead.groups] == ["a", "b"]
    assert c.status()["pending"] == 2
    eventually(lambda: c.status()["redelivered"] == 2)
    status = c.status()
    assert (status["pending"], status["queued"], status["depth"]) == (0, 4, 4)
    batch = other.get_batch("learner", 3, 0, timeout_s=1.0)
    assert [g.group_id for g in batch.groups] == ["a", "b", "c"]  # oldest first, in front
    other.ack("learner", batch)
    other.ack("learner", batch)  # twice: harmless, counted
    c.ack("dead-learner", dead)  # late ack of groups already acked by another consumer
    status = c.status()
    assert (status["consumed"], status["depth"], status["acks_unknown"]) == (3, 1, 5)


def test_late_ack_settles_a_group_waiting_for_redelivery(broker, client):
    c = client(broker(reclaim_idle_s=0.2))
    c.put("w", make_group("slow"))
    c.put("w", make_group("next"))
    batch = c.get_batch("slow-learner", 1, 0, timeout_s=1.0)
    eventually(lambda: c.status()["redelivered"] == 1)
    c.ack("slow-learner", batch)  # slow, not dead: its ack still counts, no second delivery
    assert c.status()["consumed"] == 1
    assert [g.group_id for g in c.get_batch("l", 1, 0, timeout_s=1.0).groups] == ["next"]
    assert c.get_batch("l", 1, 0, timeout_s=0.0) is None


def test_ack_rejects_malformed_receipts_and_ignores_foreign_ones(broker, client):
    c = client(broker())
    with pytest.raises(BrokerError, match="receipts"):
        c._call("ack", {"consumer": "l", "receipts": [1, 2]})
    c._call("ack", {"consumer": "l", "receipts": ["nope", "0123:1", ":", ""]})
    assert c.status()["acks_unknown"] == 4


# --- bounded memory: backpressure and oversized groups --------------------------------------

def test_full_buffer_makes_puts_wait_until_an_ack_makes_room(broker, client):
    address = broker(groups_per_step=8, max_groups=2)
    producer, learner = client(address), client(address)
    producer.put("w", make_group("a"))
    producer.put("w", make_group("b"))
    batch = learner.get_batch("l", 2, 0, timeout_s=1.0)  # pending still counts as held
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(producer.put, "w", make_group("c"))
        eventually(lambda: learner.status()["waiting"]["put"] == 1)
        assert not future.done()
        learner.ack("l", batch)
        assert future.result(timeout=5).accepted
    status = learner.status()
    assert (status["depth"], status["accepted"], status["backpressure"]["waits"]) == (1, 3, 1)


def test_put_into_a_full_buffer_times_out_and_is_not_accepted(broker, client):
    address = broker(groups_per_step=8, max_groups=1)
    c = client(address, timeout_s=0.3)
    c.put("w", make_group("a"))
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="waited for room"):
        c.put("w", make_group("b"))
    assert time.monotonic() - start < 2.0
    status = c.status()  # the same socket still works: the broker answered the timeout
    assert (status["accepted"], status["waiting"]["put"]) == (1, 0)
    assert status["backpressure"]["expired"] == 1


@pytest.mark.parametrize("read", ["status", "get_keys"])
def test_safe_requests_are_resent_until_a_restarted_broker_answers(read):
    """A broker restart at the same address: a read sent while it was down (the status, or
    the weight-sync acks the learner's publisher polls) is answered by the new broker. A put
    is never re-sent (``tests/buffers/test_zmq_put_ahead.py``: in doubt at once); one made
    after the drop was heard is not sent before the producer's handshake with the new broker,
    so it is accepted there instead of lost."""
    from asyncrl.net import free_port

    config = BufferConfig(zmq=ZmqBufferConfig(port=free_port()))
    address, stop = start_broker_thread(config, groups_per_step=1)
    restarted: list[Callable[[], None]] = []
    with ZmqBufferClient(address, timeout_s=0.3, reconnect_s=20) as c:
        c.publish_version(3)
        c.set_key("weights/ack/e", {"ok": True})
        c.heartbeat("w", "rollout", {})
        stop()
        timer = threading.Timer(1.0, lambda: restarted.append(
            start_broker_thread(config, groups_per_step=1)[1]))
        timer.start()
        try:  # answered by the new (memory-only) broker
            if read == "status":
                assert c.status()["version"] == 0
            else:
                assert c.get_keys(["weights/ack/e"]) == {}
            assert c.put("w", make_group("after")).accepted
        finally:
            timer.join()
            for stop_new in restarted:
                stop_new()


def test_a_waiter_of_a_lost_broker_sees_the_keys_its_successor_sets():
    """A broker restarted without a spill file has lost its keys; what it sets next must
    still be news to a client that waits for keys newer than the old broker's (a rollout
    worker waiting for the next weight announcement). Numbering again from 1 left such a
    waiter parked for good, and the run stalled."""
    from asyncrl.net import free_port

    config = BufferConfig(zmq=ZmqBufferConfig(port=free_port()))
    address, stop = start_broker_thread(config, groups_per_step=1)
    with ZmqBufferClient(address, timeout_s=5) as c:
        seen = max(c.set_key("weights/announce", {"epoch": e}) for e in range(3))
    stop()
    address, stop = start_broker_thread(config, groups_per_step=1)  # memory only: no keys
    try:
        with ZmqBufferClient(address, timeout_s=5) as waiter, \
                ZmqBufferClient(address, timeout_s=5) as setter:
            with ThreadPoolExecutor(1) as pool:
                parked = pool.submit(waiter.get_key, "weights/announce", seen, 10.0)
                eventually(lambda: setter.status()["waiting"]["get_key"] == 1)  # parked
                new = setter.set_key("weights/announce", {"epoch": 0})
                assert new > seen
                assert parked.result(timeout=10) == (new, {"epoch": 0})
    finally:
        stop()


def test_oversized_groups_are_rejected_and_huge_frames_disconnect_the_peer(broker, client):
    address = broker(groups_per_step=8, max_message_bytes=1024)
    c = client(address)
    big = make_group("big", generated=200)  # ~ 5 kB of frames: over the limit
    assert c.put("w", big) == PutResult(accepted=False, reason="oversized")
    hostile = client(address, timeout_s=0.5)
    with pytest.raises(TimeoutError):  # one 1 MB frame: libzmq drops the connection
        hostile.put_frames("w", [b"\x00" * (1 << 20)])
    assert hostile.status()["rejected"] == {"oversized": 1}  # it reconnects and is served
    assert c.put("w", make_group("small")).accepted


@pytest.mark.parametrize("versions", [[-1, -1], [-1, 3, 2, -1], [0], [7, 2**31 - 1], []])
def test_min_version_is_the_oldest_non_negative_version(versions):
    group = make_group("v")
    group.versions = np.asarray(versions, dtype="<i4")
    generated = [v for v in versions if v >= 0]
    assert group.min_version() == (min(generated) if generated else -1)
