"""vLLM as it runs on a GPU (``gpu`` marker): ``AsyncLLM`` with CUDA graphs (``enforce_eager``
unset follows the device), weights through the ``asyncrl_gloo`` transfer backend into the GPU
worker, and through vLLM's own ``ipc`` backend (``weights.transport = "ipc"``: CUDA IPC handles
from this process, :mod:`rollouters.engines.vllm_ipc`). Skipped without CUDA; vLLM cannot be
carried to the lent GPU machine (bench/RESULTS.md), so these wait for a machine with both (the
CUDA handles alone are checked against vLLM's way of opening them in test_ipc_handles.py)."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from asyncrl.config.schema import TaskConfig
from asyncrl.models import EOS_ID, PAD_ID, load_causal_lm
from rollouters.tasks import make_task
from tests.engines.test_vllm_engine import PROMPTS, _flat, _patched, _reference_engine

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GPU_LOGPROB_TOLERANCE = 2e-3  # mean |engine - learner| per token, fp32 on GPU kernels


@pytest.fixture(scope="module")
def gpu_engine(tiny_model_dir: Path) -> Iterator[object]:
    from rollouters.engines.vllm_async import AsyncVLLMEngine
    from rollouters.engines.vllm_options import VLLMOptions

    engine = AsyncVLLMEngine(tiny_model_dir, VLLMOptions(eos_ids=(EOS_ID,), device="cuda",
                                                         gpu_memory_utilization=0.2))
    try:
        yield engine
    finally:
        engine.close()


def test_cuda_graphs_engine_matches_learner(gpu_engine, tiny_model_dir: Path) -> None:
    from learners.backends.fsdp2 import token_logprobs
    from learners.batching import collate
    from rollouters.workflows.single_turn import generate_groups

    assert gpu_engine._llm.vllm_config.model_config.enforce_eager is False  # CUDA graphs
    task = make_task(TaskConfig(), seed=0)
    groups = generate_groups(gpu_engine, task, task.sample(random.Random(0), 8), group_size=8,
                             temperature=1.0, max_new_tokens=8)
    batch = collate(groups, std_norm=True, pad_id=PAD_ID)
    with torch.no_grad():
        learner = token_logprobs(load_causal_lm(tiny_model_dir), batch)
    delta = (learner - batch.behaviour_logprobs)[batch.loss_mask].abs()
    assert float(delta.mean()) < GPU_LOGPROB_TOLERANCE


def test_cuda_graphs_engine_takes_an_update(gpu_engine, tiny_model_dir: Path,
                                            reference_state: dict) -> None:
    patched = _patched(reference_state)
    gpu_engine.load_weights(patched.items(), version=1)
    after = _flat(gpu_engine.generate(PROMPTS, 1, 1.0, 8, greedy=True))
    want = _flat(_reference_engine(tiny_model_dir, patched).generate(PROMPTS, 1, 1.0, 8,
                                                                     greedy=True))
    assert [c.tokens for c in after] == [c.tokens for c in want]
    assert all(set(c.versions) == {1} for c in after)


def test_an_ipc_update_lands_through_vllms_own_worker_half(tiny_model_dir: Path,
                                                         reference_state: dict) -> None:
    """The update as a worker on the engine's GPU sends it: CUDA tensors, their IPC handles to
    the engine core, which must be another process (forced here: the engine tests' env puts
    it in this one, and a process cannot open its own handles)."""
    from rollouters.engines import vllm_weight_backend
    from rollouters.engines.vllm_async import AsyncVLLMEngine
    from rollouters.engines.vllm_options import VLLMOptions

    saved = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    try:
        engine = AsyncVLLMEngine(tiny_model_dir, VLLMOptions(
            eos_ids=(EOS_ID,), device="cuda", gpu_memory_utilization=0.2,
            weight_backend=vllm_weight_backend("ipc", "cuda")))
    finally:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = saved or "0"
    try:
        patched = {name: t.cuda() for name, t in _patched(reference_state).items()}
        engine.load_weights(patched.items(), version=1)
        assert torch.equal(engine.weight("model.norm.weight"),
                           patched["model.norm.weight"].float().cpu())
        after = _flat(engine.generate(PROMPTS, 1, 1.0, 8, greedy=True))
        want = _flat(_reference_engine(tiny_model_dir, _patched(reference_state)).generate(
            PROMPTS, 1, 1.0, 8, greedy=True))
        assert [c.tokens for c in after] == [c.tokens for c in want]
    finally:
        engine.close()
