"""The mixture-of-experts quickstart (``configs/moe_quickstart.toml``): a tiny random-init
Qwen3-MoE learns the quickstart's copy task through ``asyncrl up``, as the dense model does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.conftest import Processes

pytestmark = pytest.mark.slow

MOE_QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "moe_quickstart.toml"


def test_moe_quickstart_learns_with_routing_replay(tmp_path: Path, processes: Processes) -> None:
    """With ``learner.routing_replay = true``: the torch engines record the experts, the groups
    carry them through the broker and the learner replays them, all the way to the target.
    (Scattering routing over two ranks is tests/unit/test_scatter_batch.py's; the MoE forward
    without replay is tests/unit/test_moe.py's. One run here: each ``asyncrl up`` costs the
    suite a minute.)"""
    up = processes.start("up", "up", str(MOE_QUICKSTART), "--set", f"run.output_dir={tmp_path}",
                         "--set", "learner.routing_replay=true")
    assert processes.wait(up, 420) == 0, processes.log("up")
    run_dir = tmp_path / "moe_quickstart"
    final = json.loads((run_dir / "eval.json").read_text())
    assert final["val/test_score/copy"] >= 0.9, final
    config = json.loads((run_dir / "init_model" / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["num_local_experts"] == 4
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [s for s in steps if "mismatch/tokens" in s]
    assert trained and all(s["mismatch/tokens"] > 0 for s in trained), steps
    assert trained[0]["mismatch/abs_logp"] < 1e-3  # step 1 is on-policy: numerics only
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    assert learner_log.count("routing replay: 2 MoE routers (Qwen3MoeTopKRouter)") == 1
    assert "came without routing" not in learner_log
