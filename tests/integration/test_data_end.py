"""A run whose data runs out before ``learner.total_steps`` ends there, as a finished run:
`asyncrl up` used to wait for ever once its rollout workers had read their data.epochs
passes (the learner waiting for a batch nothing would fill, and saying nothing). Real
processes through the CLI: two torch-engine rollout workers sharing a JSONL file, the
learner, the ZMQ broker. The reward hangs on one row: its calls are killed at
``reward.timeout_s``, the others still score, and both are counted in ``metrics.jsonl``."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.metrics import read_jsonl
from learners.checkpoint import read_meta, step_dirs
from tests.integration.conftest import ROOT, Processes

pytestmark = pytest.mark.slow

EXAMPLE = ROOT / "examples" / "agent" / "single_turn.toml"


def test_a_run_whose_data_runs_out_ends_finished(tmp_path: Path, processes: Processes) -> None:
    # 8 rows, 2 passes, 2 workers: 16 groups at most (fewer if dropped stale), 4 per step
    up = processes.start("up", "up", str(EXAMPLE), "--set", f"run.output_dir={tmp_path}",
                         "--set", "run.name=ends", "--set", "data.epochs=2",
                         "--set", "rollout.workers=2", "--set", "rollout.groups_per_batch=2",
                         "--set", "learner.groups_per_step=4",
                         "--set", "learner.total_steps=1000", "--set", "eval.every_steps=0",
                         "--set", "reward.path=tests.rewards.helpers:hang_on_row_r3",
                         "--set", "reward.timeout_s=1")
    assert processes.wait(up, 300) == 0, processes.log("up")
    assert "stopped: its share of data.path ran out" in processes.log("up")
    log = (tmp_path / "ends" / "logs" / "learner.log").read_text()
    assert "the data ran out: the 2 rollout workers' shares of data.path all ran out" in log, log
    records = read_jsonl(tmp_path / "ends" / "metrics.jsonl")
    steps = [r["step"] for r in records]
    trained = [s for s in steps if isinstance(s, int)]
    last = [r for r in records if isinstance(r["step"], int)][-1]
    # row r3 in each of the 2 passes: 8 episodes each, killed; the other rows scored
    assert last["reward/timeout"] >= 8 and last["reward/ok"] >= 8, last
    assert last["reward/failed"] == last["reward/timeout"], last
    assert "rewards failed" in processes.log("up")  # the progress line says so
    assert 1 <= len(trained) <= 4 and steps[-1] == "final", steps
    assert f"ending the run at step {trained[-1]} of learner.total_steps = 1000" in log
    (version, path), = step_dirs(tmp_path / "ends" / "checkpoints")
    assert version == trained[-1] and read_meta(path).counters["finished"] is True
    assert (tmp_path / "ends" / "final" / "config.json").exists()
