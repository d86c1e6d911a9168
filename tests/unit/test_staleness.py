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
