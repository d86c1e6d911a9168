"""The roles as separate OS processes started through the CLI, as a user would on four
machines: `asyncrl buffer`, `asyncrl learner --buffer` on two learner "nodes" (two separate
`asyncrl learner --nnodes 2 --node-rank K` processes, torchrun semantics: one gloo group of 2
ranks that trains together), `asyncrl rollout --buffer`."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.metrics import read_jsonl
from asyncrl.net import free_port
from tests.integration.conftest import QUICKSTART, ROOT, Processes, role_env, wait_for

pytestmark = pytest.mark.slow


def test_separate_processes_learn(tmp_path: Path, processes: Processes) -> None:
    sets = ["--set", f"run.output_dir={tmp_path}", "--set", "run.name=roles",
            "--set", "learner.total_steps=120", "--set", "eval.every_steps=0"]
    buffer, address = processes.start_buffer(str(QUICKSTART), *sets)
    topology = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                "--buffer", address]
    nodes = [processes.start(f"node{k}", "learner", str(QUICKSTART), *sets, *topology,
                             "--node-rank", str(k)) for k in (1, 0)]   # node 1 may start first
    rollout = processes.start("rollout", "rollout", str(QUICKSTART), *sets, "--buffer", address,
                              "--workers", "2")
    _check_status_and_monitor(sets, address, tmp_path)
    for node in nodes:
        # A failing rank often only reports its peer's hang-up: show both nodes' logs.
        assert node.wait(timeout=400) == 0, "\n".join(
            f"--- {name} ---\n{processes.log(name)}" for name in ("node0", "node1", "rollout"))
    assert processes.wait(rollout, 30) == 0, processes.log("rollout")  # they see run status done
    assert buffer.poll() is None  # the broker outlives a run until it is told to stop
    assert "global ranks 1..1 of 2" in processes.log("node1")
    for k in (0, 1):
        assert f"learner rank {k}/2 joined gloo group" in processes.log(f"node{k}")

    records = [r for r in read_jsonl(tmp_path / "roles" / "metrics.jsonl")
               if isinstance(r.get("step"), int)]
    assert [r["step"] for r in records] == list(range(1, 121))
    rewards = [r["critic/score/mean"] for r in records]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.2 and last > 0.5, (first, last)  # chance is ~0.08 of positions right
    assert max(r["staleness/max"] for r in records) <= 2
    assert records[-1]["rollout/workers"] == 2
    assert (tmp_path / "roles" / "final" / "config.json").exists()
    assert (tmp_path / "roles" / "eval.json").exists()


def _check_status_and_monitor(sets: list[str], address: str, tmp_path: Path) -> None:
    """`asyncrl status --json` and `asyncrl monitor` attach to the running run."""
    def status() -> dict:
        out = subprocess.run([sys.executable, "-m", "asyncrl.cli", "status", str(QUICKSTART),
                              *sets, "--buffer", address, "--json"], env=role_env(), cwd=ROOT,
                             check=True, capture_output=True, text=True, timeout=60).stdout
        return json.loads(out)

    wait_for(lambda: status()["version"] >= 2, 180, "two published versions")
    snapshot = status()
    assert snapshot["run_status"] == "running" and snapshot["accepted"] > 0
    assert sum(m["role"] == "rollout" for m in snapshot["members"].values()) == 2
    log = (tmp_path / "monitor.log").open("w")
    monitor = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "monitor", str(QUICKSTART),
                                *sets, "--buffer", address], env=role_env(), cwd=ROOT,
                               stdout=log, stderr=subprocess.STDOUT)
    screen = tmp_path / "monitor.log"
    wait_for(lambda: screen.read_text().count("engine") >= 2, 60, "two monitor refreshes")
    monitor.send_signal(signal.SIGTERM)
    assert monitor.wait(timeout=30) == 0
    log.close()
    text = screen.read_text()
    assert "staleness of consumed groups" in text and "rollout-0-" in text
