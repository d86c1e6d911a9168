"""Each buffer backend (``buffer.type``) as one object: what the rest of the code asks of it.

The launchers, the command line and the learner need to know a few things about the buffer
they run with: is there a broker process to start (`asyncrl buffer`, Ray's broker actor and
its resources) and where do the roles dial it, what does a run's start do to the buffer, what
must answer before `up` starts anything, what to tell a user whose buffer holds an earlier run.
:func:`buffer_backend` is the only code that knows the backends' names; everything else asks
the :class:`BufferBackend` it returns. Backend modules (pyzmq, redis-py) are imported lazily,
inside the methods, so asking costs nothing.

To add a backend: its client (the :class:`~buffers.protocol.BufferClient` protocol, checked by
the contract suite in ``tests/buffers``), one class here, its name in :func:`buffer_backend`
and in ``buffer.type``'s choices, and its keys in a ``[buffer.<name>]`` sub-table.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol

from asyncrl.config.errors import ConfigError

if TYPE_CHECKING:
    from asyncrl.config.schema import BufferConfig
    from buffers.protocol import BufferClient

__all__ = ["BufferBackend", "RedisBackend", "ZmqBackend", "buffer_backend"]

_ENDPOINT = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):(\d{1,5})")


class BufferBackend(Protocol):
    """One buffer backend, bound to the run's ``[buffer]`` config."""

    config: BufferConfig
    broker: ClassVar[bool]
    """Runs as a broker process of its own (`asyncrl buffer`; under Ray, an actor with
    ``resources.buffer``) that the roles dial at an address. Without one, every client
    reaches the backend's server from the config alone."""
    no_broker: ClassVar[str]
    """What `asyncrl buffer` tells a user whose backend has no broker process to run."""

    def client(self, address: str | None, *, run_id: str, groups_per_step: int | None,
               stop: threading.Event | None, token: str | None = None) -> BufferClient:
        """A client of this backend (see :func:`buffers.make_buffer_client`); ``token``: the
        run's (:mod:`buffers.run_token`), for a backend whose broker asks for it."""

    def dial_address(self, explicit: str | None, recorded: Path) -> str | None:
        """The broker address the roles dial: ``explicit`` (``--buffer``), else the one
        `asyncrl up` recorded in the file ``recorded``, else the configured one. None without
        a broker. Raises :class:`ConfigError` for one that is not an address."""

    def start_run(self, run_id: str, resuming: bool) -> None:
        """What `asyncrl up` (either launcher) does to the buffer as run ``run_id`` starts,
        before any role: a fresh run must not inherit an earlier one's state."""

    def preflight(self) -> None:
        """Raise :class:`ConfigError` when the backend's server, which no role starts, does
        not answer (`up` before it starts anything, `status` before it asks)."""

    def earlier_run_hint(self, run_dir: Path) -> str:
        """How to start a fresh run when the buffer still holds an earlier run of the name."""


@dataclass(frozen=True)
class ZmqBackend:
    """``buffer.type = "zmq"``: an embedded broker process that the roles dial; it sets the
    previous run's spill file aside, or replays it, itself (:mod:`buffers.zmq_replay`)."""

    config: BufferConfig
    broker: ClassVar[bool] = True
    no_broker: ClassVar[str] = ""

    def client(self, address: str | None, *, run_id: str, groups_per_step: int | None,
               stop: threading.Event | None, token: str | None = None) -> BufferClient:
        from buffers.zmq_client import ZmqBufferClient

        return ZmqBufferClient.from_config(self.config, address, stop=stop, token=token)

    def dial_address(self, explicit: str | None, recorded: Path) -> str | None:
        if explicit:
            return _endpoint(explicit, "--buffer")
        if recorded.exists():
            return _endpoint(recorded.read_text(errors="replace").strip(), str(recorded))
        zmq = self.config.zmq
        if zmq.port == 0:
            raise ConfigError("buffer.zmq.port is 0 (pick a free port) and no --buffer address "
                              f"was given nor recorded in {recorded}")
        return f"tcp://{zmq.host}:{zmq.port}"

    def start_run(self, run_id: str, resuming: bool) -> None:
        return None  # the broker `up` starts next holds the run's state

    def preflight(self) -> None:
        return None  # the broker is started by `up`; `status` checks it at its address

    def earlier_run_hint(self, run_dir: Path) -> str:
        from buffers.zmq_replay import spill_file

        spill = spill_file(self.config.zmq.spill_path, run_dir)
        return f"move its spill file {spill} aside" if spill else "restart the broker"


@dataclass(frozen=True)
class RedisBackend:
    """``buffer.type = "redis"``: Redis Streams. Redis is the broker, so there is no process
    to start and no address to learn, and every client applies the gate itself."""

    config: BufferConfig
    broker: ClassVar[bool] = False
    no_broker: ClassVar[str] = ("Redis is the broker, there is no `asyncrl buffer` process to "
                                "run; point the roles at buffer.redis.url")

    def client(self, address: str | None, *, run_id: str, groups_per_step: int | None,
               stop: threading.Event | None, token: str | None = None) -> BufferClient:
        from buffers.redis_buffer import RedisBufferClient

        # token: not used, Redis's own AUTH guards its commands (see buffers.run_token)
        if groups_per_step is None:
            raise ValueError("buffer.type = 'redis' needs groups_per_step "
                             "(learner.groups_per_step): every client applies the gate")
        return RedisBufferClient(self.config, run_id=run_id, groups_per_step=groups_per_step,
                                 stop=stop)

    def dial_address(self, explicit: str | None, recorded: Path) -> str | None:
        return None  # buffer.redis.url is the address

    def start_run(self, run_id: str, resuming: bool) -> None:
        from buffers.redis_buffer import start_run

        start_run(self.config, run_id, resuming)

    def preflight(self) -> None:
        from buffers.redis_connect import check_redis

        check_redis(self.config)

    def earlier_run_hint(self, run_dir: Path) -> str:
        return "clear the run's Redis keys, as a fresh `asyncrl up` does"


def buffer_backend(config: BufferConfig) -> BufferBackend:
    """The backend ``config.type`` names, bound to ``config``; the one place that knows the
    names. ``ValueError`` for an unknown one."""
    if config.type == "zmq":
        return ZmqBackend(config)
    if config.type == "redis":
        return RedisBackend(config)
    raise ValueError(f"buffer.type: unknown backend {config.type!r}")


def _endpoint(address: str, source: str) -> str:
    """A broker address as ZMQ dials it; anything else is a config error naming where it
    came from (was ``zmq.error.ZMQError: Invalid argument`` with a traceback, or, for an
    empty ``buffer.addr``, a minute of waiting)."""
    match = _ENDPOINT.fullmatch(address)
    if match is None or not 0 < int(match.group(2)) < 65536:
        raise ConfigError(f"{source}: {address!r} is not a broker address "
                          "(tcp://HOST:PORT, e.g. tcp://127.0.0.1:5555)")
    return address
