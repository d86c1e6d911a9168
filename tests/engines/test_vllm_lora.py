"""LoRA with the in-process vLLM engine: it gets merged weights under the plain HF names (it
knows nothing of adapters), and at ``max_staleness = 0`` its logprobs are the learner's LoRA
logprobs, step after step, so every merged update landed, complete, before the next batch."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engines.conftest import TINY_SETS
from tests.integration.conftest import QUICKSTART, Processes, processes, step_records  # noqa: F401

pytestmark = pytest.mark.slow

LOGPROB_TOLERANCE = 1e-4  # mean |engine - learner| per token, fp32 (as test_vllm_engine)
STEPS = 6


def test_vllm_gets_merged_lora_weights_on_policy(tmp_path: Path, processes: Processes,
                                                 vllm_env: dict[str, str]) -> None:
    from safetensors.torch import load_file

    tiny = [arg for key, value in TINY_SETS.items()
            for arg in ("--set", f"model.tiny.{key}={value}")]
    up = processes.start("up", "up", str(QUICKSTART), "--set", "rollout.engine=vllm", *tiny,
                         "--set", f"run.output_dir={tmp_path}", "--set", "model.lora.rank=8",
                         "--set", "learner.lr=1e-2", "--set", "buffer.max_staleness=0",
                         "--set", f"learner.total_steps={STEPS}", "--set", "eval.every_steps=0",
                         # one engine: what is checked is per engine (a vLLM engine start is
                         # the most of this test's cost; test_vllm_quickstart runs two)
                         "--set", "rollout.workers=1")
    assert processes.wait(up, 540) == 0, processes.log("up")
    run_dir = tmp_path / "quickstart"
    records = step_records(run_dir / "metrics.jsonl")
    assert len(records) == STEPS
    model_bytes = sum(t.numel() * t.element_size()
                      for t in load_file(run_dir / "init_model" / "model.safetensors").values())
    for record in records:
        assert record["staleness/max"] == 0, record
        assert record["mismatch/abs_logp"] < LOGPROB_TOLERANCE, record
    # Merged full weights travel (the whole model), not the adapters.
    assert all(r["weights/bytes"] >= model_bytes for r in records if "weights/bytes" in r)
