"""Switching backends is one line: the quickstart, unchanged but for `--set buffer.type=redis`,
runs against a real Redis (127.0.0.1:6379, as on the CI machine) and learns."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.metrics import read_jsonl
from buffers.redis_buffer import reset_run
from tests.integration.conftest import QUICKSTART, Processes

pytestmark = pytest.mark.slow


def test_quickstart_learns_with_redis(tmp_path: Path, processes: Processes) -> None:
    name = f"redis-quickstart-{uuid.uuid4().hex[:8]}"  # its own namespace on a shared Redis
    sets = ["--set", f"run.output_dir={tmp_path}", "--set", f"run.name={name}"]
    try:
        up = processes.start("up", "up", str(QUICKSTART), *sets, "--set", "buffer.type=redis")
        assert processes.wait(up, 420) == 0, processes.log("up")
    finally:
        reset_run(load_config(QUICKSTART, [a for a in sets if a != "--set"]).buffer, name)
    run_dir = tmp_path / name
    assert not (run_dir / "buffer.addr").exists()  # no broker process: Redis is the broker
    final = json.loads((run_dir / "eval.json").read_text())
    assert final["val/test_score/copy"] >= 0.9, final
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if isinstance(r.get("step"), int)]
    assert max(r["staleness/max"] for r in records) <= 2
    # Buffer stats are read when the step's batch was fetched: at the step's start, or during
    # the step before it (learners.prefetch). Either way before the step's publish, and the
    # previous version's delivery runs on the publisher's thread (weights.overlap) and may not
    # have published yet, so the buffer is 1 to 3 versions behind the record's step. Its
    # weights/* metrics arrive with this step's record.
    last = records[-1]
    assert last["step"] - 3 <= last["buffer/version"] <= last["step"] - 1, last
    assert last["weights/version"] == last["step"] - 1, last
