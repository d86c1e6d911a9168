"""A learner rank that dies (SIGKILL: the OOM killer, a lost node) ends the learner with that
rank named as the cause, in one line, and the ranks it left behind say in one line each that
they followed: no gloo traceback from every survivor, and no barrier on the way out that can
only fail again.

Real processes through the CLI, as in ``test_buffer_lost``: ``asyncrl buffer``, ``asyncrl
learner`` with two ranks in one gloo group, ``asyncrl rollout``, on the simulated engines and
learner (configs/sim.toml)."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from tests.integration.conftest import Processes, role_children
from tests.integration.test_buffer_lost import training_two_ranks

pytestmark = pytest.mark.slow


def test_a_killed_rank_is_named_and_the_others_follow_in_one_line(
        tmp_path: Path, processes: Processes) -> None:
    _, learner, _, _ = training_two_ranks(tmp_path, processes, 3)
    ranks = role_children(learner.pid)
    assert len(ranks) == 2, ranks
    killed = 1   # forked second: the higher pid
    os.kill(ranks[killed], signal.SIGKILL)
    assert processes.wait(learner, 60) == 1, processes.log("learner")
    log = processes.log("learner")
    assert "Traceback" not in log, log
    cause = re.search(r"learner ERROR .*learner\[(\d)\] (.*): stopping the others", log)
    assert cause and cause.group(1) == str(killed), log
    assert cause.group(2).startswith("killed by SIGKILL"), log
    other = 1 - killed
    assert re.search(rf"learner\[{other}\] ERROR .*learner\[{other}\] stopped: learner rank "
                     rf"{other}/2: another rank left the process group \(.*by peer", log), log
