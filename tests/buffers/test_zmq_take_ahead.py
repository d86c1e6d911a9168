"""Several batch requests in flight on one ZMQ client (the benchmark's
:class:`bench.inflight.TakeAhead` drives them), against a real broker process: replies kept
across other requests, and requests lost with a broker restart sent again in order."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from bench.inflight import TakeAhead
from buffers.zmq_client import ZmqBufferClient
from tests.buffers import eventually, make_group
from tests.buffers.test_contract import ids

pytestmark = pytest.mark.timeout(60)


def test_replies_in_flight_are_kept_across_other_requests(zmq):
    d = zmq.start(groups_per_step=2)
    c = d.client()
    assert isinstance(c, ZmqBufferClient)
    for i in range(4):
        assert c.put("w", make_group(f"g{i}")).accepted
    first = c.send_get_batch("learner", 2, 0, timeout_s=5.0)
    second = c.send_get_batch("learner", 2, 1, timeout_s=5.0)
    assert c.status()["pending"] == 4  # both served while status waited for its reply
    assert ids(c.receive_batch(second)) == ["g2", "g3"]  # any order
    batch = c.receive_batch(first)
    assert ids(batch) == ["g0", "g1"]
    c.ack("learner", batch)
    assert c.status()["pending"] == 2


def test_requests_in_flight_are_sent_again_after_a_broker_restart(zmq):
    """Three requests parked at a broker that is SIGKILLed: the client hears the connection
    drop, sends all three again (in version order) to the restarted broker, and each version
    gets its batch; nothing is served twice."""
    d = zmq.start(groups_per_step=2, max_staleness=4)  # version-0 groups fresh at 2
    learner = d.client(zmq=d.config.zmq.with_fields(reconnect_s=30.0))
    ahead = TakeAhead(learner, "learner", 2, depth=3, timeout_s=20.0)
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(ahead.take, 0)
        watcher = d.client()
        eventually(lambda: watcher.status()["waiting"]["get_batch"] == 3, what="3 parked")
        d.restart(kill=True)
        producer = d.client()
        for i in range(6):
            assert producer.put("w", make_group(f"g{i}")).accepted
        batch = first.result(timeout=30)
    assert ids(batch) == ["g0", "g1"]
    batch = ahead.take(1, ack=batch)
    assert ids(batch) == ["g2", "g3"]
    batch = ahead.take(2, ack=batch)
    assert ids(batch) == ["g4", "g5"]
    learner.ack("learner", batch)
    status = producer.status()
    assert (status["consumed"], status["depth"], status["redelivered"]) == (6, 0, 0)


def test_a_forgotten_request_is_never_answered_and_its_batch_comes_back(zmq):
    d = zmq.start(groups_per_step=2, reclaim_idle_s=0.5)
    c = d.client()
    for i in range(4):
        assert c.put("w", make_group(f"g{i}")).accepted
    first = c.send_get_batch("learner", 2, 0, timeout_s=5.0)
    second = c.send_get_batch("learner", 2, 0, timeout_s=5.0)
    c.forget_batch(second)
    batch = c.receive_batch(first)
    assert ids(batch) == ["g0", "g1"]
    c.ack("learner", batch)
    assert c.status()["pending"] == 2  # g2, g3: served to the forgotten request
    again = c.get_batch("learner", 2, 0, timeout_s=5.0)  # reclaimed after 0.5 s
    assert ids(again) == ["g2", "g3"]
    c.ack("learner", again)
    status = c.status()
    assert (status["consumed"], status["depth"], status["redelivered"]) == (4, 0, 2)
