"""A rollout worker's heartbeat, on a thread of its own: :class:`Heartbeat`.

The worker's loop would heartbeat only between two generation windows, and one window can take
many seconds with a real model or a long agent episode. The weight broadcaster evicts a member
silent for half of ``weights.timeout_s`` during an update as frozen
(:mod:`asyncrl.weights.membership`), and the buffer lets go of one silent for
``buffer.heartbeat_timeout_s``: liveness must not depend on how long a batch takes. So a
thread says the worker is alive every ``period_s``, with the latest metrics the loop handed
it, on a client of its own (clients are not thread-safe). Only a stopped process (SIGSTOP, a
debugger, swap) or a dead one falls silent.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from asyncrl.control_plane import BufferStopped, ControlPlane

logger = logging.getLogger(__name__)


class Heartbeat:
    """Heartbeats ``member`` (role ``rollout``) every ``period_s`` with the info last given to
    :meth:`update`; :attr:`reply` is the last answer (the run state). The owner sends the
    worker's last heartbeat itself, after :meth:`stop`, so that none comes after it."""

    def __init__(self, client: ControlPlane, member: str, info: dict[str, Any],
                 period_s: float) -> None:
        self._client = client
        self._member = member
        self._info = info
        self._period_s = period_s
        self._stop = threading.Event()
        self.reply: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{member}",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def update(self, info: dict[str, Any]) -> None:
        """What the next heartbeats say (a new dict: the thread reads it without a lock)."""
        self._info = info

    def merge(self, extra: dict[str, Any]) -> None:
        """Add ``extra`` to what the next heartbeats say (a thread of the worker other than
        its loop: the colocated phase follower)."""
        self._info = {**self._info, **extra}

    def stop(self) -> None:
        """End the thread and wait for its heartbeat in flight, if any."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while True:
            try:
                self.reply = self._client.heartbeat(self._member, "rollout", self._info)
            except BufferStopped:  # the worker is stopping on a signal
                return
            except Exception as exc:  # noqa: BLE001 - the loop's own requests report a lost buffer
                logger.warning("heartbeat of %s failed: %s", self._member, exc)
            if self._stop.wait(self._period_s):
                return
