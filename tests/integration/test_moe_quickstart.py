"""The mixture-of-experts quickstart (``configs/moe_quickstart.toml``): a tiny random-init
Qwen3-MoE learns the quickstart's copy task through ``asyncrl up``, as the dense model does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.conftest import Processes

pytestmark = pytest.mark.slow

MOE_QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "moe_quickstart.toml"


def test_moe_quickstart_learns(tmp_path: Path, processes: Processes) -> None:
    up = processes.start("up", "up", str(MOE_QUICKSTART), "--set", f"run.output_dir={tmp_path}")
    assert up.wait(timeout=420) == 0, processes.log("up")
    run_dir = tmp_path / "moe_quickstart"
    final = json.loads((run_dir / "eval.json").read_text())
    assert final["val/test_score/copy"] >= 0.9, final
    config = json.loads((run_dir / "init_model" / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["num_local_experts"] == 4
