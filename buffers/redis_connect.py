"""How the Redis buffer connects: auth, TLS and reconnects, from :class:`BufferConfig` alone.

Kept apart from the client so the mapping from config to redis-py arguments is one pure
function that tests can check without a server (and without TLS certificates).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import AuthenticationError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.retry import Retry

from asyncrl.config.schema import BufferConfig

T = TypeVar("T")

BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 1.0
CONNECT_TIMEOUT_CAP_S = 5.0


class ReconnectRetry(Retry):
    """Retries a lost connection (a restarting ``redis-server``), never a refused login:
    redis-py makes :class:`AuthenticationError` a :class:`ConnectionError`, and retrying a
    wrong password only delays the error."""

    def call_with_retry(self, do: Callable[[], T], fail: Callable[..., Any],
                        is_retryable: Callable[[Exception], bool] | None = None,
                        with_failure_count: bool = False) -> T:
        def retryable(error: Exception) -> bool:
            if isinstance(error, (AuthenticationError, ResponseError)):
                return False
            return is_retryable(error) if is_retryable is not None else True

        return super().call_with_retry(do, fail, retryable, with_failure_count)


def reconnect_retries(total_s: float) -> int:
    """Retries whose backoffs (0.1 s, 0.2 s, ... capped at 1 s) add up to about ``total_s``."""
    waited, retries = 0.0, 0
    while waited < total_s:
        retries += 1
        waited += min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** retries)
    return max(1, retries)


def connection_kwargs(config: BufferConfig) -> dict[str, Any]:
    """Keyword arguments for ``redis.Redis.from_url(config.url, ...)``.

    Only connection errors are retried: a command that reached Redis and failed is not
    repeated (a script's effects may already be applied). TLS options need a ``rediss://``
    URL; setting them on a plain URL is a config error rather than a silently clear channel.
    """
    scheme = urlsplit(config.url).scheme
    if scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"buffer.url: expected redis://, rediss:// or unix://, got {config.url!r}")
    tls = {name: value for name, value in (("ssl_ca_certs", config.tls_ca_file),
                                           ("ssl_certfile", config.tls_cert_file),
                                           ("ssl_keyfile", config.tls_key_file)) if value}
    if tls and scheme != "rediss":
        raise ValueError("buffer.tls_* files are set but buffer.url is not rediss://")
    kwargs: dict[str, Any] = {
        "socket_timeout": config.request_timeout_s,
        "socket_connect_timeout": min(config.request_timeout_s, CONNECT_TIMEOUT_CAP_S),
        "retry": ReconnectRetry(ExponentialBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S),
                                reconnect_retries(config.request_timeout_s),
                                supported_errors=(RedisConnectionError,)),
        "health_check_interval": max(1, math.ceil(config.heartbeat_timeout_s)),
        "decode_responses": False,
        **tls,
    }
    if config.username:
        kwargs["username"] = config.username
    if config.password:
        kwargs["password"] = config.password
    return kwargs


def connect(config: BufferConfig) -> redis.Redis:
    """A client for ``config.url``; nothing is sent until the first command."""
    return redis.Redis.from_url(config.url, **connection_kwargs(config))
