"""The gate across a learner resume and across drops, on both backends (real broker, real Redis).

A learner resumed from a checkpoint of version V after ``V × gps`` consumed groups seeds a buffer
that did not live through those steps (``restore_progress``): the version continues from V and
the gate admits one fresh start's worth, ``(s + 1) × gps``, not ``(V + s + 1) × gps`` (a flood)
and not nothing (a deadlock). A buffer that did live through them is left as it is. Groups
dropped as stale give their gate slots back, or the learner starves.
"""

from __future__ import annotations

import pytest

from tests.buffers import make_group

pytestmark = pytest.mark.timeout(60)


def test_a_fresh_buffer_is_seeded_from_the_checkpoint(backend):
    c = backend.start(groups_per_step=2, max_staleness=1).client()
    assert c.restore_progress(5, 10) == 5
    status = c.status()
    assert (status["version"], status["accepted"], status["consumed"]) == (5, 10, 10)
    assert c.acquire("w", 100, 0).granted == 0          # weights older than 5 - s: not yet
    assert c.acquire("w", 100, 5).granted == 4          # (5 + 1 + 1) × 2 − 10: a fresh start's
    assert c.restore_progress(5, 10) == 5                # idempotent (every rank calls it)
    assert c.status()["accepted"] == 10
    for i in range(4):
        assert c.put("w", make_group(f"g{i}", version=5)).accepted
    batch = c.get_batch("learner", 2, 5, timeout_s=5.0)
    assert [g.group_id for g in batch.groups] == ["g0", "g1"]
    c.ack("learner", batch)
    c.publish_version(6)                                 # versions keep increasing from V
    assert c.acquire("w", 100, 6).granted == 2
    with pytest.raises(RuntimeError, match="behind"):
        c.publish_version(4)


def test_a_buffer_that_lost_its_state_is_seeded_by_the_version_it_is_told(backend):
    """A broker restarted without its spill file (a Redis without persistence) knows nothing
    of the steps the learner went on training. Without a seed its gate admitted ``V × gps``
    groups too many for the rest of the run (stale ones give their slots back): the first
    version it is told, past the first step with nothing consumed here, stands for them."""
    c = backend.start(groups_per_step=2, max_staleness=1).client()
    c.publish_version(5)
    status = c.status()
    assert (status["version"], status["accepted"], status["consumed"]) == (5, 10, 10)
    assert c.acquire("w", 100, 5).granted == 4          # (5 + 1 + 1) × 2 − 10, not 14
    c.publish_version(6)                                 # once: it has a version now
    assert c.status()["consumed"] == 10


def test_a_fresh_run_is_not_seeded_by_its_first_version(backend):
    """In a run that was not interrupted, version 1 comes before anything is acked, and the
    first step's groups are acked before version 2 exists."""
    c = backend.start(groups_per_step=1, max_staleness=0).client()
    assert c.acquire("w", 1, 0).granted == 1
    assert c.put("w", make_group("g0", version=0)).accepted
    batch = c.get_batch("learner", 1, 0, timeout_s=5.0)
    c.publish_version(1)                                 # before the ack: nothing consumed
    c.ack("learner", batch)
    c.publish_version(2)
    status = c.status()
    assert (status["version"], status["accepted"], status["consumed"]) == (2, 1, 1)


def test_the_seed_survives_a_restart_of_the_server(backend):
    """Journaled (the broker's spill file; Redis' AOF) like every other gate change."""
    d = backend.start(groups_per_step=2, max_staleness=1)
    assert d.client().restore_progress(5, 10) == 5
    d.restart(kill=True)
    status = d.client().status()
    assert (status["version"], status["accepted"], status["consumed"]) == (5, 10, 10)


def test_a_buffer_that_lived_through_the_steps_is_unchanged(backend):
    c = backend.start(groups_per_step=1, max_staleness=0).client()
    for version in range(3):
        assert c.acquire("w", 1, version).granted == 1
        assert c.put("w", make_group(f"g{version}", version=version)).accepted
        c.ack("learner", c.get_batch("learner", 1, version, timeout_s=5.0))
        c.publish_version(version + 1)
    before = c.status()
    # A checkpoint of version 2 (the learner died after publishing 3): nothing to take over.
    assert c.restore_progress(2, 2) == 3
    after = c.status()
    assert {k: after[k] for k in ("version", "accepted", "consumed")} == \
        {k: before[k] for k in ("version", "accepted", "consumed")} == \
        {"version": 3, "accepted": 3, "consumed": 3}


def test_groups_admitted_before_the_seed_count_and_stale_ones_give_slots_back(backend):
    """Rollouts that reached the fresh buffer first made groups with their initial weights
    (version 0): the seed keeps counting them, and when they are dropped as stale at V their
    slots come back, so the gate reopens for the resumed weights."""
    c = backend.start(groups_per_step=2, max_staleness=1).client()
    assert c.acquire("w", 100, 0).granted == 4           # before the learner resumed
    for i in range(4):
        assert c.put("w", make_group(f"old{i}", version=0)).accepted
    assert c.restore_progress(5, 10) == 5
    assert c.acquire("w", 100, 5).granted == 0           # the 4 early groups hold the slots
    assert c.get_batch("learner", 2, 5, timeout_s=0.3) is None
    assert c.status()["dropped_stale"] == 4
    assert c.acquire("w", 100, 5).granted == 4           # their slots came back


def test_a_dropped_group_gives_its_slot_back_or_the_learner_would_starve(backend):
    c = backend.start(groups_per_step=1, max_staleness=0).client()
    assert c.acquire("w", 1, 0).granted == 1
    assert c.put("w", make_group("g0", version=0)).accepted
    c.ack("learner", c.get_batch("learner", 1, 0, timeout_s=5.0))
    c.publish_version(1)
    assert c.acquire("w", 1, 1).granted == 1
    # The group came back with an older token (weights changed mid-generation, a slow worker):
    # stale at version 1, dropped when the learner asks for its batch.
    assert c.put("w", make_group("late", versions=[0, 1])).accepted
    assert c.get_batch("learner", 1, 1, timeout_s=0.3) is None
    status = c.status()
    assert status["dropped_stale"] == 1
    assert (status["gate_open"], status["gate_allowance"]) == (True, 1)  # as the gate counts
    assert c.acquire("w", 1, 1).granted == 1             # else: gate shut, learner waits forever
    assert c.put("w", make_group("fresh", version=1)).accepted
    assert [g.group_id for g in c.get_batch("learner", 1, 1, timeout_s=5.0).groups] == ["fresh"]
