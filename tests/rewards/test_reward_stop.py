"""A rollout worker whose reward hangs stops on ONE signal: the stop cancels the episodes in
flight and the hung reward's process is killed. It used to wait out ``reward.timeout_s`` in the
episode, then at its exit for the stuck (non-daemon) reward thread, until its supervisor's
second SIGTERM. Real processes through the CLI: the ZMQ broker and ``asyncrl rollout`` (a
torch engine on the agent example's data)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.integration.conftest import ROOT, Processes, wait_for
from tests.integration.conftest import processes  # noqa: F401 - the fixture

EXAMPLE = ROOT / "examples" / "agent" / "single_turn.toml"
STOP_BOUND_S = 15.0  # the supervisor's own grace is launcher.stop_timeout_s / 2 = 5 s


def test_a_worker_with_a_hung_reward_stops_on_one_sigterm(
        tmp_path: Path, processes: Processes, monkeypatch: pytest.MonkeyPatch) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv("REWARD_MARKS", str(marks))  # the roles inherit it
    sets = ["--set", f"run.output_dir={tmp_path}", "--set", "run.name=hung",
            "--set", "reward.path=tests.rewards.helpers:hang_and_mark",
            "--set", "reward.timeout_s=600", "--set", "reward.workers=1"]
    _, address = processes.start_buffer(str(EXAMPLE), *sets)
    rollout = processes.start("rollout", "rollout", str(EXAMPLE), *sets, "--buffer", address,
                              "--workers", "1")
    wait_for(lambda: any(p.suffix != ".tmp" for p in marks.iterdir()) or
             rollout.poll() is not None, 180, "a reward call to hang")
    assert rollout.poll() is None, processes.log("rollout")
    (hung,) = [int(p.name) for p in marks.iterdir()]
    start = time.monotonic()
    os.killpg(rollout.pid, signal.SIGTERM)  # one SIGTERM to each role process, as Ctrl-C does
    assert processes.wait(rollout, 60) == 0, processes.log("rollout")
    log = processes.log("rollout")
    assert time.monotonic() - start < STOP_BOUND_S, log
    assert "second SIGTERM" not in log and "stopped" in log, log
    with pytest.raises(ProcessLookupError):  # killed and reaped, not left behind
        os.kill(hung, 0)
