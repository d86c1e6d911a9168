"""The Redis client honours its owner's stop event, as the ZMQ client does.

Once the event is set, a request to a Redis that does not answer (killed: refused
connections; hung: no reply) raises :class:`~buffers.BufferStopped` within about a second,
even with ``request_timeout_s = 30`` and the reconnect retries at their defaults; a live
Redis still answers; an event never set changes nothing. Every test runs real
``redis-server`` processes (the cluster test a private three-node cluster: it is killed).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.exceptions import ConnectionError as RedisConnectionError

from asyncrl.config.schema import BufferConfig, RedisBufferConfig
from buffers import BufferClient, BufferStopped, make_buffer_client
from buffers.redis_scripts import PAYLOAD_INFIX
from tests.buffers import eventually, make_group
from tests.buffers.conftest import RedisClusterServer, RedisServer

pytestmark = pytest.mark.timeout(60)

STOPPED_WITHIN_S = 2.0  # the target is about 1 s; the margin is for a loaded machine
NAMESPACE = "asyncrl:stop"


@pytest.fixture
def open_client(redis_server: RedisServer) -> Iterator[Callable[..., BufferClient]]:
    """``open_client(stop, **BufferConfig fields)``: clients through the real factory, on the
    private server, with ``request_timeout_s = 30`` unless told; closed after."""
    clients: list[BufferClient] = []

    def open_(stop: threading.Event | None, **fields: Any) -> BufferClient:
        config = BufferConfig(type="redis",
                              redis=RedisBufferConfig(url=redis_server.url, namespace=NAMESPACE),
                              **{"max_staleness": 1, "request_timeout_s": 30.0, **fields})
        clients.append(make_buffer_client(config, run_id="stop", groups_per_step=1, stop=stop))
        return clients[-1]

    yield open_
    for client in clients:
        client.close()


def timed(call: Callable[[], Any]) -> tuple[BaseException | None, float]:
    """What ``call`` raised (None if it returned), and how long it took."""
    start = time.monotonic()
    try:
        call()
    except Exception as exc:  # the tests assert on it
        return exc, time.monotonic() - start
    return None, time.monotonic() - start


def stopped_promptly(future: Future, since: float) -> None:
    """``future`` failed with BufferStopped within STOPPED_WITHIN_S of ``since``."""
    with pytest.raises(BufferStopped):
        future.result(timeout=30)
    assert time.monotonic() - since < STOPPED_WITHIN_S


def test_requests_after_a_sigkill_stop_at_once_and_close_does_not_wait(redis_server,
                                                                       open_client):
    stop = threading.Event()
    client = open_client(stop)
    client.heartbeat("worker-0", "rollout", {})
    redis_server.stop(signal.SIGKILL)
    stop.set()
    for request in (lambda: client.heartbeat("worker-0", "rollout", {}),
                    lambda: client.get_batch("learner", 1, 0, timeout_s=30.0),
                    lambda: client.put("worker-0", make_group("g0")),
                    lambda: client.get_key("rdzv", timeout_s=30.0)):
        error, took = timed(request)
        assert isinstance(error, BufferStopped) and took < STOPPED_WITHIN_S, (error, took)
        assert isinstance(error.__cause__, RedisConnectionError)  # what Redis did
    _, took = timed(client.close)
    assert took < STOPPED_WITHIN_S


def test_a_long_poll_and_a_put_waiting_for_room_stop_when_redis_dies(redis_server, open_client):
    """Both were waiting on a live Redis when it was killed and the event set."""
    stop = threading.Event()
    learner, producer = open_client(stop, max_groups=2), open_client(stop, max_groups=1)
    assert producer.put("worker-0", make_group("g0")).accepted  # the buffer is now full
    admin = redis.Redis(host="127.0.0.1", port=redis_server.port)
    with ThreadPoolExecutor(2) as pool:
        poll = pool.submit(learner.get_batch, "learner", 2, 0, 30.0)  # one group is not two
        put = pool.submit(producer.put, "worker-0", make_group("g1"))
        eventually(lambda: len(admin.keys(f"{NAMESPACE}{PAYLOAD_INFIX}*")) == 2, 10.0,
                   "the waiting put's payload staged")
        eventually(lambda: admin.info("clients")["blocked_clients"] == 1, 10.0,
                   "the long poll blocked in Redis")
        redis_server.stop(signal.SIGKILL)
        stop.set()
        since = time.monotonic()
        stopped_promptly(poll, since)
        stopped_promptly(put, since)


def test_a_hung_redis_costs_a_stopping_request_about_a_second(redis_server, open_client):
    stop = threading.Event()
    client = open_client(stop)
    client.heartbeat("worker-0", "rollout", {})
    redis_server.proc.send_signal(signal.SIGSTOP)  # accepts connections, never answers
    try:
        stop.set()
        error, took = timed(lambda: client.heartbeat("worker-0", "rollout", {}))
        assert isinstance(error, BufferStopped) and took < STOPPED_WITHIN_S, (error, took)
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)


@pytest.mark.parametrize("request_kind", ["heartbeat", "long-poll"])
def test_a_request_already_waiting_on_a_hung_redis_stops_when_the_event_is_set(
        redis_server, open_client, request_kind):
    """The request was sent before Redis hung and before the event was set: it waits on its
    socket (30 s timeout), and the client's watcher cuts it short."""
    stop = threading.Event()
    client = open_client(stop)
    client.heartbeat("worker-0", "rollout", {})
    request = {"heartbeat": lambda: client.heartbeat("worker-0", "rollout", {}),
               "long-poll": lambda: client.get_batch("learner", 1, 0, timeout_s=30.0)}
    redis_server.proc.send_signal(signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(request[request_kind])
            # in progress: past its own look at the event, sent, and waiting for the reply
            # (a fixed sleep here let a request that had not started yet see the event set:
            # the path of a request made once stopping, not the watcher's)
            eventually(lambda: client._stop._waiting, 10.0, "the request in progress")
            assert not waiting.done()
            stop.set()
            stopped_promptly(waiting, time.monotonic())
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)


def test_a_long_poll_waiting_on_a_live_redis_is_not_cut_short_by_the_stop(redis_server,
                                                                          open_client):
    """The watcher asks Redis, which answers: the poll goes on and gets the group put after
    the event was set (a hung Redis is cut short, see above)."""
    stop = threading.Event()
    learner, producer = open_client(stop), open_client(None)
    admin = redis.Redis(host="127.0.0.1", port=redis_server.port)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(learner.get_batch, "learner", 1, 0, 10.0)
        eventually(lambda: admin.info("clients")["blocked_clients"] == 1, 10.0,
                   "the long poll blocked in Redis")
        stop.set()
        time.sleep(1.5)  # longer than a hung Redis is given (STOP_TIMEOUT_S): still polling
        assert not waiting.done()
        assert producer.put("worker-0", make_group("late")).accepted
        batch = waiting.result(timeout=10)
    assert batch is not None and [g.group_id for g in batch.groups] == ["late"]


def test_the_stop_watcher_ends_with_its_client(redis_server, open_client):
    def watchers() -> int:
        return sum(t.name == "redis-stop-guard" for t in threading.enumerate())

    before = watchers()
    client = open_client(threading.Event())
    assert watchers() == before + 1
    client.close()
    eventually(lambda: watchers() == before, 5.0, "the watcher ended")


@pytest.mark.parametrize("with_event", [False, True], ids=["no-event", "event-never-set"])
def test_without_the_event_set_a_killed_redis_fails_as_before(redis_server, open_client,
                                                              with_event):
    """The reconnect retries run their course (backoffs of about request_timeout_s), then
    redis-py's own error, not BufferStopped."""
    client = open_client(threading.Event() if with_event else None, request_timeout_s=1.0)
    redis_server.stop(signal.SIGKILL)
    error, took = timed(lambda: client.heartbeat("worker-0", "rollout", {}))
    assert type(error) is RedisConnectionError, error
    assert took >= 1.0  # it retried


def test_a_live_redis_still_answers_a_stopping_client(redis_server, open_client):
    stop = threading.Event()
    stop.set()
    client = open_client(stop, max_groups=2)
    assert client.heartbeat("worker-0", "rollout", {})["run_status"] == "running"
    assert client.put("worker-0", make_group("g0")).accepted
    batch = client.get_batch("learner", 1, 0, timeout_s=5.0)
    assert [g.group_id for g in batch.groups] == ["g0"]
    client.ack("learner", batch)
    seq = client.set_key("rdzv", {"epoch": 1})
    assert client.get_key("rdzv") == (seq, {"epoch": 1})
    start = time.monotonic()  # long polls on a live Redis run their course
    assert client.get_batch("learner", 1, 0, timeout_s=1.5) is None
    assert client.get_key("rdzv", newer_than=seq, timeout_s=1.0) is None
    assert time.monotonic() - start >= 2.5
    assert client.status()["consumed"] == 1


def test_a_stopping_put_into_a_full_buffer_gives_up_after_a_short_grace(open_client):
    """As the ZMQ broker's put: not request_timeout_s; the group is not accepted."""
    stop = threading.Event()
    client = open_client(stop, max_groups=1)
    assert client.put("worker-0", make_group("g0")).accepted
    stop.set()
    error, took = timed(lambda: client.put("worker-0", make_group("g1")))
    assert isinstance(error, BufferStopped) and took < STOPPED_WITHIN_S, (error, took)
    assert client.status()["depth"] == 1


def test_a_killed_cluster_stops_a_stopping_client_at_once(tmp_path: Path):
    cluster = RedisClusterServer(tmp_path / "cluster")
    cluster.start()
    try:
        stop = threading.Event()
        client = make_buffer_client(BufferConfig(type="redis",
                                                 redis=RedisBufferConfig(url=cluster.url),
                                                 request_timeout_s=30.0),
                                    run_id="stop", groups_per_step=1, stop=stop)
        client.heartbeat("worker-0", "rollout", {})
        cluster.stop(signal.SIGKILL)
        stop.set()
        for request in (lambda: client.heartbeat("worker-0", "rollout", {}),
                        lambda: client.get_batch("learner", 1, 0, timeout_s=30.0),
                        lambda: client.put("worker-0", make_group("g0"))):
            error, took = timed(request)
            assert isinstance(error, BufferStopped) and took < STOPPED_WITHIN_S, (error, took)
        _, took = timed(client.close)  # redis-py's cluster error is not a RedisError
        assert took < STOPPED_WITHIN_S
    finally:
        cluster.stop(signal.SIGKILL)


def test_opening_a_client_while_stopping_on_a_dead_redis_is_stopped(redis_server):
    redis_server.stop(signal.SIGKILL)
    stop = threading.Event()
    stop.set()
    config = BufferConfig(type="redis", redis=RedisBufferConfig(url=redis_server.url),
                          request_timeout_s=30.0)
    error, took = timed(lambda: make_buffer_client(config, run_id="stop", groups_per_step=1,
                                                   stop=stop))
    assert isinstance(error, BufferStopped) and took < STOPPED_WITHIN_S, (error, took)
