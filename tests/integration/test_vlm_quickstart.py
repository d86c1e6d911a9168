"""The vision-language quickstart (``configs/vlm_quickstart.toml``): a tiny random-init Qwen2-VL
learns to name an image's colour (chance 0.25; the prompt holds nothing else) through
``asyncrl up``: images from the task, through the torch engines, the ZMQ broker and the
learner's recompute of the pixels."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.conftest import Processes

pytestmark = pytest.mark.slow

VLM_QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "vlm_quickstart.toml"


def test_vlm_quickstart_learns_from_the_image(tmp_path: Path, processes: Processes) -> None:
    check_learnt(tmp_path, processes)


def check_learnt(tmp_path: Path, processes: Processes, *sets: str) -> None:
    """``asyncrl up`` on the VLM quickstart (``--set`` each of ``sets``) reaches 0.9 held-out,
    from below 0.5, on-policy at step 1, with the quickstart's final accuracy line."""
    more = [arg for value in sets for arg in ("--set", value)]
    up = processes.start("up", "up", str(VLM_QUICKSTART), "--set", f"run.output_dir={tmp_path}",
                         *more)
    assert processes.wait(up, 420) == 0, processes.log("up")
    run_dir = tmp_path / "vlm_quickstart"
    final = json.loads((run_dir / "eval.json").read_text())
    assert final["val/test_score/colour"] >= 0.9, final
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [s["val/test_score/colour"] for s in steps if "val/test_score/colour" in s]
    assert evals[0] < 0.5, evals          # it starts near or below chance (0.25)
    assert steps[0]["mismatch/abs_logp"] < 1e-3  # step 1 is on-policy: the pixels match
    assert "final held-out greedy eval (128 prompts): accuracy" in processes.log("up")
    config = json.loads((run_dir / "init_model" / "config.json").read_text())
    assert config["model_type"] == "qwen2_vl" and config["vision_config"]["depth"] == 1
