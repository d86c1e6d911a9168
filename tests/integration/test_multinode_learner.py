"""Two learner "nodes" as two separate `asyncrl learner --nnodes 2 --node-rank K` processes on
this machine (torchrun semantics): they form one gloo group of 2 ranks and train together."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.metrics import read_jsonl
from asyncrl.net import free_port
from tests.integration.conftest import QUICKSTART, Processes

pytestmark = pytest.mark.slow

STEPS = 80  # the quickstart scores ~0.16 at step 60 and ~0.3 at step 80: a clear margin


def test_two_nodes_form_one_group_and_learn(tmp_path: Path, processes: Processes) -> None:
    sets = ["--set", f"run.output_dir={tmp_path}", "--set", "run.name=nodes",
            "--set", f"learner.total_steps={STEPS}", "--set", "eval.every_steps=0",
            "--set", "rollout.workers=1", "--set", "checkpoint.every_steps=0"]
    _, address = processes.start_buffer(str(QUICKSTART), *sets)
    topology = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                "--buffer", address]
    nodes = [processes.start(f"node{k}", "learner", str(QUICKSTART), *sets, *topology,
                             "--node-rank", str(k)) for k in (1, 0)]   # node 1 may start first
    rollout = processes.start("rollout", "rollout", str(QUICKSTART), *sets, "--buffer", address)
    for k, node in zip((1, 0), nodes):
        # A failing rank often only reports its peer's hang-up: show both nodes' logs.
        assert node.wait(timeout=400) == 0, "\n".join(
            f"--- {name} ---\n{processes.log(name)}" for name in ("node0", "node1", "rollout"))
    assert rollout.wait(timeout=30) == 0, processes.log("rollout")

    assert "global ranks 1..1 of 2" in processes.log("node1")
    for k in (0, 1):
        assert f"learner rank {k}/2 joined gloo group" in processes.log(f"node{k}")
    records = [r for r in read_jsonl(tmp_path / "nodes" / "metrics.jsonl")
               if isinstance(r.get("step"), int)]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    scores = [r["critic/score/mean"] for r in records]
    first, last = sum(scores[:5]) / 5, sum(scores[-5:]) / 5
    assert last > first + 0.1, (first, last)   # chance is ~0.08 of positions right
    assert (tmp_path / "nodes" / "final" / "config.json").exists()
