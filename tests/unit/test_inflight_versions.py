"""The grant versions pace waits on: kept on the old side, never longer than the gate's count."""

from __future__ import annotations

from collections import Counter

from buffers.inflight_versions import InFlightVersions


def test_a_put_settles_the_newest_grant_not_newer_than_the_group() -> None:
    record = InFlightVersions()
    record.grant("a", 0, 1)
    record.grant("a", 2, 2)
    record.settle("a", 1)              # a group of version 1 was granted at 0, not 2
    assert record.totals() == Counter({2: 2})
    record.settle("a", 5)
    assert record.totals() == Counter({2: 1})


def test_a_group_older_than_every_grant_settles_the_oldest() -> None:
    record = InFlightVersions()
    record.grant("a", 3, 1)
    record.grant("a", 4, 1)
    record.settle("a", -1)             # no generated token: no version to match
    assert record.totals() == Counter({4: 1})


def test_releases_forget_the_newest_and_dead_producers_everything() -> None:
    record = InFlightVersions()
    record.grant("a", 0, 1)
    record.grant("a", 1, 2)
    record.grant("b", 0, 3)
    record.release("a", 2)             # kept: the old grant still holds the learner
    assert record.totals() == Counter({0: 4})
    record.keep_at_most("b", 1)
    record.forget("a")
    assert record.totals() == Counter({0: 1}) and record.producers() == ["b"]
    record.release("b", 5)
    assert record.totals() == Counter() and record.producers() == []
