"""What a Redis buffer client does once its owner's stop event is set.

The ZMQ client's rule (see :mod:`buffers.zmq_client`), by other means, since redis-py blocks in
its socket reads: until the event is set nothing changes; once it is, a Redis that does not
answer costs a request about a second, not ``request_timeout_s`` and the reconnect retries
(:class:`~buffers.redis_connect.ReconnectRetry` stops retrying), and the request raises
:class:`~buffers.BufferStopped`. A live Redis still answers, so a stopping role gets its last
requests through, and a long poll on a live Redis still runs to its ``timeout_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from redis.exceptions import AuthenticationError, ClusterDownError, RedisClusterException, \
    ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from buffers import BufferStopped
from buffers.redis_connect import Client, is_cluster

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 1.0  # once stopping: how long a connection waits to connect, or for a reply
STOP_BLOCK_S = 0.5  # once stopping: the longest blocking read (XREAD BLOCK), within the above
STOP_WATCH_S = 0.2  # once stopping: how often the watcher looks for a waiting request
IDLE_WATCH_S = 1.0  # before: how often it wakes to see whether its client closed


class StopGuard:
    """The owner's stop event as one Redis client applies it.

    Once the event is set, a lost connection is not retried, the first request that sees it
    bounds every connection to :data:`STOP_TIMEOUT_S` (:func:`bound_timeouts`; a blocking
    read then waits at most :data:`STOP_BLOCK_S` at a time), and a request that Redis did not
    answer raises :class:`~buffers.BufferStopped` (:meth:`answered`).

    A request already waiting on its socket when the event is set keeps that socket's
    timeout. A Redis killed outright closes the connection at once, but one that hangs (a
    stopped process, a network partition) held a stopping role for up to
    ``request_timeout_s``. So a watcher thread (one per client) asks Redis, on a connection
    of its own, whether it still answers while a request waits once the event is set. If
    Redis does not (a ``PING`` within :data:`STOP_TIMEOUT_S`), the watcher bounds the
    connections, which shuts down the one in use: the waiting request fails at once and
    raises :class:`~buffers.BufferStopped`. If it does, the request is left to finish: it is
    a long poll, or Redis is slow, not gone.

    Until the event is set, the watcher sleeps in its ``wait``, which returns as soon as it
    is, and wakes every :data:`IDLE_WATCH_S` only to end once its client closed. It woke five
    times a second before, for nothing, in every client of every role.
    """

    def __init__(self, stop: threading.Event | None) -> None:
        self._stop = stop
        self._client: Client | None = None
        self._bounded = False
        self._cut = False  # the watcher shut a waiting request's connection down
        self._lock = threading.Lock()  # the watcher and the requests both bound
        self._closed = threading.Event()
        self._waiting = False  # a request is in progress

    def watch(self, client: Client) -> Client:
        """Bound ``client``'s connections once stopping, even while a request waits;
        returns it. :meth:`close` ends the watcher."""
        self._client = client
        if self._stop is not None:
            threading.Thread(target=self._watch, name="redis-stop-guard", daemon=True).start()
        return client

    def close(self) -> None:
        self._closed.set()

    def stopping(self) -> bool:
        """Whether the event is set; the first time it is seen set, the watched client's
        connections are bounded."""
        if self._stop is None or not self._stop.is_set():
            return False
        self._bound()
        return True

    def block_ms(self, wait_s: float) -> int:
        """Milliseconds for a blocking read that may wait ``wait_s``: capped once stopping,
        so that it stays within the bounded socket timeout."""
        return max(1, int(min(wait_s, STOP_BLOCK_S if self.stopping() else wait_s) * 1000))

    @contextmanager
    def answered(self, what: str) -> Iterator[None]:
        """Around a request: once stopping, Redis not answering it is BufferStopped."""
        self.stopping()  # bound the connections before the request goes out
        self._waiting = True
        try:
            yield
        except Exception as exc:
            # A connection the watcher shut down may fail in redis-py in other ways than a
            # closed socket (its parser is reset under the reading thread).
            if not self.stopping() or not (no_answer(exc) or self._cut and
                                           not isinstance(exc, ResponseError)):
                raise
            raise BufferStopped(f"{what}: stopped waiting for Redis: stopping ({exc})") from exc
        finally:
            self._waiting = False

    def _bound(self, cut: bool = False) -> None:
        with self._lock:
            if not self._bounded and self._client is not None:
                self._cut = cut
                bound_timeouts(self._client, STOP_TIMEOUT_S)
                self._bounded = True

    def _watch(self) -> None:
        """Until the client closes: once stopping, while a request waits and nothing has
        bounded the connections yet, see whether Redis answers (at most once a
        :data:`STOP_TIMEOUT_S`), and cut the request short if it does not."""
        assert self._stop is not None and self._client is not None
        while not self._stop.wait(IDLE_WATCH_S):
            if self._closed.is_set():
                return
        next_probe = 0.0
        while not self._closed.is_set() and not self._bounded:
            if self._waiting and time.monotonic() >= next_probe:
                next_probe = time.monotonic() + STOP_TIMEOUT_S
                if not answers(self._client, STOP_TIMEOUT_S) and self._waiting:
                    logger.warning("redis does not answer: a stopping client gives up on its "
                                   "request in progress")
                    self._bound(cut=True)
            self._closed.wait(STOP_WATCH_S)


def no_answer(exc: BaseException) -> bool:
    """Whether ``exc`` says Redis did not answer (gone, hung, a cluster with no reachable
    node), as opposed to an answer that refused the request (a script error, a bad login)."""
    if isinstance(exc, AuthenticationError):
        return False
    return isinstance(exc, (RedisConnectionError, RedisTimeoutError, RedisClusterException,
                            ClusterDownError))


def _pools(client: Client) -> tuple[list[Any], list[dict[str, Any]]]:
    """``client``'s connection pools (one per known node on a cluster), and the settings a
    cluster client gives the pools of nodes it finds later."""
    if is_cluster(client):
        pools = [node.redis_connection.connection_pool for node in client.get_nodes()
                 if node.redis_connection is not None]
        return pools, [client.nodes_manager.connection_kwargs]
    return [client.connection_pool], []


def bound_timeouts(client: Client, timeout_s: float) -> None:
    """Make every connection of ``client`` wait at most ``timeout_s`` to connect and for each
    reply: the settings of its pools (and, on a cluster, of the nodes it finds later) are
    lowered, and their connections, those in use included, closed and dropped, so that the
    next command opens one with them (a redis-py connection keeps the timeouts it was made
    with)."""
    pools, settings = _pools(client)
    for kwargs in [*settings, *(pool.connection_kwargs for pool in pools)]:
        for name in ("socket_timeout", "socket_connect_timeout"):
            kwargs[name] = min(kwargs.get(name) or timeout_s, timeout_s)
    for pool in pools:
        pool.disconnect(inuse_connections=True)
        pool.reset()


def answers(client: Client, timeout_s: float) -> bool:
    """Whether every server ``client`` talks to answers a ``PING`` within ``timeout_s``, each
    on a connection of its own (made with the client's settings, closed after)."""
    for pool in _pools(client)[0]:
        connection = pool.connection_class(**{**pool.connection_kwargs,
                                              "socket_timeout": timeout_s,
                                              "socket_connect_timeout": timeout_s})
        try:
            connection.send_command("PING")
            connection.read_response()
        except Exception:  # noqa: BLE001 - whatever the failure, this server did not answer
            return False
        finally:
            connection.disconnect()
    return True
