"""The control plane: what every role asks of the buffer besides data (the published version,
heartbeats, rendezvous keys, status), whatever backend carries it.

It lives in the core, not in ``buffers``, because the weight sync (:mod:`asyncrl.weights`),
used by the learners and the rollouters alike, speaks to it; ``buffers`` implements it (every
buffer client is also a :class:`ControlPlane`, see :class:`buffers.protocol.BufferClient`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

STOPPED = "stopped"  # the ``state`` in a member's last heartbeat: it will not come back


class BufferStopped(TimeoutError):
    """A client given a stop event stopped waiting for the broker because the event was set
    (the role is stopping on a signal).

    A :class:`TimeoutError`, as a request given up on after ``request_timeout_s`` is: the
    request is in doubt in the same way (it may still be served), and what already tolerates a
    lost buffer on its way out (the weight broadcaster's close catches ``TimeoutError``, the
    lease renewal and the crash report catch ``Exception``) tolerates this too. It is not the
    ZMQ client's ``NoReply``, so it is never re-sent. The roles take it, or a failure caused by
    it (:func:`buffers.stopped_by`), as the stop it is: exit status 0, not the 3 of a broker that
    cannot be reached."""


@runtime_checkable
class ControlPlane(Protocol):
    def publish_version(self, version: int) -> None:
        """Publish the learner version (after its weights reached the engines). A buffer with
        no progress at all (version 0, nothing consumed) told of a version ``v`` > 1 lost its
        state while the learner trained: it takes the steps over as
        ``restore_progress(v, v × groups_per_step)`` would, so its gate stays right."""

    def restore_progress(self, version: int, consumed: int) -> int:
        """A learner resumed from a checkpoint of ``version``, taken after ``consumed`` groups
        were consumed. A buffer that has consumed fewer did not live through those steps (a
        broker restarted without spill, a reset Redis namespace): it takes them over, so its
        version becomes at least ``version`` and ``accepted`` and ``consumed`` grow by the
        difference; the gate then admits what it would have had it lived through them (no
        flood of ``version × groups_per_step`` groups, no version going back). A buffer that
        did is unchanged. Idempotent. Returns the buffer's version."""

    def heartbeat(self, member: str, role: str, info: dict[str, Any]) -> dict[str, Any]:
        """Say ``member`` is alive; ``info`` carries its metrics. Returns the run state
        (``version``, ``run_status``)."""

    def set_key(self, key: str, value: dict[str, Any]) -> int:
        """Store a small JSON value (rendezvous, announcements); returns its sequence number:
        above every number the key had before, also from a buffer that lost it (restarted
        without its spill file, or a Redis without persistence), so that a waiter's
        ``newer_than`` never outlives the buffer it came from."""

    def get_key(self, key: str, newer_than: int = 0,
                timeout_s: float = 0.0) -> tuple[int, dict[str, Any]] | None:
        """The value with a sequence number above ``newer_than``, waiting up to ``timeout_s``."""

    def get_keys(self, keys: Sequence[str]) -> dict[str, tuple[int, dict[str, Any]]]:
        """The current ``(seq, value)`` of each of ``keys`` that is set, in ONE round trip,
        without waiting: a rendezvous over many members (joins, acks) reads them all at once
        instead of one request per member."""

    def status(self) -> dict[str, Any]:
        """Everything the monitor shows, as one JSON-able dict."""
