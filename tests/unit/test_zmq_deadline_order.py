"""The ZMQ broker serves the oldest versions first (earliest deadline first), each producer's
groups in their order.

Groups reach the buffer in the order they finish, not the order the gate admitted them: a
long-tailed group started at version v arrives behind groups started at v + 1 that overtook it.
Served by arrival it would be consumed one step later and dropped as stale; served by version
it is consumed while still within ``max_staleness``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from asyncrl.config.schema import BufferConfig
from buffers.zmq_broker import start_broker_thread
from buffers.zmq_client import ZmqBufferClient
from tests.unit.test_zmq_buffer import make_group

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def client() -> Iterator[ZmqBufferClient]:
    """A client of a broker with ``max_staleness = 1`` and two groups per step."""
    address, stop = start_broker_thread(BufferConfig(port=0, max_staleness=1), 2)
    c = ZmqBufferClient(address, timeout_s=5.0)
    yield c
    c.close()
    stop()


def served(c: ZmqBufferClient, count: int, version: int) -> list[str]:
    batch = c.get_batch("learner", count, version, timeout_s=1.0)
    assert batch is not None
    c.ack("learner", batch)
    return [g.group_id for g in batch.groups]


def test_a_late_old_group_is_served_before_fresher_ones_and_not_dropped(client):
    for name in ("a", "b"):
        assert client.put("w1", make_group(name, version=1)).accepted
    assert client.put("w0", make_group("long", version=0)).accepted  # finished last
    assert served(client, 2, version=1) == ["long", "a"]  # staleness 1: still fresh
    assert served(client, 1, version=2) == ["b"]
    assert client.status()["dropped_stale"] == 0  # by arrival, "long" would be: 2 − 0 > 1


def test_equal_versions_keep_arrival_order_and_each_producer_its_own(client):
    for name in ("a", "b", "c"):
        assert client.put("w", make_group(name, version=1)).accepted
    assert served(client, 3, version=1) == ["a", "b", "c"]
    assert client.put("x", make_group("x-new", version=2)).accepted
    assert client.put("x", make_group("x-old", version=1)).accepted  # after x-new: x's order
    assert client.put("y", make_group("y-mid", versions=[1, 2])).accepted  # oldest token: v1
    assert served(client, 2, version=2) == ["y-mid", "x-new"]
    assert served(client, 1, version=2) == ["x-old"]
