"""A finished Redis run keeps what ``asyncrl status`` reads, and none of its trajectory data.

Real servers only (a private ``redis-server``, and the session's three-node Redis Cluster).
The run's payload keys are listed with ``KEYS`` on the node that holds the run's slot, not
through the client under test.
"""

from __future__ import annotations

import threading

import pytest
import redis

from buffers.protocol import PutResult
from tests.buffers import make_group
from tests.buffers.conftest import Deployment, RedisClusterServer

# The contract suite's backend fixture, on its Redis deployments alone.
pytestmark = [pytest.mark.timeout(60),
              pytest.mark.parametrize("backend", ["redis", "redis-cluster"], indirect=True)]


def payload_keys(deployment: Deployment) -> list[bytes]:
    """Every payload key of the deployment's run, filed or staged."""
    namespace = deployment.clients[0].keys.namespace
    server = deployment.server
    node = server.nodes[server.owner(namespace)] if isinstance(server, RedisClusterServer) \
        else server
    with redis.Redis(host="127.0.0.1", port=node.port) as raw:
        return raw.keys(f"{namespace}:g:*")  # no glob characters in the test namespaces


def test_marking_the_run_done_discards_its_data_and_keeps_its_counters(backend):
    """Left at the end: a group never read, one delivered and never acked, and a payload
    staged by a producer that found the buffer full. All three go when the run is marked
    done; counters, histogram, members and keys stay readable, and a late put leaves
    nothing behind."""
    d = backend.start(groups_per_step=1, max_groups=3, request_timeout_s=0.5)
    producer, learner = d.client(), d.client()
    for name in ("g0", "g1", "g2"):
        assert producer.put("w", make_group(name)).accepted
    with pytest.raises(TimeoutError):
        producer.put("w", make_group("staged"))  # full: its payload stays staged (with a TTL)
    learner.ack("learner", learner.get_batch("learner", 1, 0, timeout_s=5.0))
    assert learner.get_batch("learner", 1, 0, timeout_s=5.0) is not None  # never acked
    producer.heartbeat("w", "rollout", {"tokens_per_s": 5.0})
    assert len(payload_keys(d)) == 3  # unread, delivered, staged

    learner.set_key("run/status", {"status": "done"})

    assert payload_keys(d) == []
    status = learner.status()
    assert status["run_status"] == "done"
    assert (status["accepted"], status["consumed"], status["depth"], status["pending"],
            status["discarded_at_done"]) == (3, 1, 0, 0, 2)
    assert status["staleness_hist"] == {"0": 1}
    assert status["members"]["w"]["info"] == {"tokens_per_s": 5.0}
    assert learner.get_keys(["run/status"])["run/status"][1] == {"status": "done"}
    # A put after done: its payload is set in the same pipeline as the script that refuses it.
    assert producer.put("w", make_group("late")) == PutResult(accepted=False, reason="run")
    assert payload_keys(d) == []
    assert learner.get_batch("learner", 1, 0, timeout_s=0.1) is None
    assert learner.status()["rejected"] == {"run": 1}


def test_a_producer_putting_while_the_run_is_marked_done_leaves_no_payload(backend):
    """Whatever the interleaving of a producer's payload SETs and put scripts with the status
    change, every group is either filed before it (then discarded with it, and counted) or
    refused after it, and no payload is left."""
    d = backend.start(groups_per_step=1, max_groups=4096)
    producer, learner = d.client(), d.client()
    refused = threading.Event()
    accepted: list[int] = []

    def produce() -> None:
        n = 0
        while not refused.is_set():
            results = producer.put_many("w", [make_group(f"g{n + i}") for i in range(4)])
            n += len(results)
            accepted.append(sum(r.accepted for r in results))
            if any(r.reason == "run" for r in results):
                refused.set()

    thread = threading.Thread(target=produce)
    thread.start()
    try:
        while sum(accepted) < 8:  # some groups filed before the end
            thread.join(0.01)
            assert thread.is_alive()
        learner.set_key("run/status", {"status": "done"})
        thread.join(30)
    finally:
        refused.set()
        thread.join(30)
    assert not thread.is_alive()
    assert payload_keys(d) == []
    status = learner.status()
    assert status["accepted"] == sum(accepted) == status["discarded_at_done"]
    assert status["depth"] == 0 and status["rejected"]["run"] >= 1
