"""Replay buffers: the :class:`~buffers.protocol.BufferClient` protocol and its backends."""

from __future__ import annotations

import threading
from collections.abc import Callable

from asyncrl.control_plane import BufferStopped
from buffers.backends import buffer_backend
from buffers.protocol import Batch, Buffer, BufferClient, ControlPlane, Grant, PutResult

__all__ = ["Batch", "Buffer", "BufferClient", "BufferStopped", "ControlPlane", "Grant",
           "PutResult", "buffer_backend", "connect_buffer", "make_buffer_client", "stopped_by",
           "unanswered"]


def stopped_by(exc: BaseException) -> BufferStopped | None:
    """The :class:`BufferStopped` that ``exc`` is or was raised from (``raise ... from``): the
    learner's prefetcher and weight publisher re-raise their thread's failure that way. Only
    explicit causes count: an error raised while cleaning up after a stop is a real one."""
    found = _raised_from(exc, lambda e: isinstance(e, BufferStopped))
    return found if isinstance(found, BufferStopped) else None


def unanswered(exc: BaseException) -> BaseException | None:
    """The failure ``exc`` is or was raised from (``raise ... from``) that says the buffer did
    not answer: a ZMQ request given up on (any :class:`TimeoutError`, :class:`BufferStopped`
    included) or Redis gone, hung or unreachable (:func:`buffers.redis_stop.no_answer`).
    None for anything else, such as a request the buffer answered with a refusal."""
    from buffers.redis_stop import no_answer

    return _raised_from(exc, lambda e: isinstance(e, TimeoutError) or no_answer(e))


def _raised_from(exc: BaseException | None,
                 matches: Callable[[BaseException], bool]) -> BaseException | None:
    """The first of ``exc`` and its explicit causes (``raise ... from``) that ``matches``."""
    while exc is not None:
        if matches(exc):
            return exc
        exc = exc.__cause__
    return None


def connect_buffer(cfg, address: str | None = None,
                   stop: threading.Event | None = None) -> BufferClient:
    """A client for the run described by the root config ``cfg`` (what every role opens);
    ``stop``: the role's stop event (see :func:`make_buffer_client`). It carries the run's
    token (:func:`~buffers.run_token.read_token`: from `up`, or the run directory)."""
    from buffers.run_token import read_token

    return make_buffer_client(cfg.buffer, address, run_id=cfg.run.name,
                              groups_per_step=cfg.learner.groups_per_step, stop=stop,
                              token=read_token(cfg.run_dir))


def make_buffer_client(config, address: str | None = None, *, run_id: str = "",
                       groups_per_step: int | None = None,
                       stop: threading.Event | None = None,
                       token: str | None = None) -> BufferClient:
    """A client for the backend ``config.type`` names (a :class:`asyncrl.config.BufferConfig`;
    :func:`~buffers.backends.buffer_backend` is the factory that knows the names).

    ``address`` (``tcp://host:port``) overrides the one derived from the config, for roles
    pointed at a ZMQ broker started elsewhere. Redis has no broker process, so every client
    applies the gate itself and needs what the ZMQ broker is started with: ``run_id`` (the
    run name; keys live under ``buffer.redis.namespace`` or ``asyncrl:<run_id>``) and
    ``groups_per_step`` (``learner.groups_per_step``). Both are ignored for ZMQ.

    ``stop``: the role's stop event. Once set, a request no longer waits out
    ``request_timeout_s`` and its re-sends (ZMQ) or redis-py's reconnect retries (Redis) for a
    broker or Redis that does not answer; it raises :class:`BufferStopped` instead (see
    :class:`~buffers.zmq_client.ZmqBufferClient` and
    :class:`~buffers.redis_stop.StopGuard`), so a role whose buffer is gone for good still
    stops promptly on a signal. A live one still answers: long polls run their course.

    ``token``: the run's token (:mod:`buffers.run_token`), which a ZMQ broker asks of the
    commands that change the run (Redis has its own AUTH and ignores it).
    """
    return buffer_backend(config).client(address, run_id=run_id,
                                         groups_per_step=groups_per_step, stop=stop,
                                         token=token)
