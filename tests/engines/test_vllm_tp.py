"""vLLM's tensor and data parallelism (``rollout.vllm.tensor_parallel_size``,
``data_parallel_size``), run for real: the AsyncLLM engine with two vLLM workers on CPU, as
TP=2 (two workers of one engine core, each holding half of every sharded matrix) and as DP=2
(two engine cores of one worker each). Each generates with the learner's logprobs and takes
an update through ``asyncrl_gloo``, whose group is then this process and both workers: every
worker receives the full tensors and vLLM's ``load_weights`` keeps its shard.

Two engine starts of 20-50 s each, so the module runs only with ``ASYNCRL_VLLM_PARALLEL=1``
(docs/testing.md). On CPU, TP=2 starts only with ``VLLM_CPU_OMP_THREADS_BIND=nobind`` on a
host with one NUMA node; the engine sets it (:func:`~rollouters.engines.vllm_options.
cpu_thread_binding`), and this module leaves the variable unset to check that it does.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from asyncrl.models import EOS_ID
from tests.engines.conftest import restored_env
from tests.engines.learner_checks import learner_mismatch
from tests.engines.test_vllm_engine import (
    LOGPROB_TOLERANCE,
    PROMPTS,
    _flat,
    _patched,
    _reference_engine,
)
from tests.engines.test_vllm_async import _children
from tests.integration.conftest import wait_for

logger = logging.getLogger(__name__)

GATE = "ASYNCRL_VLLM_PARALLEL"
pytestmark = pytest.mark.skipif(os.environ.get(GATE) != "1",
                                reason=f"two multi-worker vLLM engine starts; {GATE}=1 runs them")

MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"
LAYOUTS = {"tp2": (2, 1), "dp2": (1, 2)}  # (tensor_parallel_size, data_parallel_size)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def parallel_engine(request: pytest.FixtureRequest, vllm_env: dict[str, str],
                    tiny_model_dir: Path) -> Iterator[object]:
    """One AsyncLLM engine of two workers per layout; the environment as it was, after."""
    from rollouters.engines.vllm_async import AsyncVLLMEngine
    from rollouters.engines.vllm_options import THREADS_BIND, VLLMOptions

    tp, dp = LAYOUTS[request.param]
    assert THREADS_BIND not in os.environ, f"{THREADS_BIND} is set: the test checks the default"
    children, start = _children(), time.perf_counter()
    with restored_env(MULTIPROCESSING, THREADS_BIND):
        os.environ[MULTIPROCESSING] = "1"  # the AsyncLLM core in its own process, as in a run
        engine = AsyncVLLMEngine(tiny_model_dir, VLLMOptions(
            eos_ids=(EOS_ID,), seed=0, tensor_parallel_size=tp, data_parallel_size=dp))
    logger.info("vLLM AsyncLLM %s started in %.1fs", request.param, time.perf_counter() - start)
    engine.children_before = children  # for the test that closes it
    try:
        yield engine
    finally:
        engine.close()


def _patched_shards(state: dict) -> dict:
    """:func:`_patched` (the final norm negated), and a column-parallel and a row-parallel
    matrix of every layer scaled, so each tensor-parallel rank's shard must land too."""
    patched = _patched(state)
    for name in state:
        if name.endswith(("self_attn.q_proj.weight", "mlp.down_proj.weight")):
            patched[name] = 2 * state[name]
    return patched


def _every_worker(engine, name: str) -> list[torch.Tensor]:
    """Parameter ``name`` as each worker of each engine core holds it (vLLM's own
    ``collective_rpc`` answers for the first engine core only)."""
    per_core = engine._run(engine._llm.engine_core.call_utility_all_async(
        "collective_rpc", "asyncrl_weight", None, (name,), None))
    return [torch.tensor(values) for workers in per_core for values in workers]


def test_parallel_logprobs_match_learner_recompute(parallel_engine, tiny_model_dir: Path
                                                   ) -> None:
    delta, batch = learner_mismatch(parallel_engine, tiny_model_dir, seed=2)
    logger.info("logprob mismatch: mean %.2e max %.2e over %d tokens", delta.mean(),
                delta.max(), delta.numel())
    assert float(delta.mean()) < LOGPROB_TOLERANCE
    assert bool((batch.versions[batch.loss_mask] == parallel_engine.version).all())


def test_parallel_update_reaches_every_worker(parallel_engine, tiny_model_dir: Path,
                                              reference_state: dict) -> None:
    """An update through ``asyncrl_gloo`` (a group of this process and the two workers):
    every worker holds the new weights, and greedy rows are the reference's, token for token
    and logprob for logprob; the initial weights back, the rows are the first ones again."""
    engine = parallel_engine
    before = _flat(engine.generate(PROMPTS, n=1, temperature=1.0, max_new_tokens=8,
                                   greedy=True))
    patched = _patched_shards(reference_state)
    version = engine.version + 1
    start = time.perf_counter()
    engine.load_weights(patched.items(), version=version)
    logger.info("update of %d tensors in %.2fs", len(patched), time.perf_counter() - start)
    assert engine._sender.world == 3
    norms = _every_worker(engine, "model.norm.weight")
    assert len(norms) == 2 and all(torch.equal(n, patched["model.norm.weight"]) for n in norms)
    after = _flat(engine.generate(PROMPTS, n=1, temperature=1.0, max_new_tokens=8,
                                  greedy=True))
    expected = _flat(_reference_engine(tiny_model_dir, patched).generate(
        PROMPTS, n=1, temperature=1.0, max_new_tokens=8, greedy=True))
    assert [c.tokens for c in after] == [c.tokens for c in expected]
    assert [c.tokens for c in after] != [c.tokens for c in before]
    for got, want in zip(after, expected):
        assert float((torch.tensor(got.logprobs) - torch.tensor(want.logprobs)).abs().max()) \
            < 1e-3
    assert all(set(c.versions) == {version} for c in after)
    engine.load_weights(reference_state.items(), version=version + 1)
    again = _flat(engine.generate(PROMPTS, n=1, temperature=1.0, max_new_tokens=8,
                                  greedy=True))
    assert [c.tokens for c in again] == [c.tokens for c in before]


def test_parallel_close_stops_every_process(parallel_engine) -> None:
    """``close`` returns without error (it raised vLLM's ``EngineDeadError`` with DP=2: the
    shutdown outlived the dead-core check) and leaves no engine core or coordinator behind.
    Last for each layout: the engine is closed after it."""
    parallel_engine.close()
    wait_for(lambda: _children() == parallel_engine.children_before, 30,
             "the engine's processes to exit")
