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

Two modes (``buffer.staleness_mode``). ``drop``: the above; a group that finished too late is
dropped and counted. ``pace``: no finished group is dropped; instead the learner does not step
past the version at which a group still alive would go stale (:func:`pace_allows`): a take
that would leave such a group behind waits, and the wait is counted (``pace_held_s``). The
buffers know the version each in-flight group was granted at (the engine's, at
:meth:`~buffers.protocol.Buffer.acquire`: its tokens can only be newer), so a group still
generating holds the learner back too. A group the accounting could not see (its producer
was reaped as dead, then delivered) may still arrive stale; it is dropped and counted, never
trained on: the bound s is the rule both modes keep. A take waits only while groups in flight
are part of what would go stale (:func:`pace_holds`): they may still arrive and be trained.
Groups the gate did not admit (such late groups, or puts without a grant) can leave the queue
itself with more old groups than the learner can train in time; waiting saves none of them,
so the learner takes the oldest and the rest are dropped and counted, as in ``drop`` mode.

``accepted`` is the groups that entered the buffer minus those it dropped as stale: a dropped
group gives its slot back. It must, or the learner could starve: drops never consumed by a step
would keep ``(V + s + 1) × gps`` full while fewer than ``gps`` groups are left to train on, and
V only grows when the learner trains (``tests/buffers/test_contract.py``). Giving it back keeps
the bound: the later groups only move to earlier slots, which makes them fresher.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
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


STALENESS_MODES = ("drop", "pace")


def pace_allows(version: int, max_staleness: int, per_step: int,
                left: Mapping[int, int]) -> bool:
    """``pace`` mode: may the learner at ``version`` train a batch (and so reach
    ``version + 1``), leaving alive the groups ``left`` counts (oldest version → groups: those
    queued and not in the batch, and those in flight, by the version they were granted at)?

    Yes iff, for every ``k`` in ``0 … s``, at most ``k × per_step`` of them have an oldest
    version ``≤ version + k − s``. Such a group must be consumed by the step at ``version + k``
    or it would be staler than s; ``k`` steps consume ``k × per_step`` groups. ``k = 0`` is
    the issue's rule: nothing left may go stale at the next version. The larger ``k`` keep the
    future feasible: without them a learner at s = 2 could take a fresher group now and later
    face more old groups than one batch holds, none of which it may skip.

    Taking the ``per_step`` oldest groups once they have finished (earliest deadline first,
    the order the buffers serve) keeps the condition true from one version to the next, given
    the gate's bound on what is alive (``(s + 1) × per_step`` after a step's groups were
    consumed: see the gate's proof above). Where groups the gate did not admit break that
    bound, the condition can fail on the queue alone, whatever arrives: :func:`pace_holds`
    then does not wait. Groups without a version (:data:`NO_VERSION`) never go stale and do
    not count.
    """
    versions = sorted((v, n) for v, n in left.items() if v >= 0 and n > 0)
    cumulative, i = 0, 0
    for k in range(max_staleness + 1):
        limit = version + k - max_staleness
        while i < len(versions) and versions[i][0] <= limit:
            cumulative += versions[i][1]
            i += 1
        if cumulative > k * per_step:
            return False
    return True


def pace_holds(version: int, max_staleness: int, per_step: int,
               queued: Mapping[int, int], in_flight: Mapping[int, int]) -> bool:
    """``pace`` mode: must a take that would leave ``queued`` (groups queued and not in the
    batch, by oldest version) and ``in_flight`` (by the version they were granted at) wait?

    Yes iff :func:`pace_allows` refuses the two together but allows ``queued`` alone: groups
    in flight are part of what would go stale, and waiting can save them, as they may still
    arrive (their tokens no older than the grant) and be trained, or be released. A wait so
    ends: every group in flight finishes, fails (released) or loses its producer (reaped).

    When ``queued`` alone is refused, the queue holds more old groups than the learner can
    train, ``per_step`` a step, before they go stale; no arrival takes any of them off, so
    the take is served and the groups it leaves go stale, dropped and counted as in ``drop``
    mode. With the batch of the oldest queued groups, which the buffers serve then, waiting
    would not even save a group in flight: each one that arrived would take a slot in a
    batch from a queued group (``tests/unit/test_staleness.py`` checks it). Waiting on the
    queue alone was a hang: held takes never change the queue.
    """
    if pace_allows(version, max_staleness, per_step, Counter(queued) + Counter(in_flight)):
        return False
    return pace_allows(version, max_staleness, per_step, queued)


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
