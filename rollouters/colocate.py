"""A rollout worker's part in the colocated mode (``launcher.colocate``): a
:class:`~asyncrl.colocate.PhaseFollower` that puts its engine to sleep while the learner steps
and wakes it after, on a thread and a buffer client of its own."""

from __future__ import annotations

import threading
from collections.abc import Callable

from asyncrl.config import Config
from buffers import connect_buffer
from rollouters.heartbeat import Heartbeat


def follow_phases(cfg: Config, engine: object, member: str, address: str | None,
                  stop: threading.Event, beat: Heartbeat) -> Callable[[], None]:
    """Start following the learner's phases with ``engine``, if the run is colocated; returns
    what ends it (it wakes an engine left asleep). The worker's heartbeat says ``phase``:
    ``asleep`` or ``awake`` (the monitor shows it)."""
    if not cfg.launcher.colocate:
        return lambda: None
    from asyncrl.colocate import PhaseFollower

    client = connect_buffer(cfg, address, stop)
    follower = PhaseFollower(client, member, engine, stop,  # type: ignore[arg-type]
                             on_phase=lambda phase: beat.merge({"phase": phase}))
    follower.start()

    def close() -> None:
        try:
            follower.close()
        finally:
            client.close()

    return close
