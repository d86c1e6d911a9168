"""The staleness rule, as pure arithmetic (no I/O), so it can be tested exhaustively.

This module is the rule's one statement. The ZMQ broker, the Redis consumer, the wire group
and the workflow runner call it; the Redis Lua scripts cannot, so their copy (the staleness
functions of ``buffers.redis_scripts.PRELUDE``) is checked against it over a grid of versions
by ``tests/buffers/test_staleness_parity.py``.

Meaning of the bound ``s = max_staleness``: the learner at version V never trains on a sample
whose oldest token came from a version older than ``V − s``. A sample's staleness at V is
``V − oldest``; it is fresh while that is at most s, and the buffers drop the stale ones, which
are exactly those whose oldest version is below the cutoff ``V − s``.

A sample with no generated token (a prompt the engine answered with nothing, or tokens that
carry no version) has oldest version :data:`NO_VERSION` (any negative value means the same).
Nothing in it came from a policy, so no update can make it off-policy: its staleness is 0 at
every V and it is never dropped. The same test stops a multi-turn episode early: before each
engine call, an episode whose oldest token is already stale at the engine's version (the
learner's, or about to be) would only be dropped, so it is not extended.

The gate keeps rollouters from producing work that would then be dropped. A new group may start
only while ``accepted + in_flight < (V + s + 1) × groups_per_step``. Why that suffices, with FIFO
consumption: the learner consumes ``groups_per_step`` groups per step, so the group admitted in
slot ``k`` (0-based, counting accepted + in-flight) is consumed at step ``⌊k / groups_per_step⌋``,
i.e. at learner version ``V_c = ⌊k / gps⌋``. It was started when ``k < (V_s + s + 1) × gps``,
so ``V_c ≤ V_s + s``: its staleness ``V_c − V_s`` is at most s. Drops therefore happen only when
order is broken (several producers finishing out of order, a worker with old weights), and they
are counted, never silent. ``s = 0`` admits exactly one step's worth of groups per version:
on-policy.

``accepted`` is the groups that entered the buffer minus those it dropped as stale: a dropped
group gives its slot back. It must, or the learner could starve: drops never consumed by a step
would keep ``(V + s + 1) × gps`` full while fewer than ``gps`` groups are left to train on, and
V only grows when the learner trains (``tests/buffers/test_contract.py``). Giving it back keeps
the bound: the later groups only move to earlier slots, which makes them fresher.
"""

from __future__ import annotations

from dataclasses import dataclass

NO_VERSION = -1
"""The oldest version of a sample with no generated token: never stale (module docstring)."""


def staleness(version: int, oldest: int) -> int:
    """How many versions a sample whose oldest token is ``oldest`` is behind ``version``
    (0 for :data:`NO_VERSION`; negative for a token newer than ``version``)."""
    return version - oldest if oldest >= 0 else 0


def is_fresh(version: int, oldest: int, max_staleness: int) -> bool:
    """May a sample whose oldest token is ``oldest`` be trained at ``version``? Also whether
    an episode may go on once the engine serves ``version`` (``rollouters.workflows``)."""
    return staleness(version, oldest) <= max_staleness


def stale_below(version: int, max_staleness: int) -> int:
    """The drop cutoff at ``version``: a sample is stale iff its oldest version is below it
    (:func:`below_cutoff`). The buffers drop the stale groups of a queue in one sweep."""
    return version - max_staleness


def below_cutoff(oldest: int, cutoff: int) -> bool:
    """Is a sample stale at the cutoff :func:`stale_below` gave? Never without a version."""
    return 0 <= oldest < cutoff


@dataclass(frozen=True)
class StalenessGate:
    max_staleness: int
    groups_per_step: int

    def __post_init__(self) -> None:
        if self.max_staleness < 0 or self.groups_per_step < 1:
            raise ValueError("max_staleness must be >= 0 and groups_per_step >= 1")

    def capacity(self, version: int) -> int:
        """Total groups (accepted ever + in flight) allowed while the published version is V."""
        return (version + self.max_staleness + 1) * self.groups_per_step

    def allowance(self, version: int, accepted: int, in_flight: int) -> int:
        """How many new groups may start now (≥ 0)."""
        return max(0, self.capacity(version) - accepted - in_flight)

    def is_fresh(self, learner_version: int, oldest_token_version: int) -> bool:
        """May a sample whose oldest token is ``oldest_token_version`` be trained at V?"""
        return is_fresh(learner_version, oldest_token_version, self.max_staleness)

    def stale_below(self, learner_version: int) -> int:
        """Groups whose oldest version is in ``[0, stale_below(V))`` are dropped at V."""
        return stale_below(learner_version, self.max_staleness)

    def engine_may_start(self, version: int, engine_version: int) -> bool:
        """An engine whose weights are already staler than s would only make drops."""
        return version - engine_version <= self.max_staleness
