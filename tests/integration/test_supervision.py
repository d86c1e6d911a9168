"""`asyncrl up` keeps a run alive through faults: a SIGKILLed rollout worker is restarted, a
SIGKILLed ZMQ broker is restarted at the same address and replays its spill file (by default
in the run directory), the clients ride out the restart, and the run keeps learning. A learner
crash stops the run with the cause in one line and leaves it resumable. One run shows all
three, in that order (a quickstart start costs ~35 s of CPU)."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.launch.run_dir import is_resuming
from tests.integration.conftest import (QUICKSTART, Processes, role_children, step_records,
                                        wait_for)

pytestmark = pytest.mark.slow



def _started_pid(up_log: str, role: str) -> int:
    return int(re.findall(rf"started {role} \(pid (\d+)\)", up_log)[-1])


def _mean_reward(records: list[dict]) -> float:
    return sum(r["critic/score/mean"] for r in records) / len(records)


def test_rollout_and_broker_sigkill_are_survived_a_learner_crash_stops_the_run(
        tmp_path: Path, processes: Processes) -> None:
    """One run meets the three faults in turn: a rollout worker and the broker are restarted
    and the run learns on; then the learner's crash stops it."""
    run_dir = tmp_path / "faults"
    sets = ["--set", f"run.output_dir={tmp_path}", "--set", "run.name=faults",
            "--set", "learner.total_steps=100000",
            "--set", "eval.every_steps=0",  # buffer.zmq.spill_path: the default, in run dir
            "--set", "buffer.request_timeout_s=4", "--set", "buffer.heartbeat_timeout_s=3",
            "--set", "launcher.restart_backoff_s=0.5"]  # weights.timeout_s: the default, 60 s
    up = processes.start("up", "up", str(QUICKSTART), *sets)
    metrics, logs = run_dir / "metrics.jsonl", run_dir / "logs"
    wait_for(lambda: len(step_records(metrics)) >= 5, 240, "five steps")

    rollout_pid = _started_pid(processes.log("up"), "rollout")
    victim = role_children(rollout_pid)[0]
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: "rollout[0] killed by SIGKILL" in (logs / "rollout.log").read_text()
             or "rollout[1] killed by SIGKILL" in (logs / "rollout.log").read_text(), 30,
             "the rollout role to see its worker die")
    wait_for(lambda: len(set(role_children(rollout_pid)) - {victim}) == 2, 60,
             "the worker to be restarted")
    def crash_then_join() -> bool:  # on up's console, not only in logs/rollout.log
        crash = re.search(rf"fleet: rollout-\d-{victim} killed by SIGKILL", processes.log("up"))
        return crash is not None and re.search(
            r"fleet: rollout-\d-\d+ joined", processes.log("up")[crash.end():]) is not None

    wait_for(crash_then_join, 30, "up's console to name the crash and the new worker")
    at_kill = len(step_records(metrics))
    wait_for(lambda: len(step_records(metrics)) >= at_kill + 5, 180, "five steps after the restart")

    buffer_pid = _started_pid(processes.log("up"), "buffer")
    version_before = step_records(metrics)[-1]["step"]
    os.killpg(buffer_pid, signal.SIGKILL)
    wait_for(lambda: "buffer killed by SIGKILL" in processes.log("up"), 30,
             "the launcher to see the broker die")
    wait_for(lambda: _started_pid(processes.log("up"), "buffer") != buffer_pid, 30,
             "the broker to be restarted")
    wait_for(lambda: "restored" in (logs / "buffer.log").read_text(), 30, "the spill replay")
    assert f"journaling accepted groups to {run_dir / 'buffer.spill'}" in (
        logs / "buffer.log").read_text()
    at_broker_kill = len(step_records(metrics))
    wait_for(lambda: len(step_records(metrics)) >= max(at_broker_kill + 15, 60), 400,
             "fifteen more steps after the broker restart")
    assert up.poll() is None, processes.log("up")
    assert "run stopped" not in processes.log("up")

    records = step_records(metrics)
    steps = [r["step"] for r in records]
    assert steps == sorted(steps) and steps[-1] > version_before  # versions never went back
    assert max(r["staleness/max"] for r in records) <= 2
    assert _mean_reward(records[-5:]) > _mean_reward(records[:5]) + 0.05, records
    _learner_crash_stops_the_run(up, processes, sets)


def _learner_crash_stops_the_run(up, processes: Processes, sets: list[str]) -> None:
    """A SIGKILLed learner stops the run with the cause in one line, and leaves it resumable
    (the run is past its checkpoint at step 50)."""
    os.killpg(_started_pid(processes.log("up"), "learner"), signal.SIGKILL)
    assert processes.wait(up, 60) == 1, processes.log("up")
    stopped = [ln for ln in processes.log("up").splitlines() if ln.startswith("run stopped:")]
    assert len(stopped) == 1 and "learner killed by SIGKILL" in stopped[0], stopped
    assert "resumable" in stopped[0]
    cfg = load_config(QUICKSTART, [s for s in sets if s != "--set"])
    assert is_resuming(cfg)
