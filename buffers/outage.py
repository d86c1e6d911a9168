"""Warnings for an outage of the buffer: one line when it stops answering, one when it is back.

Why: the clients retry a Redis or a ZMQ broker that went away (redis-py's reconnects, the ZMQ
client's re-sends), which is what keeps a run alive through a restart, but they did it in
silence: a Redis restart paused training for seconds with nothing in any log. Now the first
failure of an outage logs ``buffer: lost connection to ADDRESS (retrying): WHY`` and the first
answer after it ``buffer: reconnected to ADDRESS after 4.8 s``, as WARNINGs, which every role
writes to its log and the console.

Once per outage, not per retry and not per client: a role holds several clients of one buffer
(a learner's batch feed, lease and weights clients; a rollout worker's two), and each meets the
same outage. So the lines come from one :class:`OutageBoard` per process (:data:`BOARD`, like
a logger, it only decides what is logged), and each client reports to it through an
:class:`OutageWatch`, which costs nothing while its requests are answered.
"""

from __future__ import annotations

import logging
import threading
import time
from urllib.parse import urlsplit, urlunsplit

logger = logging.getLogger(__name__)


class OutageBoard:
    """The outages of this process's buffers, by address: the first failure opens one (and
    logs it), the first answer closes it (and logs how long it lasted)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since: dict[str, float] = {}

    def lost(self, address: str, why: str, since: float | None = None) -> None:
        """``address`` stopped answering (at ``since``, a ``time.monotonic()``; else now)."""
        with self._lock:
            if address in self._since:
                return
            self._since[address] = time.monotonic() if since is None else since
        logger.warning("buffer: lost connection to %s (retrying): %s", address, why)

    def back(self, address: str) -> None:
        with self._lock:
            since = self._since.pop(address, None)
        if since is not None:
            logger.warning("buffer: reconnected to %s after %.1f s", address,
                           time.monotonic() - since)

    def down(self, address: str) -> bool:
        with self._lock:
            return address in self._since


BOARD = OutageBoard()


class OutageWatch:
    """One client's reports: :meth:`failed` when a request found the buffer unreachable,
    :meth:`answered` on every answer (a flag test until something failed).

    :meth:`suspect` notes a sign that is not yet an outage: a ZMQ connection that dropped,
    a Redis connection that failed once (a pooled connection the server closed when it
    restarted). If an answer (or, ZMQ, the connection's handshake) comes soon, nothing is
    logged: the client met no outage, and a line then would be a spurious pair ("lost",
    "reconnected after 0.0 s") per client after every restart. If the request fails, or
    (:meth:`overdue`) waits past a grace, the outage counts from the sign."""

    def __init__(self, address: str, board: OutageBoard = BOARD) -> None:
        self.address = redacted(address)
        self._board = board
        self._failing = False
        self._suspect: float | None = None

    @property
    def suspected(self) -> bool:
        return self._suspect is not None and not self._failing

    def suspect(self) -> None:
        if self._suspect is None:
            self._suspect = time.monotonic()

    def overdue(self, grace_s: float, why: str) -> None:
        """A suspect sign (a dropped connection) older than ``grace_s`` with no answer since
        is an outage."""
        if self.suspected and time.monotonic() - self._suspect >= grace_s:
            self.failed(why)

    def failed(self, why: object) -> None:
        self._failing = True
        self._board.lost(self.address, str(why), self._suspect)

    def answered(self) -> None:
        self._suspect = None
        if self._failing:
            self._failing = False
            self._board.back(self.address)


def redacted(url: str) -> str:
    """``url`` without a password (``redis://user:secret@host`` → ``redis://user@host``)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = (f"{parts.username}@" if parts.username else "") + host + \
        (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))
