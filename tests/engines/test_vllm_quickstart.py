"""The quickstart learns with the in-process vLLM engine: the one-line switch
``--set rollout.engine=vllm``, end to end through ``asyncrl up`` (real processes).

vLLM's CPU attention kernels need a head size >= 32, so the tiny model runs with 2 heads of 32
(hidden 64, as in the quickstart) instead of 4 of 16.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.engines.conftest import TINY_SETS
from tests.integration.conftest import QUICKSTART, Processes, processes  # noqa: F401

pytestmark = pytest.mark.slow


@pytest.mark.xfail(strict=False, reason=(
    "known intermittent plateau, tracked in issue 4: in 1 of 4 runs on 2 cores the policy "
    "collapsed to never emitting EOS (every sample at max_new_tokens, reward stuck at 0.8 = "
    "4 of 5 positions, train/rollout |dlogp| ~0.005 so not a logprob bug); the other runs "
    "reached >= 0.9 in 90-150 steps. The assertion is unchanged; an XPASS is the normal case."))
def test_quickstart_learns_with_vllm(tmp_path: Path, processes: Processes,
                                     vllm_env: dict[str, str]) -> None:
    tiny = [arg for key, value in TINY_SETS.items()
            for arg in ("--set", f"model.tiny.{key}={value}")]
    up = processes.start("up", "up", str(QUICKSTART), "--set", "rollout.engine=vllm", *tiny,
                         "--set", f"run.output_dir={tmp_path}")
    assert up.wait(timeout=540) == 0, processes.log("up")
    final = json.loads((tmp_path / "quickstart" / "eval.json").read_text())
    assert final["eval/accuracy"] >= 0.9, final
