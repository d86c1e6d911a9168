"""Rank 0 fetches and collates the next batch while the current step computes.

Why: between two optimizer steps rank 0 otherwise asks the buffer for the next batch, waits
for its reply, filters and collates (pads) its groups: CPU work and a round trip on the
critical path, though none of it depends on the step in progress. bench/pipeline.py measured
it at 5-10 % of a step with 64 groups of 8 samples on a loaded 2-core machine.

Nothing else changes: the batch is asked for at the version it will be trained at (``V + 1``
while step ``V + 1`` is computed), so the buffer drops exactly what it would have dropped and
the gate is untouched (it counts accepted groups, not consumed ones); with ``max_staleness =
0`` the request waits until version ``V + 1`` is published and its groups exist, as before.
A fetched batch is leased (renewed, :func:`buffers.lease.keep_leased`) until it is handed
over, so a long step never gets it reclaimed and trained twice. A batch fetched when the
learner stops stays unacked: the buffer redelivers it (at-least-once), as before.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from buffers.lease import keep_leased
from buffers.protocol import Batch, Buffer

logger = logging.getLogger(__name__)

Prepare = Callable[[Batch], Any]


class BatchPrefetcher:
    """Fetches the batch of one version at a time on a thread, and prepares it.

    ``client`` is used only by this object's threads (clients are not thread-safe): the caller
    gives it a client of its own and never touches it again; :meth:`close` closes it.
    """

    def __init__(self, client: Buffer, member: str, count: int, prepare: Prepare,
                 poll_s: float, reclaim_idle_s: float) -> None:
        self._client, self._member, self._count = client, member, count
        self._prepare, self._poll_s, self._reclaim_idle_s = prepare, poll_s, reclaim_idle_s
        self._ready = threading.Condition()
        self._result: tuple[Batch, Any] | None = None
        self._error: BaseException | None = None
        self._version: int | None = None  # of the fetch in flight or done, not yet taken
        self._thread: threading.Thread | None = None
        self._handed = threading.Event()  # the fetched batch was taken: stop renewing it
        self._stop = threading.Event()

    def start(self, version: int) -> None:
        """Begin fetching the batch to be trained at ``version`` (no-op if it already is)."""
        if self._version == version:
            return
        if self._thread is not None:
            raise RuntimeError(f"prefetching version {self._version}, asked for {version}")
        self._version, self._result, self._error = version, None, None
        self._handed.clear()
        self._thread = threading.Thread(target=self._run, args=(version,), daemon=True,
                                        name=f"prefetch-v{version}")
        self._thread.start()

    def take(self, version: int, timeout_s: float) -> tuple[Batch, Any] | None:
        """``(batch, prepare(batch))`` for ``version`` once fetched (waits at most
        ``timeout_s``; the fetch goes on after a timeout). Re-raises a failed fetch."""
        self.start(version)
        with self._ready:
            self._ready.wait_for(lambda: self._result is not None or self._error is not None,
                                 timeout_s)
            result, error = self._result, self._error
        if result is None and error is None:
            return None
        self._finish()
        if error is not None:
            raise RuntimeError(f"fetching the batch of version {version} failed") from error
        return result

    def prepared(self, version: int) -> Any | None:
        """``prepare(batch)`` of ``version`` if it is fetched already, else None (at once;
        nothing is handed over: :meth:`take` still must be called, and then returns it)."""
        with self._ready:
            if self._version == version and self._result is not None:
                return self._result[1]
        return None

    def close(self) -> None:
        """Stop fetching (within one long-poll) and close the client (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            self._finish()
        finally:
            self._client.close()

    def _finish(self) -> None:
        self._handed.set()
        if self._thread is not None:
            self._thread.join()
        self._thread, self._version = None, None

    def _run(self, version: int) -> None:
        try:
            batch = None
            while batch is None and not self._stop.is_set():
                batch = self._client.get_batch(self._member, self._count, version, self._poll_s)
            if batch is None:
                return
            with keep_leased(self._client, self._member, batch, self._reclaim_idle_s):
                prepared = self._prepare(batch)
                with self._ready:
                    self._result = (batch, prepared)
                    self._ready.notify_all()
                self._handed.wait()  # the step that trains it renews its lease from now on
        except BaseException as exc:  # noqa: BLE001 - re-raised by take() on the caller's thread
            with self._ready:
                self._error = exc
                self._ready.notify_all()
