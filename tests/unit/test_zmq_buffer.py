"""The embedded ZMQ broker and its client, end to end over real sockets on loopback."""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import orjson
import pytest
import zmq

from asyncrl.config.schema import BufferConfig
from asyncrl.wire import TrajectoryGroup, encode_group
from buffers import Buffer, ControlPlane, PutResult
from buffers.zmq_broker import ZmqBroker, start_broker_thread
from buffers.zmq_client import ZmqBufferClient
from buffers.zmq_protocol import BrokerError, oldest_version, pack_group

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
        config = BufferConfig(port=0, **{"max_staleness": 1, **overrides})
        address, stop = start_broker_thread(config, groups_per_step)
        stops.append(stop)
        return address

    yield start
    for stop in stops:
        stop()


@pytest.fixture
def client() -> Iterator[Callable[..., ZmqBufferClient]]:
    clients: list[ZmqBufferClient] = []

    def open_client(address: str, timeout_s: float = 5.0) -> ZmqBufferClient:
        clients.append(ZmqBufferClient(address, timeout_s=timeout_s))
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


def test_batch_waits_until_count_groups_exist(broker, client):
    address = broker(groups_per_step=4)
    producer, consumer = client(address), client(address)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(consumer.get_batch, "learner", 3, 0, 10.0)
        eventually(lambda: producer.status()["waiting"]["get_batch"] == 1)
        producer.put("w", make_group("a"))
        producer.put("w", make_group("b"))
        assert producer.status()["waiting"]["get_batch"] == 1  # 2 < 3: still parked
        producer.put("w", make_group("c"))
        producer.put("w", make_group("d"))
        batch = future.result(timeout=5)
    assert [g.group_id for g in batch.groups] == ["a", "b", "c"]
    assert producer.status()["queued"] == 1


def test_get_batch_times_out_with_none_and_consumes_nothing(broker, client):
    c = client(broker())
    c.put("w", make_group("a"))
    start = time.monotonic()
    assert c.get_batch("learner", 2, 0, timeout_s=0.2) is None
    assert 0.2 <= time.monotonic() - start < 2.0
    assert c.get_batch("learner", 2, 0, timeout_s=0.0) is None
    assert c.status()["depth"] == 1


def test_gate_arithmetic_end_to_end(broker, client):
    c = client(broker(groups_per_step=2, max_staleness=1))
    assert c.acquire("w", 10, 0).granted == 4  # (V + s + 1) * gps = 4 at V=0
    assert c.acquire("w", 10, 0).granted == 0
    status = c.status()
    assert not status["gate_open"] and status["gate_allowance"] == 0
    assert status["gate_closed_s"] > 0
    for i in range(4):
        c.put("w", make_group(f"g{i}"))
    assert c.acquire("w", 10, 0).granted == 0  # accepted counts too, consumed or not
    c.publish_version(1)
    grant = c.acquire("w", 10, 1)
    assert (grant.granted, grant.version) == (2, 1)
    c.release("w", 2)  # e.g. both filtered out
    assert c.status()["in_flight"] == 0
    assert c.acquire("w", 1, 1).granted == 1
    c.publish_version(3)
    assert c.acquire("w", 10, 3).granted == 10 - 4 - 1
    with pytest.raises(BrokerError, match="behind"):
        c.publish_version(2)


def test_max_groups_bounds_grants(broker, client):
    c = client(broker(groups_per_step=8, max_groups=3))
    assert c.acquire("w", 10, 0).granted == 3
    c.put("w", make_group("a"))
    assert c.acquire("w", 10, 0).granted == 0  # depth 1 + in flight 2 = max_groups


def test_engine_too_stale_may_not_start(broker, client):
    c = client(broker(max_staleness=1))
    c.publish_version(3)
    assert c.acquire("w", 1, engine_version=1).granted == 0  # 3 - 1 > s
    assert c.acquire("w", 1, engine_version=2).granted == 1


def test_stale_groups_are_dropped_counted_and_never_served(broker, client):
    c = client(broker(max_staleness=1))
    c.put("w", make_group("old", versions=[2, 0]))  # oldest token is what counts
    c.put("w", make_group("fresh", version=2))
    c.put("w", make_group("ok", version=1))
    batch = c.get_batch("learner", 2, learner_version=2, timeout_s=1.0)
    assert [g.group_id for g in batch.groups] == ["fresh", "ok"]
    assert batch.dropped_stale == 1
    c.ack("learner", batch)  # consumption (and its staleness) counts at the ack
    status = c.status()
    assert status["dropped_stale"] == 1 and status["consumed"] == 2
    assert status["staleness_hist"] == {"0": 1, "1": 1}
    assert c.get_batch("learner", 1, 2, timeout_s=0.1) is None


def test_run_done_stops_grants_and_puts(broker, client):
    c = client(broker())
    c.acquire("w", 1, 0)
    assert c.set_key("run/status", {"status": "done"}) == 1
    grant = c.acquire("w", 1, 0)
    assert (grant.granted, grant.run_status) == (0, "done")
    assert c.heartbeat("w", "rollout", {})["run_status"] == "done"
    assert c.put("w", make_group("late")) == PutResult(accepted=False, reason="run")
    status = c.status()
    assert status["run_status"] == "done" and not status["gate_open"]
    with pytest.raises(BrokerError):
        c.set_key("run/status", {"status": "paused"})


def test_put_many_pipelines_puts_and_keeps_their_order(broker, client):
    address = broker(groups_per_step=8, max_groups=3)
    producer, learner = client(address), client(address)
    groups = [make_group(f"g{i}") for i in range(6)]
    with ThreadPoolExecutor(1) as pool:  # 6 puts into room for 3: the rest wait their turn
        future = pool.submit(producer.put_many, "w", groups, 4)
        taken = []
        while len(taken) < 6:
            batch = learner.get_batch("l", 1, 0, timeout_s=5.0)
            learner.ack("l", batch)
            taken += [g.group_id for g in batch.groups]
        assert all(r.accepted for r in future.result(timeout=5))
    assert taken == [g.group_id for g in groups]
    assert learner.status()["backpressure"]["waits"] >= 1


def _bad_group_frames() -> dict[str, list[bytes]]:
    good = encode_group(make_group("bad"))
    header = orjson.loads(good[0])
    return {
        "truncated": good[:4],
        "short_array": [*good[:1], good[1][:-1], *good[2:]],
        "nan_reward": encode_group(make_group("nan", reward=math.nan)),
        "schema": [orjson.dumps({**header, "schema": 99}), *good[1:]],
    }


def test_rejections_are_counted_by_reason_and_broker_keeps_serving(broker, client):
    c = client(broker(groups_per_step=8))
    c.acquire("w", 4, 0)
    reasons = {name: c.put_frames("w", frames) for name, frames in _bad_group_frames().items()}
    assert not any(r.accepted for r in reasons.values())
    assert reasons["truncated"].reason == "frames"
    assert reasons["short_array"].reason == "length"
    assert reasons["schema"].reason == "schema"
    # orjson writes NaN as null, so a NaN reward arrives as a bad header field
    assert reasons["nan_reward"].reason in {"reward", "header"}
    status = c.status()
    assert status["rejected"] == dict(Counter(r.reason for r in reasons.values()))
    assert status["in_flight"] == 0 and status["accepted"] == 0  # the slots were used up
    assert c.put("w", make_group("good")).accepted
    assert c.get_batch("l", 1, 0, timeout_s=1.0).groups[0].group_id == "good"


def test_malformed_packing_is_rejected_as_frames(broker, client):
    c = client(broker())
    packed = pack_group(encode_group(make_group("x")))
    for payload in ([packed[:-1]], [packed, packed], [b"\x05"], []):
        reply = c._call("put", {"producer": "w"}, payload).body
        assert (reply["accepted"], reply["reason"]) == (False, "frames")
    assert c.status()["rejected"] == {"frames": 4}


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


def test_heartbeat_timeout_releases_a_dead_producers_in_flight(broker, client):
    c = client(broker(groups_per_step=2, max_staleness=0, heartbeat_timeout_s=0.3))
    c.heartbeat("dead", "rollout", {"engine_version": 0})
    assert c.acquire("dead", 2, 0).granted == 2
    assert c.acquire("alive", 2, 0).granted == 0

    def alive_gets_slots() -> bool:
        return c.acquire("alive", 2, 0).granted == 2  # also keeps "alive" alive

    eventually(alive_gets_slots)
    members = c.status()["members"]
    assert members["dead"]["alive"] is False and members["dead"]["in_flight"] == 0
    assert members["dead"]["info"] == {"engine_version": 0}
    assert members["alive"]["alive"] is True and members["alive"]["in_flight"] == 2
    c.heartbeat("dead", "rollout", {})
    assert c.status()["members"]["dead"]["alive"] is True


def test_get_key_long_poll_wakes_on_set(broker, client):
    address = broker()
    waiter, setter = client(address), client(address)
    assert waiter.get_key("rdzv") is None
    assert waiter.get_key("rdzv", timeout_s=0.1) is None
    assert setter.set_key("rdzv", {"epoch": 1}) == 1
    assert waiter.get_key("rdzv") == (1, {"epoch": 1})
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(waiter.get_key, "rdzv", 1, 10.0)
        eventually(lambda: setter.status()["waiting"]["get_key"] == 1)
        start = time.monotonic()
        assert setter.set_key("rdzv", {"epoch": 2}) == 2
        assert future.result(timeout=5) == (2, {"epoch": 2})
    assert time.monotonic() - start < 2.0
    assert setter.status()["keys"] == ["rdzv"]


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
    broker = ZmqBroker(BufferConfig(port=0), groups_per_step=1)
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
    broker = ZmqBroker(BufferConfig(port=0), groups_per_step=1)
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
def test_oldest_version_matches_the_wire_definition(versions):
    group = make_group("v")
    group.versions = np.asarray(versions, dtype="<i4")
    assert oldest_version(group.versions) == group.min_version()
