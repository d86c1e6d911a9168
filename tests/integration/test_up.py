"""`asyncrl up`: on-policy exactness at max_staleness = 0. (That Ctrl-C leaves no process behind
is shown by test_stop_resume, whose first run is stopped so.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.metrics import read_jsonl
from tests.integration.conftest import QUICKSTART, Processes

pytestmark = pytest.mark.slow


def test_zero_staleness_is_on_policy(tmp_path: Path, processes: Processes) -> None:
    """Two learner ranks, so the consumed-version check spans a real multi-rank step."""
    up = processes.start("up", "up", str(QUICKSTART), "--set", f"run.output_dir={tmp_path}",
                         "--set", "run.name=sync", "--set", "buffer.max_staleness=0",
                         "--set", "learner.ranks=2",
                         "--set", "learner.total_steps=12", "--set", "eval.every_steps=6")
    assert up.wait(timeout=300) == 0, processes.log("up")
    records = [r for r in read_jsonl(tmp_path / "sync" / "metrics.jsonl")
               if isinstance(r.get("step"), int)]
    assert len(records) == 12
    for record in records:
        trained_at = record["step"] - 1  # the learner version the batch was consumed at
        assert record["staleness/consumed_version_min"] == trained_at, record
        assert record["staleness/consumed_version_max"] == trained_at, record
    assert all(r["buffer/dropped_stale"] == 0 for r in records)
    # verl's names, periodic held-out validation, asyncrl's step-time split.
    assert [r["step"] for r in records if "val/test_score/copy" in r] == [6, 12]
    for record in records:
        assert record["training/global_step"] == record["step"]
        assert {"actor/loss", "actor/entropy", "actor/ppo_ratio_mean", "actor/clipfrac",
                "actor/grad_norm", "actor/lr", "critic/score/mean", "critic/rewards/mean",
                "critic/advantages/mean", "response_length/mean", "staleness/max",
                "mismatch/abs_logp", "timing/step", "timing/wait_data", "timing/compute",
                "timing/weight_wait"} <= set(record), sorted(record)
    # weights.overlap: a step's record carries the previous version's delivery (the first
    # step has none yet), which overlapped this step's compute.
    assert "timing/weight_sync" not in records[0]
    for record in records[1:]:
        assert record["weights/version"] == record["step"] - 1, record
        assert record["timing/weight_sync"] > 0, record
    # Both engines receive every version once both have joined, and none is evicted. An
    # engine may join after the first versions were sent (engines join whenever they are up:
    # on a loaded CI machine one started after version 1 went to the other alone), so the
    # engines served never fall and reach both.
    members = [int(r["weights/members"]) for r in records[1:]]
    assert members == sorted(members) and members[0] >= 1 and members[-1] == 2, members
    assert "final held-out greedy eval" in processes.log("up")
