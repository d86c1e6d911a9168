"""The buffer contract, run against every backend (``backend`` is "zmq", "redis" and
"redis-cluster") and, but for the tests of one mode's own behaviour, in both staleness modes.

What a rollouter and a learner may rely on whatever carries the groups: FIFO per producer,
the staleness gate and drops, at-least-once delivery with acks (a dead consumer's batch comes
back, an acked one never does), backpressure instead of trimming, surviving a restart of the
broker or of ``redis-server``, many producers and consumers, and bad input rejected with a
counted reason. Servers are real (a ``redis-server``, a broker process) on 127.0.0.1.
"""

from __future__ import annotations

import math
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import orjson
import pytest

from asyncrl.wire import encode_group
from bench.inflight import PutAhead, TakeAhead
from buffers import Batch, Buffer, BufferClient, ControlPlane, PutResult
from buffers.lease import keep_leased
from tests.buffers import eventually, make_group
from tests.buffers.conftest import ROOT, child_env

pytestmark = pytest.mark.timeout(60)

# Tests of what one staleness mode does differently (drops, or the pace wait); the rest of the
# contract holds in both modes and runs in both (``buffer.staleness_mode``).
ONE_MODE = {
    "test_stale_groups_are_dropped_counted_and_never_served",
    "test_batches_taken_ahead_are_served_by_version_and_drop_exactly",
    "test_drop_mode_trains_past_a_group_in_flight_and_drops_it_late",
    "test_pace_mode_waits_for_the_old_group_and_drops_nothing",
    "test_pace_mode_stops_waiting_for_a_released_group",
    "test_pace_mode_stops_waiting_for_a_dead_producers_group",
    "test_pace_mode_serves_a_backlog_that_waiting_cannot_save",
}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """The rest of the contract in pace mode too, on the ZMQ broker and on Redis (34 tests,
    about 15-30 s); the Redis Cluster's copies run only with ``ASYNCRL_FULL_CONTRACT=1``: the
    cluster runs the same Lua scripts as one Redis, and its copies cost as much again, in a
    suite at its 20-min budget. The tests of pace's own behaviour run on every backend."""
    if "backend" in metafunc.fixturenames and metafunc.function.__name__ not in ONE_MODE:
        metafunc.parametrize("staleness_mode", ["drop", "pace"])   # tests/buffers/conftest.py
                                                                   # skips pace on the cluster


def ids(batch: Batch | None) -> list[str]:
    assert batch is not None, "expected a batch"
    return [g.group_id for g in batch.groups]


def take_all(client: BufferClient, total: int, count: int, timeout_s: float = 10.0) -> list[str]:
    """Take and ack batches until ``total`` groups were served."""
    served: list[str] = []
    while len(served) < total:
        batch = client.get_batch("learner", count, 0, timeout_s)
        served += ids(batch)
        client.ack("learner", batch)
    return served


def test_clients_satisfy_both_protocols(backend):
    c = backend.start().client()
    assert isinstance(c, Buffer) and isinstance(c, ControlPlane)


def test_fifo_per_producer_and_oldest_first(backend):
    c = backend.start(groups_per_step=8).client()
    order = [f"{p}-{i}" for i in range(4) for p in "abc"]
    for name in order:
        assert c.put(name[0], make_group(name)).accepted
    assert take_all(c, len(order), count=3) == order
    status = c.status()
    assert (status["depth"], status["consumed"], status["accepted"]) == (0, 12, 12)


def served(client: BufferClient, count: int, version: int) -> list[str]:
    batch = client.get_batch("learner", count, version, timeout_s=5.0)
    names = ids(batch)   # a held take (None) fails here, not in the ack
    client.ack("learner", batch)
    return names


def test_a_late_old_group_is_served_before_fresher_ones_and_not_dropped(backend):
    """Earliest deadline first: groups arrive in the order they finish, not the order the
    gate admitted them. A long-tailed group started at version 0 arrives behind groups of
    version 1 that overtook it; served by arrival it would be consumed a step later and
    dropped as stale, served by version it is consumed while still fresh."""
    c = backend.start(groups_per_step=2, max_staleness=1).client()
    for name in ("a", "b"):
        assert c.put("w1", make_group(name, version=1)).accepted
    assert c.put("w0", make_group("long", version=0)).accepted  # finished last
    assert served(c, 2, version=1) == ["long", "a"]  # staleness 1: still fresh
    assert served(c, 1, version=2) == ["b"]
    assert c.status()["dropped_stale"] == 0  # by arrival, "long" would be: 2 - 0 > 1


def test_equal_versions_keep_arrival_order_and_each_producer_its_own(backend):
    """In ``pace`` a producer's order gives way where keeping it would leave an older group
    to go stale: served after x-new, x-old (v1) would be stale at version 3, so it goes first
    (``buffers.zmq_state.BrokerState._pace_take``)."""
    c = backend.start(groups_per_step=2, max_staleness=1).client()
    for name in ("a", "b", "c"):
        assert c.put("w", make_group(name, version=1)).accepted
    assert served(c, 3, version=1) == ["a", "b", "c"]
    assert c.put("x", make_group("x-new", version=2)).accepted
    assert c.put("x", make_group("x-old", version=1)).accepted  # after x-new: x's order
    assert c.put("y", make_group("y-mid", versions=[1, 2])).accepted  # oldest token: v1
    if backend.staleness_mode == "drop":
        assert served(c, 2, version=2) == ["y-mid", "x-new"]
        assert served(c, 1, version=2) == ["x-old"]
    else:
        assert served(c, 2, version=2) == ["x-old", "y-mid"]
        assert served(c, 1, version=2) == ["x-new"]


def test_batch_waits_until_count_groups_exist(backend):
    d = backend.start(groups_per_step=4)
    producer, consumer = d.client(), d.client()
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(consumer.get_batch, "learner", 3, 0, 20.0)
        producer.put("w", make_group("a"))
        producer.put("w", make_group("b"))
        with pytest.raises(FutureTimeout):
            future.result(timeout=0.3)  # 2 < 3 groups: still waiting
        producer.put("w", make_group("c"))
        producer.put("w", make_group("d"))
        batch = future.result(timeout=10)
    assert ids(batch) == ["a", "b", "c"] and len(batch.receipts) == 3
    consumer.ack("learner", batch)
    assert producer.status()["depth"] == 1


def test_get_batch_times_out_with_none_and_consumes_nothing(backend):
    c = backend.start().client()
    c.put("w", make_group("a"))
    start = time.monotonic()
    assert c.get_batch("learner", 2, 0, timeout_s=0.3) is None
    assert 0.3 <= time.monotonic() - start < 3.0
    assert c.get_batch("learner", 2, 0, timeout_s=0.0) is None
    assert c.status()["depth"] == 1
    c.put("w", make_group("b"))
    assert ids(c.get_batch("learner", 2, 0, timeout_s=5.0)) == ["a", "b"]


def test_gate_arithmetic_end_to_end(backend):
    c = backend.start(groups_per_step=2, max_staleness=1).client()
    assert c.acquire("w", 10, 0).granted == 4  # (V + s + 1) * gps = 4 at V=0
    assert c.acquire("w", 10, 0).granted == 0
    status = c.status()
    assert not status["gate_open"] and status["gate_allowance"] == 0
    eventually(lambda: c.status()["gate_closed_s"] > 0, what="gate_closed_s grows")
    for i in range(4):
        assert c.put("w", make_group(f"g{i}")).accepted
    assert c.acquire("w", 10, 0).granted == 0  # accepted counts too, consumed or not
    c.publish_version(1)
    grant = c.acquire("w", 10, 1)
    assert (grant.granted, grant.version) == (2, 1)
    c.release("w", 2)  # e.g. both filtered out
    assert c.status()["in_flight"] == 0
    assert c.acquire("w", 1, 1).granted == 1
    c.publish_version(3)
    assert c.acquire("w", 10, 3).granted == 10 - 4 - 1
    with pytest.raises(RuntimeError, match="behind"):
        c.publish_version(2)
    assert c.status()["version"] == 3


def test_max_groups_bounds_grants(backend):
    c = backend.start(groups_per_step=3, max_groups=3, max_staleness=7).client()
    assert c.acquire("w", 10, 0).granted == 3
    c.put("w", make_group("a"))
    assert c.acquire("w", 10, 0).granted == 0  # depth 1 + in flight 2 = max_groups


def test_engine_too_stale_may_not_start(backend):
    c = backend.start(max_staleness=1).client()
    c.publish_version(3)
    assert c.acquire("w", 1, engine_version=1).granted == 0  # 3 - 1 > s
    assert c.acquire("w", 1, engine_version=2).granted == 1


def test_stale_groups_are_dropped_counted_and_never_served(backend):
    c = backend.start(max_staleness=1).client()
    c.put("w", make_group("old", versions=[0, 2]))  # the oldest token is what counts
    c.put("w", make_group("fresh", version=2))
    c.put("w", make_group("ok", version=1))
    batch = c.get_batch("learner", 2, learner_version=2, timeout_s=5.0)
    assert ids(batch) == ["fresh", "ok"] and batch.dropped_stale == 1
    c.ack("learner", batch)
    status = c.status()
    assert status["dropped_stale"] == 1 and status["consumed"] == 2 and status["depth"] == 0
    assert status["staleness_hist"] == {"0": 1, "1": 1}
    assert c.get_batch("learner", 1, 2, timeout_s=0.1) is None


def test_batches_taken_ahead_are_served_by_version_and_drop_exactly(backend):
    """A consumer with requests in flight for versions 2 and 3 (ZMQ; Redis serves one at a
    time): the request for 3 must not drop ``a`` (stale at 3, fresh at 2) while the one for
    2 still waits for its second group."""
    d = backend.start(groups_per_step=1, max_staleness=1)
    learner, producer = d.client(), d.client()
    ahead = TakeAhead(learner, "learner", 2, depth=2, timeout_s=10.0)
    assert producer.put("w", make_group("a", version=1)).accepted
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(ahead.take, 2)
        with pytest.raises(FutureTimeout):
            first.result(timeout=0.5)  # one group of two: waiting
        for name in ("b", "c", "d"):
            assert producer.put("w", make_group(name, version=2)).accepted
        batch = first.result(timeout=10)
    assert ids(batch) == ["a", "b"]
    second = ahead.take(3, ack=batch)
    assert ids(second) == ["c", "d"] and second.dropped_stale == 0
    learner.ack("learner", second)
    status = producer.status()
    assert (status["dropped_stale"], status["consumed"], status["depth"]) == (0, 4, 0)


def _old_group_in_flight(backend, mode: str) -> tuple[BufferClient, BufferClient]:
    """s = 1, one group per step. Two groups granted at version 0; one is in and trained,
    the other (``long``) still generating when a version-1 group ``b`` is in at version 1."""
    d = backend.start(groups_per_step=1, max_staleness=1, staleness_mode=mode)
    learner, producer = d.client(), d.client()
    assert producer.acquire("w", 2, 0).granted == 2
    assert producer.put("w", make_group("a", version=0)).accepted
    assert served(learner, 1, version=0) == ["a"]  # leaves long (v0): fresh at v1
    learner.publish_version(1)
    assert producer.acquire("w", 1, 1).granted == 1
    assert producer.put("w", make_group("b", version=1)).accepted
    return learner, producer


def test_drop_mode_trains_past_a_group_in_flight_and_drops_it_late(backend):
    learner, producer = _old_group_in_flight(backend, "drop")
    assert served(learner, 1, version=1) == ["b"]
    assert producer.put("w", make_group("long", version=0)).accepted
    assert learner.get_batch("learner", 1, 2, timeout_s=0.2) is None
    assert learner.status()["dropped_stale"] == 1   # 2 - 0 > s: the long answer is lost


def test_pace_mode_waits_for_the_old_group_and_drops_nothing(backend):
    """Training ``b`` at version 1 would leave ``long`` (granted at 0) stale at version 2:
    the take waits, counted as pace_held_s, until ``long`` is in; then it is served first."""
    learner, producer = _old_group_in_flight(backend, "pace")
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(learner.get_batch, "learner", 1, 1, 20.0)
        with pytest.raises(FutureTimeout):
            waiting.result(timeout=0.5)  # b is there, but the learner may not step past long
        eventually(lambda: producer.status()["pace_held_s"] > 0, what="pace_held_s grows")
        assert producer.put("w", make_group("long", version=0)).accepted
        batch = waiting.result(timeout=10)
    assert ids(batch) == ["long"] and batch.dropped_stale == 0
    assert batch.stats["pace_held_s"] > 0
    learner.ack("learner", batch)
    learner.publish_version(2)
    assert served(learner, 1, version=2) == ["b"]
    status = producer.status()
    assert (status["dropped_stale"], status["consumed"]) == (0, 3)
    assert status["staleness_mode"] == "pace" and status["staleness_hist"] == {"1": 2, "0": 1}


def test_pace_mode_stops_waiting_for_a_released_group(backend):
    learner, producer = _old_group_in_flight(backend, "pace")
    assert learner.get_batch("learner", 1, 1, timeout_s=0.3) is None
    producer.release("w", 1)  # the long one failed: nothing old is in flight any more
    assert served(learner, 1, version=1) == ["b"]
    assert producer.status()["dropped_stale"] == 0


def test_pace_mode_serves_a_backlog_that_waiting_cannot_save(backend):
    """Three version-0 groups put without grants (the gate admits no such backlog): at s = 1
    and one group per step, one of them goes stale whatever the learner does, and waiting
    for the version-0 group in flight would not help (it could only take a queued group's
    place). So the oldest are served, in arrival order whoever put them, and the one left
    over is dropped and counted, as in drop mode. Every take used to be held, and the
    learner never stepped. (Redis served such ties by producer name.)"""
    c = backend.start(groups_per_step=1, max_staleness=1, staleness_mode="pace").client()
    assert c.acquire("w3", 1, 0).granted == 1   # in flight, granted at version 0
    for producer, name in (("w2", "a"), ("w1", "b"), ("w2", "c")):
        assert c.put(producer, make_group(name, version=0)).accepted
    assert served(c, 1, version=0) == ["a"]   # was held: b and c are both due by version 1
    c.publish_version(1)
    assert served(c, 1, version=1) == ["b"]
    c.publish_version(2)
    assert c.get_batch("learner", 1, 2, timeout_s=0.0) is None   # c: stale at 2, dropped
    status = c.status()
    assert (status["dropped_stale"], status["consumed"], status["pace_held_s"]) == (1, 2, 0)


def test_run_done_stops_grants_and_puts(backend):
    c = backend.start().client()
    c.acquire("w", 1, 0)
    assert c.set_key("run/status", {"status": "done"}) >= 1
    grant = c.acquire("w", 1, 0)
    assert (grant.granted, grant.run_status) == (0, "done")
    assert c.heartbeat("w", "rollout", {})["run_status"] == "done"
    assert c.put("w", make_group("late")) == PutResult(accepted=False, reason="run")
    status = c.status()
    assert status["run_status"] == "done" and not status["gate_open"]
    assert status["rejected"] == {"run": 1}
    with pytest.raises(RuntimeError):
        c.set_key("run/status", {"status": "paused"})


def test_puts_waiting_for_room_are_refused_once_the_run_is_done(backend):
    """Not left to wait out request_timeout_s: a TimeoutError there made the rollout role
    report failed workers at the end of a finished run."""
    d = backend.start(groups_per_step=2, max_groups=2, max_staleness=11)
    c, one, many = d.client(), d.client(request_timeout_s=10.0), d.client(request_timeout_s=10.0)
    for i in range(2):
        assert c.put("w", make_group(f"g{i}")).accepted
    with ThreadPoolExecutor(2) as pool:
        single = pool.submit(one.put, "w1", make_group("one"))
        several = pool.submit(many.put_many, "w2", [make_group("a"), make_group("b")])
        with pytest.raises(FutureTimeout):
            several.result(timeout=0.5)  # full: both wait
        c.set_key("run/status", {"status": "done"})
        assert single.result(timeout=5) == PutResult(accepted=False, reason="run")
        assert several.result(timeout=5) == [PutResult(accepted=False, reason="run")] * 2
    assert c.status()["rejected"] == {"run": 3}


def _bad_group_frames() -> dict[str, list[bytes]]:
    good = encode_group(make_group("bad"))
    header = orjson.loads(good[0])
    return {
        "truncated": good[:4],
        "short_array": [*good[:1], good[1][:-1], *good[2:]],
        "nan_reward": encode_group(make_group("nan", reward=math.nan)),
        "schema": [orjson.dumps({**header, "schema": 99}), *good[1:]],
    }


def test_malformed_groups_are_rejected_with_a_counted_reason(backend):
    c = backend.start(groups_per_step=8).client()
    c.acquire("w", 4, 0)
    results = {name: c.put_frames("w", frames) for name, frames in _bad_group_frames().items()}
    assert not any(r.accepted for r in results.values())
    assert results["truncated"].reason == "frames"
    assert results["short_array"].reason == "length"
    assert results["schema"].reason == "schema"
    assert results["nan_reward"].reason in {"reward", "header"}  # orjson writes NaN as null
    status = c.status()
    assert status["rejected"] == dict(Counter(r.reason for r in results.values()))
    assert status["in_flight"] == 0 and status["accepted"] == 0  # the slots were used up
    assert c.put("w", make_group("good")).accepted
    assert ids(c.get_batch("learner", 1, 0, timeout_s=5.0)) == ["good"]


def test_oversized_groups_are_rejected_with_a_counted_reason(backend):
    c = backend.start(max_message_bytes=2048).client()
    c.acquire("w", 2, 0)
    big = make_group("big", tokens=300)  # 2 × 300 int32 tokens alone are 2400 bytes
    assert c.put("w", big) == PutResult(accepted=False, reason="oversized")
    status = c.status()
    assert status["rejected"] == {"oversized": 1} and status["in_flight"] == 1
    assert c.put("w", make_group("small")).accepted
    assert ids(c.get_batch("learner", 1, 0, timeout_s=5.0)) == ["small"]


def test_a_dead_consumers_batch_is_redelivered_and_an_acked_one_never(backend):
    d = backend.start(groups_per_step=4, reclaim_idle_s=0.5)
    producer, dying, survivor = d.client(), d.client(), d.client()
    for i in range(4):
        producer.put("w", make_group(f"g{i}"))
    assert ids(dying.get_batch("learner-a", 2, 0, timeout_s=5.0)) == ["g0", "g1"]
    d.drop(dying)  # gone without acking
    batch = survivor.get_batch("learner-b", 4, 0, timeout_s=10.0)
    assert sorted(ids(batch)) == ["g0", "g1", "g2", "g3"]
    survivor.ack("learner-b", batch)
    assert survivor.get_batch("learner-b", 1, 0, timeout_s=1.5) is None  # > reclaim_idle_s
    status = survivor.status()
    assert (status["consumed"], status["depth"]) == (4, 0)


def test_get_batch_carries_the_previous_batchs_ack(backend):
    """``get_batch(ack=batch)`` acks ``batch`` first, exactly as ``ack`` would, in the same
    request: also when no batch comes back, and the acked groups are never redelivered."""
    d = backend.start(groups_per_step=8, reclaim_idle_s=0.3)
    learner, other = d.client(), d.client()
    for i in range(4):
        learner.put("w", make_group(f"g{i}"))
    first = learner.get_batch("learner", 2, 0, timeout_s=5.0)
    second = learner.get_batch("learner", 2, 0, timeout_s=5.0, ack=first)
    assert ids(first) + ids(second) == ["g0", "g1", "g2", "g3"]
    assert (learner.status()["consumed"], learner.status()["depth"]) == (2, 2)
    assert learner.get_batch("learner", 1, 0, timeout_s=0.2, ack=second) is None
    assert other.get_batch("other", 1, 0, timeout_s=1.0) is None  # > reclaim_idle_s: acked
    status = learner.status()
    assert (status["consumed"], status["depth"], status["redelivered"]) == (4, 0, 0)
    assert status["staleness_hist"] == {"0": 4}


def test_a_live_consumers_batch_is_not_served_twice_within_reclaim_idle(backend):
    d = backend.start(reclaim_idle_s=30.0)
    first, second = d.client(), d.client()
    first.put("w", make_group("a"))
    first.put("w", make_group("b"))
    batch = first.get_batch("learner-a", 2, 0, timeout_s=5.0)
    assert second.get_batch("learner-b", 1, 0, timeout_s=0.3) is None
    first.ack("learner-a", batch)
    assert (first.status()["consumed"], first.status()["depth"]) == (2, 0)


def _one_batch_held(backend, reclaim_idle_s: float) -> tuple[BufferClient, BufferClient, Batch]:
    """(holder, other, batch): ``holder`` was served group "a" as learner-a."""
    d = backend.start(reclaim_idle_s=reclaim_idle_s)
    holder, other = d.client(), d.client()
    holder.put("w", make_group("a"))
    return holder, other, holder.get_batch("learner-a", 1, 0, timeout_s=5.0)


def test_a_renewed_lease_outlives_reclaim_idle_and_a_lapsed_one_is_reclaimed(backend):
    holder, other, batch = _one_batch_held(backend, reclaim_idle_s=1.0)
    until = time.monotonic() + 3.0  # three times reclaim_idle_s, renewing all along
    while time.monotonic() < until:
        assert holder.renew("learner-a", batch) == 1
        assert other.get_batch("learner-b", 1, 0, timeout_s=0.2) is None
    assert other.renew("learner-b", batch) == 0  # only the holder renews its lease
    again = other.get_batch("learner-b", 1, 0, timeout_s=10.0)  # renewals stopped: reclaimed
    assert ids(again) == ["a"]
    assert holder.renew("learner-a", batch) == 0  # lost, and renewing cannot take it back
    other.ack("learner-b", again)
    assert (other.status()["consumed"], other.status()["redelivered"]) == (1, 1)


def test_keep_leased_renews_in_the_background_during_a_long_step(backend):
    holder, other, batch = _one_batch_held(backend, reclaim_idle_s=0.6)
    with keep_leased(holder, "learner-a", batch, reclaim_idle_s=0.6):  # a 2 s "step"
        assert other.get_batch("learner-b", 1, 0, timeout_s=2.0) is None
    holder.ack("learner-a", batch)
    status = holder.status()
    assert (status["consumed"], status["depth"], status["redelivered"]) == (1, 0, 0)


def test_a_late_ack_after_redelivery_counts_each_group_once(backend):
    d = backend.start(reclaim_idle_s=0.3)
    slow, fast = d.client(), d.client()
    slow.put("w", make_group("a"))
    late = slow.get_batch("learner-a", 1, 0, timeout_s=5.0)
    again = fast.get_batch("learner-b", 1, 0, timeout_s=10.0)  # after reclaim_idle_s
    assert ids(again) == ["a"]
    fast.ack("learner-b", again)
    slow.ack("learner-a", late)
    status = fast.status()
    assert (status["consumed"], status["depth"]) == (1, 0)


def test_backpressure_makes_producers_wait_and_never_trims(backend):
    d = backend.start(groups_per_step=3, max_groups=3, max_staleness=7)
    producer, waiter, learner = d.client(), d.client(), d.client()
    for i in range(3):
        assert producer.put("w", make_group(f"g{i}")).accepted
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(waiter.put, "w2", make_group("g3"))
        with pytest.raises(FutureTimeout):
            future.result(timeout=0.5)  # full: the put waits
        batch = learner.get_batch("learner", 2, 0, timeout_s=5.0)
        learner.ack("learner", batch)
        assert future.result(timeout=10).accepted
    assert ids(batch) + take_all(learner, 2, count=2) == ["g0", "g1", "g2", "g3"]
    status = learner.status()
    assert status["accepted"] == 4 and status["rejected"] == {} and status["depth"] == 0


def test_a_put_into_a_full_buffer_times_out_and_keeps_the_data(backend):
    d = backend.start(groups_per_step=2, max_groups=2, max_staleness=11)
    producer = d.client(request_timeout_s=0.5)
    producer.put("w", make_group("g0"))
    producer.put("w", make_group("g1"))
    with pytest.raises(TimeoutError):
        producer.put("w", make_group("g2"))
    learner = d.client()
    assert take_all(learner, 2, count=2) == ["g0", "g1"]


def test_put_many_answers_each_group_in_order_and_keeps_fifo(backend):
    c = backend.start(groups_per_step=16).client()
    assert c.put_many("a", []) == []
    first = [make_group(f"a-{i:02d}") for i in range(11)]  # more than one window
    results = c.put_many("a", first)
    assert results == [PutResult(accepted=True)] * len(first)
    c.put("b", make_group("b-00"))
    assert c.put_many("a", [make_group("a-11")]) == [PutResult(accepted=True)]
    order = [g.group_id for g in first] + ["b-00", "a-11"]
    assert take_all(c, len(order), count=1) == order
    status = c.status()
    assert (status["accepted"], status["consumed"], status["depth"]) == (13, 13, 0)


def test_puts_in_flight_answer_each_group_in_order_and_keep_fifo(backend):
    """A producer with three ``put_many`` calls in flight (ZMQ; Redis puts one at a time):
    other requests in between keep their own replies, every group gets its result in order,
    a bad group is still rejected with its reason, and the groups come out in put order."""
    d = backend.start(groups_per_step=16, max_message_bytes=4096)
    c = d.client()
    puts = PutAhead(c, "a", depth=3)
    assert puts.depth == (3 if backend.name == "zmq" else 1)
    calls = [[make_group("a-0")], [make_group("a-1")],
             [make_group("a-2"), make_group("big", tokens=300), make_group("a-3")],
             [make_group("a-4")], [make_group("a-5")]]
    results: list[PutResult] = []
    for groups in calls:
        results += puts.put_many(groups)
        assert c.acquire("a", 0, 0).granted == 0 and c.status()["run_status"]  # in between
        assert puts.in_flight <= puts.depth - 1
    results += puts.flush()
    assert puts.in_flight == 0 and puts.flush() == []
    assert [r.accepted for r in results] == [True, True, True, False, True, True, True]
    assert results[3].reason == "oversized"
    order = [f"a-{i}" for i in range(6)]
    assert take_all(c, len(order), count=1) == order


def test_put_many_mixed_groups_get_per_group_results_and_counted_rejections(backend):
    c = backend.start(groups_per_step=8, max_message_bytes=2048).client()
    assert c.acquire("w", 5, 0).granted == 5
    other_run = make_group("other")
    other_run.run_id = "not-this-run"
    groups = [make_group("good-0"), make_group("big", tokens=300),
              make_group("nan", reward=math.nan), other_run, make_group("good-1")]
    results = c.put_many("w", groups)
    assert [r.accepted for r in results] == [True, False, False, False, True]
    assert results[1].reason == "oversized" and results[3].reason == "run"
    assert results[2].reason in {"reward", "header"}  # orjson writes NaN as null
    status = c.status()
    assert status["rejected"] == dict(Counter(r.reason for r in results if not r.accepted))
    assert (status["accepted"], status["in_flight"]) == (2, 0)  # every slot was used up
    assert ids(c.get_batch("learner", 2, 0, timeout_s=5.0)) == ["good-0", "good-1"]


def test_put_many_waits_on_backpressure_in_order_and_never_trims(backend):
    d = backend.start(groups_per_step=3, max_groups=3, max_staleness=15)
    producer, learner = d.client(), d.client()
    groups = [make_group(f"g{i}") for i in range(7)]
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(producer.put_many, "w", groups)
        with pytest.raises(FutureTimeout):
            future.result(timeout=0.5)  # room for 3 of 7: the call waits
        served = take_all(learner, len(groups), count=1)
        assert future.result(timeout=10) == [PutResult(accepted=True)] * len(groups)
    assert served == [g.group_id for g in groups]
    status = learner.status()
    assert (status["accepted"], status["rejected"], status["depth"]) == (7, {}, 0)


def test_put_many_into_a_full_buffer_raises_timeout_and_keeps_the_data(backend):
    d = backend.start(groups_per_step=2, max_groups=2, max_staleness=11)
    producer = d.client(request_timeout_s=0.5)
    with pytest.raises(TimeoutError):
        producer.put_many("w", [make_group(f"g{i}") for i in range(3)])
    learner = d.client()
    assert take_all(learner, 2, count=2) == ["g0", "g1"]  # accepted ones are never trimmed
    assert learner.get_batch("learner", 1, 0, timeout_s=0.3) is None
    assert learner.status()["accepted"] == 2  # here the group that found it full was not


@pytest.mark.parametrize("kill", [False, True], ids=["sigterm", "sigkill"])
def test_restart_loses_nothing_accepted_and_unacked(backend, kill):
    d = backend.start(groups_per_step=8, reclaim_idle_s=0.5)
    c = d.client()
    for i in range(6):
        assert c.put("w", make_group(f"g{i}")).accepted
    c.ack("learner", c.get_batch("learner", 2, 0, timeout_s=5.0))
    assert ids(c.get_batch("learner", 2, 0, timeout_s=5.0)) == ["g2", "g3"]  # never acked
    d.restart(kill=kill)
    after = d.client()
    assert sorted(take_all(after, 4, count=2)) == ["g2", "g3", "g4", "g5"]
    assert after.get_batch("learner", 1, 0, timeout_s=1.0) is None  # acked g0, g1 stay gone
    assert after.put("w", make_group("g6")).accepted
    assert ids(after.get_batch("learner", 1, 0, timeout_s=5.0)) == ["g6"]


def _produce(client: BufferClient, producer: str, names: list[str], deadline: float) -> None:
    """A rollout worker: acquire slots from the gate, put one group per slot."""
    pending = list(names)
    while pending:
        assert time.monotonic() < deadline, f"{producer}: gate never opened"
        granted = client.acquire(producer, min(5, len(pending)), 0).granted
        for _ in range(granted):
            assert client.put(producer, make_group(pending.pop(0))).accepted
        if not granted:
            time.sleep(0.01)  # a real worker would also wait for the gate


def _consume(client: BufferClient, name: str, total: int, served: dict[str, list[str]],
             lock: threading.Lock, deadline: float) -> None:
    """A learner rank: take batches of 2 and ack them until ``total`` groups were served
    (by all consumers together, recorded in ``served``)."""
    while time.monotonic() < deadline:
        with lock:
            if sum(map(len, served.values())) >= total:
                return
        batch = client.get_batch(name, 2, 0, timeout_s=0.2)
        if batch is not None:
            client.ack(name, batch)
            with lock:
                served[name] += ids(batch)


def test_many_producers_and_consumers_each_group_once_fifo_per_producer(backend):
    d = backend.start(groups_per_step=10, max_staleness=20)
    producers = {f"p{k}": [f"p{k}-{i:02d}" for i in range(25)] for k in range(4)}
    total = sum(map(len, producers.values()))
    served: dict[str, list[str]] = {f"learner-{k}": [] for k in range(4)}
    lock, deadline = threading.Lock(), time.monotonic() + 40
    with ThreadPoolExecutor(len(producers) + len(served)) as pool:
        futures = [pool.submit(_produce, d.client(), p, names, deadline)
                   for p, names in producers.items()]
        futures += [pool.submit(_consume, d.client(), name, total, served, lock, deadline)
                    for name in served]
        for future in futures:
            future.result(timeout=60)
    every = [g for mine in served.values() for g in mine]
    assert Counter(every) == Counter(n for names in producers.values() for n in names)
    assert sum(1 for mine in served.values() if mine) > 1, "one consumer took everything"
    for mine in served.values():  # each consumer sees each producer's groups in order
        for p in producers:
            theirs = [g for g in mine if g.startswith(f"{p}-")]
            assert theirs == sorted(theirs)
    status = d.client().status()
    assert (status["accepted"], status["consumed"], status["in_flight"], status["depth"]) == \
        (total, total, 0, 0)


def test_heartbeat_timeout_releases_a_dead_producers_in_flight(backend):
    c = backend.start(groups_per_step=2, max_staleness=0, heartbeat_timeout_s=0.3).client()
    c.heartbeat("dead", "rollout", {"engine_version": 0})
    assert c.acquire("dead", 2, 0).granted == 2
    assert c.acquire("alive", 2, 0).granted == 0
    eventually(lambda: c.acquire("alive", 2, 0).granted == 2,  # also keeps "alive" alive
               what="the dead producer's slots are released")
    members = c.status()["members"]
    assert members["dead"]["alive"] is False and members["dead"]["in_flight"] == 0
    assert members["dead"]["info"] == {"engine_version": 0}
    assert members["dead"]["role"] == "rollout"
    assert members["alive"]["alive"] is True and members["alive"]["in_flight"] == 2
    c.heartbeat("dead", "rollout", {})
    assert c.status()["members"]["dead"]["alive"] is True


def test_pace_mode_stops_waiting_for_a_dead_producers_group(backend):
    """The group a dead producer held holds the learner only until the producer is reaped."""
    d = backend.start(groups_per_step=1, max_staleness=0, heartbeat_timeout_s=0.3,
                      staleness_mode="pace")
    c = d.client()
    c.heartbeat("dead", "rollout", {})
    assert c.acquire("dead", 1, 0).granted == 1
    c.publish_version(1)  # (as if the step were trained by another consumer)
    assert c.acquire("alive", 1, 1).granted == 1
    assert c.put("alive", make_group("b", version=1)).accepted
    assert c.get_batch("learner", 1, 1, timeout_s=0.1) is None  # "dead"'s v0 would go stale
    eventually(lambda: c.acquire("alive", 0, 1) is not None and
               c.get_batch("learner", 1, 1, timeout_s=0.1) is not None,
               what="the take served once the dead producer's grant is gone")
    assert c.status()["dropped_stale"] == 0


def test_get_key_long_poll_wakes_on_set(backend):
    d = backend.start()
    waiter, setter = d.client(), d.client()
    assert waiter.get_key("rdzv") is None
    start = time.monotonic()
    assert waiter.get_key("rdzv", timeout_s=0.2) is None
    assert time.monotonic() - start >= 0.2
    first = setter.set_key("rdzv", {"epoch": 1})  # numbers go up, from wherever they start
    assert first >= 1 and waiter.get_key("rdzv") == (first, {"epoch": 1})
    assert setter.set_key("other", {}) >= 1  # sequence numbers are per key
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(waiter.get_key, "rdzv", first, 20.0)
        with pytest.raises(FutureTimeout):
            future.result(timeout=0.3)  # parked: nothing newer than the first yet
        start = time.monotonic()
        assert setter.set_key("rdzv", {"epoch": 2}) == first + 1
        assert future.result(timeout=10) == (first + 1, {"epoch": 2})
    assert time.monotonic() - start < 2.0
    assert setter.status()["keys"] == ["other", "rdzv"]


def test_get_keys_reads_many_keys_in_one_call(backend):
    d = backend.start()
    reader, writer = d.client(), d.client()
    assert reader.get_keys([]) == {} and reader.get_keys(["nope"]) == {}
    a = writer.set_key("ack/a", {"version": 1})
    writer.set_key("ack/b", {"version": 1})
    b = writer.set_key("ack/b", {"version": 2})
    assert reader.get_keys(["ack/a", "ack/b", "ack/c"]) == {"ack/a": (a, {"version": 1}),
                                                           "ack/b": (b, {"version": 2})}


def test_status_has_every_documented_key(backend):
    c = backend.start().client()
    c.heartbeat("learner-0", "learner", {"step": 0})
    status = c.status()
    expected = {"version", "run_status", "run_id", "max_staleness", "groups_per_step",
                "max_groups", "depth", "accepted", "in_flight", "consumed", "dropped_stale",
                "rejected", "gate_open", "gate_allowance", "gate_closed_s", "staleness_hist",
                "members", "uptime_s", "keys", "staleness_mode", "pace_held_s"}
    assert expected <= status.keys()
    assert set(status["members"]["learner-0"]) >= {"role", "alive", "last_seen_s_ago", "info"}
    assert status["gate_open"] is True and status["gate_allowance"] == 4
    assert status["run_id"] == "contract"


def _read_ids(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def test_sigkill_of_a_consumer_mid_run_loses_no_group(backend, tmp_path):
    """N producers put M groups while a consumer process trains and acks, then is SIGKILLed
    holding an unacked batch; a second consumer finishes. Every group is acked exactly once,
    and the killed consumer's unacked batch is among the second one's (redelivered)."""
    d = backend.start(groups_per_step=4, max_staleness=20, reclaim_idle_s=1.0)
    producers = {f"p{k}": [f"p{k}-{i:02d}" for i in range(20)] for k in range(3)}
    produced = {n for names in producers.values() for n in names}
    out = tmp_path / "victim"
    out.mkdir()
    victim = subprocess.Popen([sys.executable, "-m", "tests.buffers.fault_consumer", d.spec(),
                               str(out), "4", "5"], cwd=ROOT, env=child_env(),
                              stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 40
    try:
        with ThreadPoolExecutor(len(producers)) as pool:
            futures = [pool.submit(_produce, d.client(), p, names, deadline)
                       for p, names in producers.items()]
            eventually(lambda: (out / "holding").exists() or victim.poll() is not None,
                       timeout_s=30, what="the victim holds a batch")
            victim.kill()  # SIGKILL, mid-run: producers are still putting
            for future in futures:
                future.result(timeout=40)
    finally:
        victim.kill()
        victim.wait()
    acked_by_victim, holding = _read_ids(out / "acked"), _read_ids(out / "holding")
    assert len(acked_by_victim) == 20 and len(holding) == 4, "the victim did not get that far"
    survivor = d.client()
    acked_by_survivor = take_all(survivor, len(produced) - len(acked_by_victim), count=4)
    assert not set(acked_by_victim) & set(acked_by_survivor), "a group was acked twice"
    assert Counter(acked_by_victim + acked_by_survivor) == Counter(produced), "lost or extra"
    assert set(holding) <= set(acked_by_survivor), "the unacked batch was not redelivered"
    assert survivor.get_batch("learner", 1, 0, timeout_s=1.5) is None
    status = survivor.status()
    assert (status["consumed"], status["depth"], status["accepted"]) == (60, 0, 60)
