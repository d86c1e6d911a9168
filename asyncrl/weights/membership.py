"""Whom the weight broadcaster sends to, and whom it gives up on: :class:`Membership`.

Pure bookkeeping over the control plane's member list (``ControlPlane.status()["members"]``:
``{name: {"role", "alive", "last_seen_s_ago", "info"}}``) and ``time.monotonic()`` readings
the caller takes; it sends nothing, so it is unit-tested on plain dicts.

A member is *lost* to an update in one of two ways, and either ends the broadcaster's wait
for it at once (its join, its ack, or a bucket it holds up):

- *departed*: the control plane no longer reports it alive (silent past
  ``buffer.heartbeat_timeout_s``), or it said it stopped (its own last heartbeat, or its
  supervisor's report of its crash);
- *silent*: still listed alive, but not heard from for :attr:`Membership.silent_s`, half of
  ``weights.timeout_s`` (at least :data:`SILENT_MIN_S`). A rollout worker heartbeats every
  second from a thread of its own (:class:`rollouters.heartbeat.Heartbeat`), whatever its
  engine is doing, so that silence means the whole process stopped: SIGSTOPped, frozen in a
  debugger, or swapped out. Such a member holds every collective it is in until the group's
  timeout; evicting it within half of ``weights.timeout_s`` lets the others have the version
  within ``weights.timeout_s`` of the update's start.

An evicted member stays out until it heartbeats again after its eviction; :attr:`notes`
says why each one is out, for the learner's heartbeat (the monitor shows it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from asyncrl.control_plane import STOPPED

__all__ = ["Membership", "SILENT_MIN_S", "present"]

ROLLOUT_ROLE = "rollout"
SILENT_MIN_S = 2.0  # never less: two of a worker's heartbeats (1 s apart) may be late together


def present(entry: Mapping[str, Any] | None) -> bool:
    """Is this control-plane member entry a rollout engine that may still take weights: alive
    (heard from within the heartbeat timeout) and not stopped?"""
    return (entry is not None and entry.get("role") == ROLLOUT_ROLE and bool(entry.get("alive"))
            and entry.get("info", {}).get("state") != STOPPED)


class Membership:
    """The broadcaster's view of the fleet: who is in, who is lost, who is out and why."""

    def __init__(self, timeout_s: float) -> None:
        self.silent_s = max(SILENT_MIN_S, timeout_s / 2)
        self._evicted_at: dict[str, float] = {}  # member → time.monotonic() of its eviction
        self._evicted_now: list[str] = []  # evicted during the running sync: not retried in it
        # member → why it is out, while it is; replaced whole on every change, so that another
        # thread (the learner's heartbeat) may read it without a lock
        self.notes: dict[str, str] = {}

    def roster(self, listed: Mapping[str, Any], now: float) -> list[str]:
        """The present members of ``listed`` (a status taken after ``now``), sorted, minus those
        not heard from since their eviction and those evicted during the running sync (they
        get the next sync, not a retry). A member heard from again is taken back."""
        out = []
        for name, entry in listed.items():
            if not present(entry) or name in self._evicted_now:
                continue
            evicted_at = self._evicted_at.get(name)
            if evicted_at is not None and entry["last_seen_s_ago"] >= now - evicted_at:
                continue
            if evicted_at is not None:
                del self._evicted_at[name]
                self.notes = {k: v for k, v in self.notes.items() if k != name}
            out.append(name)
        return sorted(out)

    def lost(self, listed: Mapping[str, Any], members: list[str],
             version: int) -> dict[str, str]:
        """Those of ``members`` that departed or went silent, each with the reason."""
        out = {}
        for name in members:
            entry = listed.get(name)
            if not present(entry):
                out[name] = f"gone during version {version}: dead or stopped on the control plane"
            elif entry["last_seen_s_ago"] >= self.silent_s:
                out[name] = (f"no heartbeat for {entry['last_seen_s_ago']:.1f} s during version "
                             f"{version} (frozen?)")
        return out

    def evict(self, name: str, why: str, now: float) -> None:
        self._evicted_at[name] = now
        self._evicted_now.append(name)
        self.notes = {**self.notes, name: why}

    def sync_ended(self) -> int:
        """The running sync is over: how many it evicted (its ``weights/evicted``)."""
        count, self._evicted_now = len(self._evicted_now), []
        return count
