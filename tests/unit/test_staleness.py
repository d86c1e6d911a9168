"""The gate arithmetic: accepted + in_flight < (V + s + 1) × groups_per_step."""

from __future__ import annotations

import itertools

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
