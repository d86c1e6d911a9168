"""Engines join and die mid-run: a late engine gets the current weights before it generates,
a SIGKILLed engine is evicted from the broadcast group and the run goes on."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from asyncrl.metrics import read_jsonl
from buffers.zmq_client import ZmqBufferClient
from tests.integration.conftest import QUICKSTART, Processes, wait_for

pytestmark = pytest.mark.slow


def _steps(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [r for r in read_jsonl(path) if isinstance(r.get("step"), int)]


def _rollout(status: dict, index: int) -> dict:
    return next((m for name, m in status["members"].items()
                 if name.startswith(f"rollout-{index}-") and m.get("alive")), {})


def test_engines_join_and_die_mid_run(tmp_path: Path, processes: Processes) -> None:
    sets = ["--set", f"run.output_dir={tmp_path}", "--set", "run.name=fleet",
            "--set", "learner.total_steps=100000", "--set", "eval.every_steps=0",
            "--set", "buffer.heartbeat_timeout_s=3", "--set", "weights.timeout_s=5"]
    address_file = tmp_path / "buffer.addr"
    processes.start("buffer", "buffer", str(QUICKSTART), *sets, "--address-file",
                    str(address_file))
    wait_for(address_file.exists, 30, "the buffer address")
    address = address_file.read_text().strip()
    learner = processes.start("learner", "learner", str(QUICKSTART), *sets, "--buffer", address)
    first = processes.start("rollout0", "rollout", str(QUICKSTART), *sets, "--buffer", address,
                            "--workers", "1", "--first-index", "0")
    metrics = tmp_path / "fleet" / "metrics.jsonl"
    wait_for(lambda: len(_steps(metrics)) >= 5, 180, "five steps with one engine")

    client = ZmqBufferClient(address, timeout_s=10)
    try:
        joined_at = client.status()["version"]
        processes.start("rollout1", "rollout", str(QUICKSTART), *sets, "--buffer", address,
                        "--workers", "1", "--first-index", "1")
        wait_for(lambda: _rollout(client.status(), 1).get("info", {}).get("groups", 0) > 0,
                 120, "the late engine to produce groups")
        late = _rollout(client.status(), 1)["info"]
        assert late["engine_version"] >= joined_at, (late, joined_at)  # synced before it worked

        os.killpg(first.pid, signal.SIGKILL)
        killed_at = len(_steps(metrics))
        wait_for(lambda: len(_steps(metrics)) >= killed_at + 10, 180,
                 "ten more steps after an engine was killed")
    finally:
        client.close()
    after = _steps(metrics)[killed_at + 5:]
    assert all(r["weights/members"] == 1 for r in after), [r["weights/members"] for r in after]
    assert sum(r["weights/evicted"] for r in _steps(metrics)) >= 1 or \
        "evicting" in processes.log("learner")
    assert learner.poll() is None  # the learner never stopped
