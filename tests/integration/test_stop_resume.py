"""Ctrl-C of `asyncrl up`, then `asyncrl up` again, as the README tells a quickstart user: the
stop leaves no process behind and saves, the second run resumes from the checkpoint the stop
left, its broker replays the default spill file, and it trains on to ``total_steps``.

A stop leaves the run running in its buffer (only the end of training marks it done): before,
the stopped learner marked it done, the replayed broker said so to the new workers, they
exited, and the resumed learner waited for data forever."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from learners.checkpoint import latest, read_meta
from tests.integration.conftest import (
    QUICKSTART,
    Processes,
    children_by_parent,
    interrupted_run,
    step_records,
    wait_for,
)

pytestmark = pytest.mark.slow

TOTAL_STEPS = 40
STOP_AFTER = 12  # steps: past the checkpoints at 5 and 10


def test_ctrl_c_then_up_again_resumes_and_finishes(tmp_path: Path,
                                                    processes: Processes) -> None:
    sets, run_dir = interrupted_run(tmp_path, "again", TOTAL_STEPS)
    first = processes.start("up1", "up", str(QUICKSTART), *sets)
    wait_for(lambda: len(step_records(run_dir / "metrics.jsonl")) >= STOP_AFTER, 180,
             f"{STOP_AFTER} learner steps")
    tree = _descendants(first.pid)
    assert len(tree) >= 4, tree  # buffer, learner, rollout and its two workers
    start = time.monotonic()
    first.send_signal(signal.SIGINT)  # Ctrl-C (`up`'s roles have sessions of their own)
    assert processes.wait(first, 30) == 130, processes.log("up1")  # interrupted, as asked
    wait_for(lambda: not any(_alive(pid) for pid in tree), 5, "children to exit")
    assert time.monotonic() - start < 20
    assert "did not stop in time" not in processes.log("up1")  # stopped cleanly, not killed
    assert (run_dir / "final" / "config.json").exists()  # the learner saved
    stopped = read_meta(latest(run_dir / "checkpoints"))
    assert not stopped.counters["finished"] and stopped.version < TOTAL_STEPS
    buffer_log = (run_dir / "logs" / "buffer.log").read_text()
    assert "-> done" not in buffer_log, buffer_log  # a stop is not the end of the run

    second = processes.start("up2", "up", str(QUICKSTART), *sets)
    assert processes.wait(second, 300) == 0, processes.log("up2")
    buffer_log = (run_dir / "logs" / "buffer.log").read_text()
    assert "replayed" in buffer_log, buffer_log  # the default spill file, kept for the resume
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    assert f"resuming at version {stopped.version}" in learner_log, learner_log
    steps = [r["step"] for r in step_records(run_dir / "metrics.jsonl")]
    assert steps[-1] == TOTAL_STEPS, steps[-5:]
    final = read_meta(latest(run_dir / "checkpoints"))
    assert final.version == TOTAL_STEPS and final.counters["finished"]


def _descendants(root: int) -> set[int]:
    children = children_by_parent()
    found, stack = set(), [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.add(child)
            stack.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
