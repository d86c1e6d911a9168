"""Engines join and die mid-run: a late engine gets the current weights before it generates,
a SIGKILLed engine is evicted from the broadcast group and the run goes on, a fleet with
another model stops on the first update it refuses, and Ctrl-C on a fleet that joined makes it
leave cleanly."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from buffers.zmq_client import ZmqBufferClient
from tests.integration.conftest import QUICKSTART, Processes, step_records, wait_for

pytestmark = pytest.mark.slow



def _rollout(status: dict, index: int) -> dict:
    return next((m for name, m in status["members"].items()
                 if name.startswith(f"rollout-{index}-") and m.get("alive")), {})


def test_engines_join_and_die_mid_run(tmp_path: Path, processes: Processes) -> None:
    sets = ["--set", f"run.output_dir={tmp_path}", "--set", "run.name=fleet",
            "--set", "learner.total_steps=100000", "--set", "eval.every_steps=0",
            "--set", "buffer.heartbeat_timeout_s=30", "--set", "weights.timeout_s=5"]
    # Liveness (30 s) slower than a learner step even on a loaded machine, so the killed engine
    # is still listed at the next sync and its eviction (join timeout, 5 s) is what removes it:
    # with 3 s, a step slower than 3 s let liveness drop it first and nothing was evicted.
    _, address = processes.start_buffer(str(QUICKSTART), *sets)
    learner = processes.start("learner", "learner", str(QUICKSTART), *sets, "--buffer", address)
    first = processes.start("rollout0", "rollout", str(QUICKSTART), *sets, "--buffer", address,
                            "--workers", "1", "--first-index", "0")
    metrics = tmp_path / "fleet" / "metrics.jsonl"
    wait_for(lambda: len(step_records(metrics)) >= 5, 180, "five steps with one engine")

    client = ZmqBufferClient(address, timeout_s=10)
    try:
        joined_at = client.status()["version"]
        joiner = processes.start("rollout1", "rollout", str(QUICKSTART), *sets,
                                 "--buffer", address, "--workers", "1", "--first-index", "1")
        wait_for(lambda: _rollout(client.status(), 1).get("info", {}).get("groups", 0) > 0,
                 120, "the late engine to produce groups")
        late = _rollout(client.status(), 1)["info"]
        assert late["engine_version"] >= joined_at, (late, joined_at)  # synced before it worked

        os.killpg(first.pid, signal.SIGKILL)
        killed_at = len(step_records(metrics))
        wait_for(lambda: len(step_records(metrics)) >= killed_at + 10, 180,
                 "ten more steps after an engine was killed")
        after = step_records(metrics)[killed_at + 5:]

        # A fleet whose model is not the learner's (its own run directory, so its own tiny
        # model, wider): its engine refuses the first update before loading any of it, and the
        # fleet stops with the reason as a config error (exit 2, not restarted).
        mismatched = processes.start(
            "rollout2", "rollout", str(QUICKSTART), *sets, "--set", "run.name=other",
            "--set", "model.tiny.hidden_size=96", "--buffer", address, "--workers", "1",
            "--first-index", "2")
        assert processes.wait(mismatched, 120) == 2, processes.log("rollout2")
        log = processes.log("rollout2")
        assert "does not take the learner's weights" in log, log
        assert "model.embed_tokens.weight: shape" in log, log
        resumed_at = len(step_records(metrics))
        wait_for(lambda: len(step_records(metrics)) >= resumed_at + 3, 180,
                 "three more steps after the mismatched fleet stopped")
    finally:
        client.close()
    assert all(r["weights/members"] == 1 for r in after), [r["weights/members"] for r in after]
    assert sum(r.get("weights/evicted", 0) for r in step_records(metrics)) >= 1 or \
        "weights: evicted" in processes.log("learner")
    assert learner.poll() is None  # the learner never stopped

    os.killpg(joiner.pid, signal.SIGINT)  # Ctrl-C in its terminal: the foreground group
    assert processes.wait(joiner, 60) == 0, processes.log("rollout1")
    assert "rollout-1-" in processes.log("rollout1") and "stopped" in processes.log("rollout1")
    with ZmqBufferClient(address, timeout_s=10) as client:
        gone = [m for name, m in client.status()["members"].items()
                if name.startswith("rollout-1-")]
        assert gone and all(m.get("info", {}).get("state") == "stopped" for m in gone), gone
    assert learner.poll() is None  # the run outlives the fleet that left
