"""When the data has run out for good, read from a buffer's status: every share of the
fleet's split of data.path ran out (each worker says so in its last heartbeat) and the
buffer holds less than a step. Before, the learner waited for the next batch for ever."""

from __future__ import annotations

from typing import Any

from asyncrl.control_plane import STOPPED
from buffers.protocol import DATA_EXHAUSTED
from learners.batch_feed import data_ran_out


def _status(members: dict[str, dict[str, Any]], depth: int = 0, in_flight: int = 0) -> dict:
    return {"depth": depth, "in_flight": in_flight,
            "members": {name: {"role": "rollout", "alive": False, "info": info}
                        for name, info in members.items()}}


def _ran_out(index: int, workers: int) -> dict[str, Any]:
    return {"state": STOPPED, "exit": DATA_EXHAUSTED, "shard": [index, workers]}


def test_every_share_ran_out_and_less_than_a_step_left_ends_the_data():
    status = _status({"rollout-0-11": _ran_out(0, 2), "rollout-1-12": _ran_out(1, 2)}, depth=3)
    assert data_ran_out(status, groups_per_step=4) == (
        "the 2 rollout workers' shares of data.path all ran out, and the buffer holds 3 "
        "group(s), fewer than learner.groups_per_step = 4")


def test_a_share_still_read_keeps_the_data_going():
    running = {"engine_version": 3, "groups": 5}
    assert data_ran_out(_status({"rollout-0-11": _ran_out(0, 2), "rollout-1-12": running}), 4) \
        is None
    # a worker that crashed (reported stopped, not out of data) is restarted: it reads on
    crashed = {"state": STOPPED, "exit": "killed by SIGKILL"}
    assert data_ran_out(_status({"rollout-0-11": _ran_out(0, 2), "rollout-1-12": crashed}), 4) \
        is None
    assert data_ran_out(_status({"rollout-0-11": _ran_out(0, 2)}), 4) is None  # 1 not seen


def test_a_share_counts_once_whoever_read_it():
    """A restarted worker is a new member reading the same share: shares are counted."""
    members = {"rollout-0-11": _ran_out(0, 2), "rollout-0-13": _ran_out(0, 2),
               "learner-0": {"exit": DATA_EXHAUSTED, "shard": [1, 2]}}   # not a rollout
    status = _status(members)
    status["members"]["learner-0"]["role"] = "learner"
    assert data_ran_out(status, 4) is None
    status["members"]["rollout-1-14"] = {"role": "rollout", "info": _ran_out(1, 2)}
    assert data_ran_out(status, 4) is not None


def test_a_step_in_the_buffer_or_groups_on_their_way_are_trained_first():
    shares = {"rollout-0-11": _ran_out(0, 1)}
    assert data_ran_out(_status(shares, depth=4), 4) is None
    assert data_ran_out(_status(shares, in_flight=1), 4) is None
    assert data_ran_out(_status({}), 4) is None   # no worker yet


def test_fleets_that_split_the_data_differently_never_end_it():
    """Two fleets told different rollout.workers read overlapping rows (a config mistake the
    workers' own check catches); no end is read from their reports."""
    members = {"rollout-0-11": _ran_out(0, 1), "rollout-1-12": _ran_out(1, 2)}
    assert data_ran_out(_status(members), 4) is None
