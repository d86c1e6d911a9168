"""The gate arithmetic: accepted + in_flight < (V + s + 1) × groups_per_step."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from asyncrl.staleness import NO_VERSION, StalenessGate, below_cutoff, is_fresh, staleness


def test_capacity_and_allowance_by_hand() -> None:
    gate = StalenessGate(max_staleness=2, groups_per_step=4)
    assert gate.capacity(0) == 12            # (0 + 2 + 1) × 4
    assert gate.allowance(0, accepted=5, in_flight=3) == 4
    assert gate.allowance(0, 8, 4) == 0      # full: closed
    assert gate.allowance(0, 10, 4) == 0     # never negative
    assert gate.allowance(1, 10, 4) == 2     # a new version opens one step's worth


def test_synchronous_when_zero() -> None:
    gate = StalenessGate(max_staleness=0, groups_per_step=3)
    assert gate.allowance(0, 0, 0) == 3
    assert gate.allowance(0, 3, 0) == 0
    assert gate.allowance(1, 3, 0) == 3
    assert gate.is_fresh(4, 4) and not gate.is_fresh(4, 3)


def test_no_generated_token_is_never_stale() -> None:
    """A group with no generated token (oldest version -1) is as fresh as can be, as the
    buffers have always treated it; the gate used to call it stale once V > s - 1."""
    gate = StalenessGate(max_staleness=1, groups_per_step=2)
    assert NO_VERSION == -1
    assert gate.is_fresh(5, NO_VERSION) and gate.is_fresh(0, NO_VERSION)
    assert staleness(5, NO_VERSION) == 0 and staleness(5, 2) == 3
    assert not below_cutoff(NO_VERSION, gate.stale_below(100))
    assert is_fresh(9, NO_VERSION, 0)


def test_cutoff_is_the_per_group_rule() -> None:
    """The buffers drop a queue by the cutoff and test single groups by ``is_fresh``: a group
    is below the cutoff exactly when it is not fresh."""
    for s, version, oldest in itertools.product(range(5), range(10), range(-2, 12)):
        gate = StalenessGate(s, 1)
        assert gate.stale_below(version) == version - s
        assert below_cutoff(oldest, gate.stale_below(version)) == \
            (not gate.is_fresh(version, oldest)), (s, version, oldest)
        assert gate.is_fresh(version, oldest) == (staleness(version, oldest) <= s)


def test_engine_may_start() -> None:
    gate = StalenessGate(max_staleness=1, groups_per_step=1)
    assert gate.engine_may_start(5, 4) and not gate.engine_may_start(5, 3)


@pytest.mark.parametrize(("s", "gps"), list(itertools.product([0, 1, 2, 4], [1, 3, 8])))
def test_fifo_never_exceeds_bound(s: int, gps: int) -> None:
    """Simulate greedy producers and a FIFO learner: no consumed group is staler than s."""
    gate = StalenessGate(s, gps)
    version, accepted, queue, worst = 0, 0, [], 0
    for _ in range(30):
        started = gate.allowance(version, accepted, 0)
        queue += [version] * started          # each group records the version it started at
        accepted += started
        assert len(queue) >= gps
        batch, queue = queue[:gps], queue[gps:]
        worst = max(worst, max(version - v for v in batch))
        version += 1
    assert worst == s


@pytest.mark.parametrize(("s", "gps"), [(-1, 1), (0, 0)])
def test_rejects_bad_parameters(s: int, gps: int) -> None:
    with pytest.raises(ValueError):
        StalenessGate(s, gps)


def test_pace_waits_for_what_would_go_stale_by_hand() -> None:
    from asyncrl.staleness import pace_allows

    # s = 1, one group per step, learner at version 3 (about to make 4): a group of version
    # 2 left behind would be stale at 4; one of version 3 may wait one step, one only.
    assert not pace_allows(3, 1, 1, {2: 1})
    assert pace_allows(3, 1, 1, {3: 1})
    assert not pace_allows(3, 1, 1, {3: 2})           # two of them, one step to serve them
    assert pace_allows(3, 1, 1, {4: 5, 7: 9, NO_VERSION: 40})  # fresh enough, or versionless
    # s = 2: taking a fresher group now may leave more old ones than later batches hold.
    assert pace_allows(2, 2, 1, {1: 1, 2: 1})
    assert not pace_allows(2, 2, 1, {1: 2})           # k = 1: one step for two groups
    assert not pace_allows(2, 2, 1, {2: 3})           # k = 2: two steps for three
    assert pace_allows(2, 2, 2, {1: 2, 2: 2})


@pytest.mark.parametrize(("s", "gps", "lengths_seed"), [(1, 2, 0), (2, 1, 1), (3, 3, 2),
                                                         (0, 2, 3)])
def test_pace_never_waits_forever_and_never_goes_stale(s: int, gps: int,
                                                       lengths_seed: int) -> None:
    """A simulated run: the gate admits, groups finish after random (long-tailed) times, the
    learner takes the oldest finished groups (earliest deadline first) only when
    :func:`pace_allows` says so. Every group is trained within s, none dropped, and the
    learner keeps stepping (no deadlock)."""
    import random

    from asyncrl.staleness import pace_allows

    rng = random.Random(lengths_seed)
    gate = StalenessGate(s, gps)
    version = accepted = 0
    running: list[tuple[int, int]] = []   # (finish time, granted version)
    done: list[int] = []                  # finished groups' versions
    for tick in range(2000):
        for _ in range(gate.allowance(version, accepted, len(running))):
            running.append((tick + int(rng.paretovariate(1.2)), version))
        for item in [r for r in running if r[0] <= tick]:
            running.remove(item)
            done.append(item[1])
            accepted += 1
        if len(done) < gps:
            continue
        batch = sorted(done)[:gps]
        left = Counter(sorted(done)[gps:]) + Counter(v for _, v in running)
        if pace_allows(version, s, gps, left):
            assert all(version - v <= s for v in batch)
            for v in batch:
                done.remove(v)
            version += 1
    assert version > 100


def test_pace_holds_only_for_groups_in_flight_by_hand() -> None:
    """A take waits only when groups in flight are part of what would go stale; old groups
    already queued cannot be saved by waiting, and waiting on them was a hang."""
    from asyncrl.staleness import pace_holds

    # s = 1, one group per step, learner at version 3 (about to make 4).
    assert pace_holds(3, 1, 1, queued={}, in_flight={2: 1})        # stale at 4 unless in
    assert pace_holds(3, 1, 1, queued={3: 1}, in_flight={3: 1})    # k = 1: one step for two
    assert not pace_holds(3, 1, 1, queued={2: 1}, in_flight={})    # only queued: no wait
    assert not pace_holds(3, 1, 1, queued={3: 2}, in_flight={})    # a backlog: no wait
    assert not pace_holds(3, 1, 1, queued={2: 1}, in_flight={2: 1})  # the queue fails alone
    assert not pace_holds(3, 1, 1, queued={3: 1}, in_flight={4: 3, NO_VERSION: 9})  # fine
    # s = 2, two per step: the version-0 group in flight is due now (k = 0), the queue is not.
    assert pace_holds(2, 2, 2, queued={1: 2}, in_flight={0: 1})
    assert not pace_holds(2, 2, 2, queued={1: 3}, in_flight={0: 1})


def _lost(version: int, s: int, gps: int, alive: Counter[int], steps: int) -> int:
    """How many of ``alive`` must go stale whatever the learner serves, with ``steps`` batches
    of ``gps`` to train them after version + k − 1 (k = 0 … s): those due by version + k
    (oldest ≤ version + k − s) beyond what k + ``steps`` batches hold."""
    due = [sum(n for v, n in alive.items() if 0 <= v <= version + k - s) for k in range(s + 1)]
    return max([0, *(d - (k + steps) * gps for k, d in enumerate(due))])


def test_pace_does_not_wait_when_waiting_saves_nothing() -> None:
    """Random queues and groups in flight: where :func:`pace_holds` serves the oldest batch
    although some group will go stale, waiting for every group in flight and then serving
    would lose as many (each arrival takes a queued group's slot in a batch)."""
    import random

    from asyncrl.staleness import pace_allows, pace_holds

    rng = random.Random(0)
    checked = 0
    for _ in range(3000):
        s, gps, version = rng.randrange(0, 4), rng.randrange(1, 4), rng.randrange(0, 6)
        queue = sorted(rng.randrange(max(0, version - s), version + 2)
                       for _ in range(rng.randrange(gps, gps + 8)))
        in_flight = Counter(rng.randrange(max(0, version - s), version + 2)
                            for _ in range(rng.randrange(0, 5)))
        left = Counter(queue[gps:])
        if pace_allows(version, s, gps, left + in_flight) or \
                pace_holds(version, s, gps, left, in_flight):
            continue
        checked += 1
        now = _lost(version, s, gps, left + in_flight, steps=0)
        assert now > 0 and now == _lost(version, s, gps, Counter(queue) + in_flight, steps=1)
    assert checked > 300


@pytest.mark.parametrize(("s", "gps", "seed"), [(1, 2, 0), (2, 1, 1), (0, 2, 3)])
def test_pace_keeps_stepping_past_groups_the_gate_did_not_admit(s: int, gps: int,
                                                                seed: int) -> None:
    """The simulated run of the test above, with a backlog of old groups put past the gate
    every 50 ticks (puts without a grant, a reaped producer's late groups): the learner keeps
    stepping, trains nothing staler than s, and drops (counts) only what waiting could not
    save. Waiting on the queue (``pace_allows`` alone) stopped it at the first backlog."""
    import random

    from asyncrl.staleness import pace_allows, pace_holds

    rng = random.Random(seed)
    gate = StalenessGate(s, gps)
    version = accepted = dropped = 0
    running: list[tuple[int, int]] = []   # (finish time, granted version)
    done: list[int] = []                  # finished groups' versions
    for tick in range(2000):
        for _ in range(gate.allowance(version, accepted - dropped, len(running))):
            running.append((tick + int(rng.paretovariate(1.2)), version))
        for item in [r for r in running if r[0] <= tick]:
            running.remove(item)
            done.append(item[1])
            accepted += 1
        if tick % 50 == 25:
            done += [max(0, version - s)] * (3 * gps)   # no grant: the gate never saw them
            accepted += 3 * gps
        fresh = [v for v in done if gate.is_fresh(version, v)]
        dropped, done = dropped + len(done) - len(fresh), fresh   # the take's drop sweep
        if len(done) < gps:
            continue
        batch, left = sorted(done)[:gps], Counter(sorted(done)[gps:])
        in_flight = Counter(v for _, v in running)
        if pace_allows(version, s, gps, left + in_flight) or \
                not pace_holds(version, s, gps, left, in_flight):
            assert all(version - v <= s for v in batch)
            for v in batch:
                done.remove(v)
            version += 1
    assert version > 100 and dropped > 0
