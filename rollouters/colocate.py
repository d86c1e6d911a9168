"""A rollout worker's part in the colocated mode (``launcher.colocate``): a
:class:`~asyncrl.colocate.PhaseFollower` that puts its engine to sleep while the learner steps
and wakes it after, on a thread and a buffer client of its own."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from asyncrl.colocate import Sleeper
from asyncrl.config import Config
from buffers import connect_buffer
from rollouters.heartbeat import Heartbeat

logger = logging.getLogger(__name__)


class _WithReceiver:
    """The engine as the follower puts it to sleep: the engine, then the weight receiver's
    receive buffers (on the device with an ``ipc`` or ``nccl`` group: a model's worth, or
    two while the engine adopts received tensors), which the learner needs free too."""

    def __init__(self, engine: Sleeper, receiver: Any, timeout_s: float) -> None:
        self._engine = engine
        self._receiver = receiver
        self._timeout_s = timeout_s

    @property
    def asleep(self) -> bool:
        return self._engine.asleep

    def sleep(self) -> None:
        self._engine.sleep()
        release = getattr(self._receiver, "release_buffers", None)
        if release is not None and not release(self._timeout_s):
            logger.warning("colocate: the weight receiver kept its buffers: an update was "
                           "still being received after %.1f s", self._timeout_s)

    def wake_up(self) -> None:
        self._engine.wake_up()

    def memory(self) -> dict[str, int]:
        """The engine's own figures, and the receiver's buffers (``receive_bytes``)."""
        held = getattr(self._engine, "memory", None)
        return {**(held() if held is not None else {}),
                "receive_bytes": getattr(self._receiver, "buffer_bytes", 0)}


def follow_phases(cfg: Config, engine: Any, receiver: Any, member: str, address: str | None,
                  stop: threading.Event, beat: Heartbeat) -> Callable[[], None]:
    """Start following the learner's phases with ``engine`` and its weight ``receiver``, if
    the run is colocated; returns what ends it (it wakes an engine left asleep). The
    worker's heartbeat says ``phase``: ``asleep`` or ``awake`` (the monitor shows it)."""
    if not cfg.launcher.colocate:
        return lambda: None
    from asyncrl.colocate import PhaseFollower

    client = connect_buffer(cfg, address, stop)
    follower = PhaseFollower(client, member, _WithReceiver(engine, receiver,
                                                           cfg.weights.timeout_s), stop,
                             on_phase=lambda phase: beat.merge({"phase": phase}))
    follower.start()

    def close() -> None:
        try:
            follower.close()
        finally:
            client.close()

    return close
