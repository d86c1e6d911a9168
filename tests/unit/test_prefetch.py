"""learners.prefetch: the next batch is fetched at its training version, prepared, kept leased."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from asyncrl.config.schema import BufferConfig, ZmqBufferConfig
from buffers.zmq_broker import start_broker_thread
from buffers.zmq_client import ZmqBufferClient
from learners.prefetch import BatchPrefetcher
from tests.unit.test_zmq_buffer import eventually, make_group

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def broker() -> Iterator[Callable[..., str]]:
    stops = []

    def start(**overrides) -> str:
        address, stop = start_broker_thread(BufferConfig(zmq=ZmqBufferConfig(port=0),
                                                         **overrides), 2)
        stops.append(stop)
        return address

    yield start
    for stop in stops:
        stop()


def ids(batch) -> list[str]:
    return [g.group_id for g in batch.groups]


def test_fetches_at_the_training_version_and_prepares_off_the_caller(broker):
    address = broker(max_staleness=1)
    producer = ZmqBufferClient(address)
    prefetcher = BatchPrefetcher(ZmqBufferClient(address), "learner", 2,
                                 lambda batch: len(batch.groups), poll_s=0.2,
                                 reclaim_idle_s=60.0)
    try:
        prefetcher.start(2)  # while step 2 is computed, say
        assert prefetcher.take(2, timeout_s=0.1) is None  # nothing there yet: it goes on
        for name, version in (("old", 0), ("a", 1), ("b", 2)):
            assert producer.put("w", make_group(name, version=version)).accepted
        batch, prepared = prefetcher.take(2, timeout_s=5.0)
        assert ids(batch) == ["a", "b"] and prepared == 2
        assert batch.dropped_stale == 1  # "old" is staler than 1 at version 2, not at 1
        producer.ack("learner", batch)
        assert producer.status()["consumed"] == 2
    finally:
        prefetcher.close()
        prefetcher.close()  # idempotent
        producer.close()


def test_a_fetched_batch_stays_leased_until_taken(broker):
    address = broker(max_staleness=1, reclaim_idle_s=0.3)
    producer = ZmqBufferClient(address)
    prefetcher = BatchPrefetcher(ZmqBufferClient(address), "learner", 2, lambda batch: None,
                                 poll_s=0.2, reclaim_idle_s=0.3)
    try:
        for name in "ab":
            producer.put("w", make_group(name))
        prefetcher.start(0)
        eventually(lambda: producer.status()["pending"] == 2)  # fetched, not taken yet
        time.sleep(1.0)  # time passing, > 3 × reclaim_idle_s: unrenewed, it would be reclaimed
        assert producer.status()["redelivered"] == 0
        batch, _ = prefetcher.take(0, timeout_s=1.0)
        assert ids(batch) == ["a", "b"]
    finally:
        prefetcher.close()
        producer.close()


def test_a_failed_preparation_surfaces_in_take_and_close_ends_a_waiting_fetch(broker):
    address = broker(max_staleness=1)
    producer = ZmqBufferClient(address)

    def broken(batch):
        raise ValueError("bad batch")

    prefetcher = BatchPrefetcher(ZmqBufferClient(address), "learner", 1, broken, poll_s=0.2,
                                 reclaim_idle_s=60.0)
    try:
        producer.put("w", make_group("a"))
        with pytest.raises(RuntimeError, match="version 0") as info:
            prefetcher.take(0, timeout_s=5.0)
        assert isinstance(info.value.__cause__, ValueError)
        prefetcher.start(1)  # nothing will come: close ends the long-poll
        start = time.monotonic()
        prefetcher.close()
        assert time.monotonic() - start < 2.0
    finally:
        prefetcher.close()
        producer.close()
