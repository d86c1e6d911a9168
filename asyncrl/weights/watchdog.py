"""A bound on every wait of a weight group: :class:`Watchdog`.

An NCCL collective whose peer froze or died does not raise: the host waits on a CUDA event
that never fires, and NCCL's own timeout is enforced only by its watchdog, which by default
takes the whole process down (TRL had to learn this, #6796, #6913). Gloo raises at its own
timeout but keeps the group's threads blocked. So every collective a group posts is watched
here: once a collective has been pending for ``timeout_s`` with none of the group's finishing
meanwhile, the group is aborted (NCCL: ``ncclCommAbort``, which ends the pending kernels),
every pending collective of it fails, and whoever waits on one gets a ``RuntimeError`` at
once. The clock is progress, not age: a receiver posts all of an update's buckets at once,
and a large update may take longer than ``timeout_s`` in all while every bucket is quick.
The broadcaster treats a failed wait as any failed collective: it drops the group, the next
attempt's handshake finds who is gone and evicts it, the next epoch rebuilds the group. The
same code runs for gloo, so CPU tests exercise it.

One thread per group, started with the first watch, waiting on a condition until the
pending collectives' deadline (no polling); it ends with the group.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class Watched:
    """One posted collective as the watchdog sees it: settled once it finished or expired."""

    def __init__(self, posted: float) -> None:
        self.posted = posted
        self.settled = threading.Event()
        self.expired: str | None = None  # why it was given up, once it was


class Watchdog:
    """Gives up on a group whose oldest pending collective saw no progress (none of the
    group's collectives finished) for ``timeout_s``: calls ``abort`` once (from its own
    thread) and settles every pending collective as expired."""

    def __init__(self, timeout_s: float, abort: Callable[[], None], name: str) -> None:
        self._timeout_s = timeout_s
        self._abort = abort
        self._name = name
        self._cv = threading.Condition()
        self._items: list[Watched] = []
        self._progress_at = 0.0  # when a collective of the group last finished
        self._closed = False
        self._thread: threading.Thread | None = None

    def watch(self) -> Watched:
        """A new collective; the caller sets ``settled`` when it finishes (and calls
        :meth:`poke`)."""
        item = Watched(time.monotonic())
        with self._cv:
            if self._closed:
                item.expired = f"weight group {self._name} already closed"
                item.settled.set()
                return item
            self._items.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"weights-watchdog-{self._name}")
                self._thread.start()
            self._cv.notify()
        return item

    def poke(self) -> None:
        """A collective finished: progress, so the clock of the ones still pending restarts."""
        with self._cv:
            self._progress_at = time.monotonic()
            self._cv.notify()

    def close(self) -> None:
        """Stop watching (the group is being let go); pending items are left as they are."""
        with self._cv:
            self._closed = True
            self._cv.notify()

    def _run(self) -> None:
        expired = self._next_expired()
        if not expired:
            return  # closed with nothing overdue
        reason = (f"weight group {self._name}: a collective took longer than "
                  f"{self._timeout_s:.1f} s (weights.timeout_s); communicator aborted")
        logger.warning("weights: %s", reason)
        try:
            self._abort()
        except RuntimeError as exc:  # already broken: nothing left to end
            logger.debug("abort of weight group %s: %s", self._name, exc)
        for item in expired:
            item.expired = reason
            item.settled.set()

    def _next_expired(self) -> list[Watched]:
        """Wait until the pending collectives went ``timeout_s`` without progress (then every
        one fails with the group, and the watchdog closes) or the watchdog is closed (empty)."""
        with self._cv:
            while not self._closed:
                self._items = [item for item in self._items if not item.settled.is_set()]
                if not self._items:
                    self._cv.wait()
                    continue
                since = max(min(item.posted for item in self._items), self._progress_at)
                remaining = since + self._timeout_s - time.monotonic()
                if remaining > 0:
                    self._cv.wait(remaining)
                    continue
                expired, self._items, self._closed = self._items, [], True
                return expired
        return []
