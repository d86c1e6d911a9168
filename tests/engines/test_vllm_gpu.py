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
from tests.engines.learner_checks import learner_mismatch
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
    assert gpu_engine._llm.vllm_config.model_config.enforce_eager is False  # CUDA graphs
    delta, _ = learner_mismatch(gpu_engine, tiny_model_dir, seed=0, prompts=8, group_size=8)
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


@pytest.fixture(scope="module", params=["inprocess", "async"])
def routing_engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[object]:
    """vLLM on the tiny Qwen3-MoE, asked for routed experts (``learner.routing_replay``), in
    each mode: ``LLMEngine`` stepped here (delta outputs) and ``AsyncLLM`` (final outputs)."""
    from asyncrl.config.schema import ModelConfig, TinyModelConfig
    from asyncrl.models import prepare_model_dir
    from rollouters.engines.vllm_async import AsyncVLLMEngine
    from rollouters.engines.vllm_engine import VLLMEngine
    from rollouters.engines.vllm_options import VLLMOptions
    from tests.engines.conftest import TINY_SETS

    tiny = TinyModelConfig(**TINY_SETS, num_experts=4, num_experts_per_tok=2)
    moe_dir = prepare_model_dir(ModelConfig(tiny=tiny), tmp_path_factory.mktemp("moe"), seed=0)
    opts = VLLMOptions(eos_ids=(EOS_ID,), device="cuda", gpu_memory_utilization=0.2,
                       routed_experts=True)
    cls = VLLMEngine if request.param == "inprocess" else AsyncVLLMEngine
    engine = cls(moe_dir, opts)
    try:
        yield engine, moe_dir
    finally:
        engine.close()


def test_vllm_returns_the_experts_a_full_forward_routes(routing_engine) -> None:
    """Every completion's routing is our frame (prompt + tokens rows, the MoE layers, uint8,
    the last row unrecorded) and the experts the learner's own forward picks over the same
    tokens (sorted per token: the order of the top-k is free); replayed in the learner, its
    logprobs are the engine's."""
    import numpy as np

    from learners.batching import collate
    from learners.packing import token_logprobs
    from learners.routing_replay import RoutingReplay
    from rollouters.workflows.single_turn import generate_groups
    from tests.unit.test_routing_replay import full_forward_routing

    engine, moe_dir = routing_engine
    model = load_causal_lm(moe_dir)  # the learner's recomputation, as the tests above
    task = make_task(TaskConfig(), seed=0)
    groups = generate_groups(engine, task, task.sample(random.Random(0), 4), group_size=4,
                             temperature=1.0, max_new_tokens=8)
    same = total = 0
    for group in groups:
        routing = group.extras["routing"]
        assert routing.shape == (group.num_tokens, 2, 2) and routing.dtype == np.uint8
        for sample in group.sample_slices():
            assert (routing[sample][-1] == 255).all()
            want = full_forward_routing(model, group.tokens[sample].tolist())[:-1]
            got = np.sort(routing[sample][:-1], -1) == np.sort(want, -1)
            same, total = same + int(got.all(axis=(1, 2)).sum()), total + len(got)
    assert same >= 0.98 * total  # a near-tie may go either way between the two kernels
    batch = collate(groups, std_norm=True, pad_id=PAD_ID)
    replay = RoutingReplay(model, packing=False)
    replay.use(batch)
    with torch.no_grad():
        learner = token_logprobs(model, batch)
    replay.close()
    delta = (learner - batch.behaviour_logprobs)[batch.loss_mask].abs()
    assert float(delta.mean()) < GPU_LOGPROB_TOLERANCE


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
