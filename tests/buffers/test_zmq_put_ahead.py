"""Several ``put_many`` calls in flight on one ZMQ client (the benchmark's
:class:`bench.inflight.PutAhead` drives them), against a real broker process: the window over
all calls is the backpressure, a call that fails gives up the ones behind it, and a call whose
answer is lost with the broker is in doubt at once."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import pytest

from bench.inflight import PutAhead
from buffers import PutResult, zmq_client
from buffers.zmq_client import ZmqBufferClient
from tests.buffers import eventually, make_group
from tests.buffers.test_contract import take_all

pytestmark = pytest.mark.timeout(60)


def test_the_window_over_all_calls_holds_a_producer_at_a_full_buffer(zmq):
    """Room for one group; a producer with up to 8 calls in flight but a window of 2 requests:
    the first call is answered, the next two park at the broker, and the fourth waits in the
    client until a consumer makes room; then every group goes in, in order."""
    d = zmq.start(groups_per_step=1, max_groups=1, max_staleness=23)
    producer = ZmqBufferClient(d.address, timeout_s=20.0, put_window=2)
    watcher, learner = d.client(), d.client()
    puts = PutAhead(producer, "w", depth=8)
    sent = []

    def put_five() -> list[PutResult]:
        results = []
        for i in range(5):
            results += puts.put_many([make_group(f"g{i}")])
            sent.append(i)
        return results + puts.flush()

    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(put_five)
        eventually(lambda: watcher.status()["waiting"]["put"] == 2, what="two puts parked")
        with pytest.raises(FutureTimeout):
            future.result(timeout=0.5)
        assert sent == [0, 1, 2]  # the fourth call waits for room in the window
        served = take_all(learner, 5, count=1)
        assert future.result(timeout=20) == [PutResult(accepted=True)] * 5
    assert served == [f"g{i}" for i in range(5)]
    producer.close()


def test_a_call_that_finds_no_room_gives_up_the_calls_behind_it(zmq):
    d = zmq.start(groups_per_step=1, max_groups=1, max_staleness=23)
    producer = d.client(request_timeout_s=0.5)
    puts = PutAhead(producer, "w", depth=3)
    assert puts.put_many([make_group("g0")]) == []
    assert puts.put_many([make_group("g1")]) == []  # parked: full
    assert puts.put_many([make_group("g2")]) == [PutResult(accepted=True)]  # g0's
    with pytest.raises(TimeoutError):
        puts.flush()  # g1 waited 0.5 s for room; g2, behind it, is given up with it
    assert puts.in_flight == 0
    learner = d.client()
    eventually(lambda: learner.status()["waiting"]["put"] == 0, what="g2 refused too")
    assert take_all(learner, 1, count=1) == ["g0"]
    assert producer.put_many("w", [make_group("g3")]) == [PutResult(accepted=True)]
    assert take_all(learner, 1, count=1) == ["g3"]  # g2's late answer was not taken for g3's


def test_a_call_in_flight_when_the_broker_dies_is_in_doubt_at_once(zmq):
    """Parked calls at a broker that is SIGKILLed: their answers are lost, so the producer
    hears it as soon as the connection drops (not after its 20 s timeout), in doubt; after the
    restart (which replays the accepted group) the same client puts again."""
    d = zmq.start(groups_per_step=1, max_groups=1, max_staleness=23)
    producer = d.client(request_timeout_s=20.0)
    watcher = d.client()
    puts = PutAhead(producer, "w", depth=4)
    for i in range(3):
        assert puts.put_many([make_group(f"g{i}")]) == []
    eventually(lambda: watcher.status()["waiting"]["put"] == 2, what="two puts parked")
    d.restart(kill=True)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="in doubt|dropped"):
        puts.flush()
    assert time.monotonic() - start < 10.0
    assert puts.in_flight == 0
    learner = d.client()
    assert take_all(learner, 1, count=1) == ["g0"]  # from the spill file
    assert producer.put_many("w", [make_group("g3")]) == [PutResult(accepted=True)]
    assert take_all(learner, 1, count=1) == ["g3"]  # g1 and g2 died parked in the broker


def test_put_window_must_be_positive():
    with pytest.raises(ValueError, match="put_window"):
        ZmqBufferClient("tcp://127.0.0.1:1", put_window=0)
    with pytest.raises(ValueError, match="depth"):
        PutAhead(ZmqBufferClient.__new__(ZmqBufferClient), "w", depth=0)


def test_nothing_is_sent_after_a_refused_request(zmq, monkeypatch):
    """One call of three requests (a group each) into room for one, a window of one: the
    second request waits ``timeout_s`` and is refused, and the third is never sent. (Sent, it
    would be answered at once, an oversized group, and counted.) So nothing of a producer's
    can reach the buffer after a group of its that was refused (FIFO per producer)."""
    monkeypatch.setattr(zmq_client, "PUT_CHUNK_BYTES", 1)  # one group per request
    d = zmq.start(groups_per_step=1, max_groups=1, max_staleness=23, max_message_bytes=2048)
    producer = ZmqBufferClient(d.address, timeout_s=0.5, put_window=1)
    learner = d.client()
    groups = [make_group("g0"), make_group("g1"), make_group("big", tokens=300)]
    with pytest.raises(TimeoutError, match="waited for room"):
        producer.put_many("w", groups)
    status = learner.status()
    assert (status["accepted"], status["rejected"], status["waiting"]["put"]) == (1, {}, 0)
    assert take_all(learner, 1, count=1) == ["g0"]
    producer.close()
