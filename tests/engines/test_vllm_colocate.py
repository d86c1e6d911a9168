"""`asyncrl up` with ``launcher.colocate = true`` and the vLLM engine: the learner and vLLM take
turns, through real processes and a real vLLM on CPU. The in-process mode: ``AsyncLLM``'s
spawned engine core costs ~60 s of start on 2 cores, and its sleep sequence has its own test
(``tests/engines/test_vllm_async.py``); the phases around the engine are the same.

Synchronous (``max_staleness = 0``), so every step's batch comes from the weights the learner
just sent, whether they reached the engine awake or were held while it slept
(``rollouters.engines.vllm_sleep``): the engine's logprobs equal the learner's at every step.
A few steps only, since vLLM's start is most of the run; that the colocated mode learns is
``tests/integration/test_colocate.py``'s, with the torch engine. On CPU vLLM's sleep frees
nothing (its CPU worker's sleep is a no-op), and the engine's report says so.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.metrics import read_jsonl
from tests.integration.conftest import QUICKSTART, Processes, processes  # noqa: F401

pytestmark = pytest.mark.slow

STEPS = 4


def test_colocated_run_with_vllm_stays_on_policy(tmp_path: Path, processes: Processes,
                                                 vllm_env: dict[str, str]) -> None:
    sets = ["launcher.colocate=true", "rollout.engine=vllm", "rollout.vllm.mode=inprocess",
            "rollout.workers=1",
            "buffer.max_staleness=0", f"learner.total_steps={STEPS}", "eval.every_steps=0",
            "task.eval_size=8", f"run.output_dir={tmp_path}", "run.name=vllm"]
    up = processes.start("up", "up", str(QUICKSTART), *[a for s in sets for a in ("--set", s)])
    assert processes.wait(up, 300) == 0, processes.log("up")
    records = [r for r in read_jsonl(tmp_path / "vllm" / "metrics.jsonl")
               if isinstance(r.get("step"), int)]
    assert len(records) == STEPS
    for record in records:
        assert record["colocate/engines"] == 1 and record["colocate/not_asleep"] == 0, record
        assert record["staleness/max"] == 0, record
        assert record["mismatch/abs_logp"] < 1e-5, record
        # vLLM's weights and KV cache, not freed on CPU (by vLLM's design), and reported
        assert record["colocate/asleep_held_bytes"] > 0, record
