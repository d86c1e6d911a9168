"""How the Redis buffer connects: auth, TLS, reconnects and Redis Cluster, from
:class:`BufferConfig` alone.

Kept apart from the client so the mapping from config to redis-py arguments is one pure
function that tests can check without a server (and without TLS certificates).

A ``buffer.redis.url`` that names a node of a Redis Cluster is detected (``INFO cluster``,
unless ``buffer.redis.cluster`` says yes or no) and served by redis-py's cluster client, so
switching to a cluster is that one line too. Every key of a run must then live in one hash slot
(the scripts touch them together), so the run's namespace is wrapped in a hash tag,
``{asyncrl:run}``, unless it carries one already.

A client given the role's stop event does not retry a lost connection once it is set
(:class:`ReconnectRetry`); the rest of what a stop means is :mod:`buffers.redis_stop`. A client
given an :class:`~buffers.outage.OutageWatch` reports the first retried failure of an outage and
the first answer after it (one warning each, :mod:`buffers.outage`).
"""

from __future__ import annotations

import copy
import logging
import math
import threading
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.cluster import RedisCluster
from redis.connection import parse_url
from redis.exceptions import AuthenticationError, NoPermissionError, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.retry import Retry

from asyncrl.config.errors import ConfigError
from asyncrl.config.schema import BufferConfig
from buffers.outage import OutageWatch

T = TypeVar("T")
logger = logging.getLogger(__name__)

BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 1.0
CONNECT_TIMEOUT_CAP_S = 5.0
REDIS_PROBE_S = 2.0
"""How long `up` and `status` retry a Redis that refuses them before reporting it
(:func:`check_redis`). The roles' own clients keep retrying for ``buffer.request_timeout_s`` (a
Redis restarting mid-run); at start a refused connection is a wrong URL or a server not
started, and waiting hides that."""


class ReconnectRetry(Retry):
    """Retries a lost connection (a restarting ``redis-server``), never a refused login:
    redis-py makes :class:`AuthenticationError` a :class:`ConnectionError`, and retrying a
    wrong password only delays the error. Nor once ``stop`` is set: a stopping role does not
    wait for a Redis that went away (the error is raised, see :class:`StopGuard`). Each failure
    it retries and each success go to ``watch`` (the outage warnings): a first failure is
    only suspect (a pooled connection closed by a restart the client slept through), a
    second one of the same request an outage."""

    def __init__(self, backoff: Any, retries: int,
                 supported_errors: tuple[type[Exception], ...] = (RedisConnectionError,),
                 stop: threading.Event | None = None, watch: OutageWatch | None = None) -> None:
        super().__init__(backoff, retries, supported_errors)
        self._stop = stop
        self._watch = watch

    def __deepcopy__(self, memo: dict[int, Any]) -> ReconnectRetry:
        """redis-py gives every connection a deep copy: the copies share the stop event (an
        event cannot be copied, and a copy would never be set) and the outage watch."""
        clone = copy.copy(self)
        clone._backoff = copy.deepcopy(self._backoff, memo)
        return clone

    def _stopping(self) -> bool:
        return self._stop is not None and self._stop.is_set()

    def get_retries(self) -> int:
        """The cluster client reads its retry count here (it retries by itself)."""
        return 0 if self._stopping() else super().get_retries()

    def call_with_retry(self, do: Callable[[], T], fail: Callable[..., Any],
                        is_retryable: Callable[[Exception], bool] | None = None,
                        with_failure_count: bool = False) -> T:
        def retryable(error: Exception) -> bool:
            if isinstance(error, (AuthenticationError, ResponseError)) or self._stopping():
                return False
            return is_retryable(error) if is_retryable is not None else True

        failures = 0

        def failed(error: Exception, *count: int) -> Any:
            nonlocal failures
            failures += 1
            if self._watch is not None and failures == 1:  # a stale pooled connection?
                self._watch.suspect()
            elif self._watch is not None:
                self._watch.failed(error)
            return fail(error, *count)

        result = super().call_with_retry(do, failed, retryable, with_failure_count)
        if self._watch is not None:
            self._watch.answered()
        return result


def reconnect_retries(total_s: float) -> int:
    """Retries whose backoffs (0.1 s, 0.2 s, ... capped at 1 s) add up to about ``total_s``."""
    waited, retries = 0.0, 0
    while waited < total_s:
        retries += 1
        waited += min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** retries)
    return max(1, retries)


def connection_kwargs(config: BufferConfig, stop: threading.Event | None = None,
                      watch: OutageWatch | None = None) -> dict[str, Any]:
    """Keyword arguments for ``redis.Redis.from_url(config.redis.url, ...)``; ``stop``: the
    owner's stop event (no retries once it is set); ``watch``: told of retried failures.

    Only connection errors are retried: a command that reached Redis and failed is not
    repeated (a script's effects may already be applied). TLS options need a ``rediss://``
    URL; setting them on a plain URL is a config error rather than a silently clear channel.
    """
    server = config.redis
    scheme = urlsplit(server.url).scheme
    if scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"buffer.redis.url: expected redis://, rediss:// or unix://, "
                         f"got {server.url!r}")
    tls = {name: value for name, value in (("ssl_ca_certs", server.tls_ca_file),
                                           ("ssl_certfile", server.tls_cert_file),
                                           ("ssl_keyfile", server.tls_key_file)) if value}
    if tls and scheme != "rediss":
        raise ValueError("buffer.redis.tls_* files are set but buffer.redis.url is not rediss://")
    kwargs: dict[str, Any] = {
        "socket_timeout": config.request_timeout_s,
        "socket_connect_timeout": min(config.request_timeout_s, CONNECT_TIMEOUT_CAP_S),
        "retry": ReconnectRetry(ExponentialBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S),
                                reconnect_retries(config.request_timeout_s), stop=stop,
                                watch=watch),
        "health_check_interval": max(1, math.ceil(config.heartbeat_timeout_s)),
        "decode_responses": False,
        **tls,
    }
    if server.username:
        kwargs["username"] = server.username
    if server.password:
        kwargs["password"] = server.password
    return kwargs


Client = redis.Redis | RedisCluster


def connect(config: BufferConfig, stop: threading.Event | None = None,
            watch: OutageWatch | None = None) -> Client:
    """A client for ``config.redis.url``: the cluster client for a Redis Cluster node
    (``buffer.redis.cluster``; "auto" sends one ``INFO cluster`` to find out, and a unix socket is
    never a cluster node). Nothing else is sent. ``stop``, ``watch``: see
    :func:`connection_kwargs`."""
    kwargs = connection_kwargs(config, stop, watch)
    server = config.redis
    if server.cluster != "yes":
        client = redis.Redis.from_url(server.url, **kwargs)
        if server.cluster == "no" or urlsplit(server.url).scheme == "unix" or \
                not _cluster_enabled(client, server.url):
            return client  # the probe's connection serves the first command
        client.close()
    if parse_url(server.url).get("db", 0):
        raise ValueError(f"buffer.redis.url {server.url!r}: a Redis Cluster has only database 0")
    retry = kwargs.pop("retry")  # the cluster client takes it as an argument of its own
    return RedisCluster.from_url(server.url, retry=retry, **kwargs)


def check_redis(config: BufferConfig, wait_s: float = REDIS_PROBE_S) -> None:
    """Raise a :class:`ConfigError` naming ``buffer.redis.url`` when Redis there does not answer a
    PING within about ``wait_s`` (refused, unknown host, wrong password, not Redis)."""
    try:
        client = connect(config.model_copy(update={"request_timeout_s": wait_s}))
        try:
            client.ping()
        finally:
            client.close()
    except RedisError as exc:
        raise ConfigError(f"buffer.redis.url: {config.redis.url!r}: {exc}") from None
    except ValueError as exc:  # connect()'s own checks of the URL and TLS files
        raise ConfigError(str(exc)) from None


def _cluster_enabled(client: redis.Redis, url: str) -> bool:
    """Whether the node is in cluster mode; ``client`` is closed when this raises."""
    try:
        return bool(int(client.info("cluster").get("cluster_enabled", 0)))
    except NoPermissionError:
        logger.info("redis at %s: this user may not run INFO, taken as a single server "
                    "(set buffer.redis.cluster = \"yes\" for a cluster)", url)
        return False
    except ResponseError as exc:
        client.close()
        if "not allowed in cluster mode" in str(exc):  # the URL's database, selected first
            raise ValueError(f"buffer.redis.url {url!r}: a Redis Cluster has only database 0"
                             ) from None
        raise
    except BaseException:
        client.close()
        raise


def is_cluster(client: Client) -> bool:
    return isinstance(client, RedisCluster)


def run_namespace(config: BufferConfig, run_id: str, cluster: bool) -> str:
    """The key prefix of run ``run_id``: ``buffer.redis.namespace``, or ``asyncrl:<run>``; in a
    cluster wrapped in a hash tag unless it has one, so that every key is in one slot."""
    namespace = config.redis.namespace or f"asyncrl:{run_id or 'default'}"
    if cluster and not _hash_tag(namespace):
        namespace = f"{{{namespace}}}"
    return namespace


def _hash_tag(key: str) -> str:
    """What Redis Cluster hashes of ``key``: the text between the first ``{`` and the next
    ``}``, when not empty (else the whole key, shown here as "")."""
    start = key.find("{")
    end = key.find("}", start + 1) if start >= 0 else -1
    return key[start + 1:end] if end > start + 1 else ""
