"""The staleness rule, as pure arithmetic (no I/O), so it can be tested exhaustively.

Meaning of the bound ``s = max_staleness``: the learner at version V never trains on a sample
whose oldest token came from a version older than ``V − s``.

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

    def is_open(self, version: int, accepted: int, in_flight: int) -> bool:
        return accepted + in_flight < self.capacity(version)

    def is_fresh(self, learner_version: int, oldest_token_version: int) -> bool:
        """May a sample whose oldest token is ``oldest_token_version`` be trained at V?"""
        return learner_version - oldest_token_version <= self.max_staleness

    def engine_may_start(self, version: int, engine_version: int) -> bool:
        """An engine whose weights are already staler than s would only make drops."""
        return version - engine_version <= self.max_staleness
