"""vLLM generates with the tiny mixture-of-experts model (``model.tiny.num_experts``), and its
behaviour logprobs are the learner's: the same Qwen3-MoE directory the MoE quickstart trains."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncrl.config.schema import ModelConfig, TinyModelConfig
from asyncrl.models import EOS_ID, load_causal_lm, prepare_model_dir
from tests.engines.conftest import TINY_SETS
from tests.engines.learner_checks import learner_mismatch
from tests.engines.test_vllm_engine import LOGPROB_TOLERANCE

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tiny = TinyModelConfig(**TINY_SETS, num_experts=4, num_experts_per_tok=2)
    return prepare_model_dir(ModelConfig(tiny=tiny), tmp_path_factory.mktemp("moe"), seed=0)


@pytest.fixture(scope="module")
def moe_engine(vllm_env: dict[str, str], moe_dir: Path) -> Iterator[object]:
    from rollouters.engines.vllm_engine import VLLMEngine
    from rollouters.engines.vllm_options import VLLMOptions

    engine = VLLMEngine(moe_dir, VLLMOptions(eos_ids=(EOS_ID,), seed=0))
    try:
        yield engine
    finally:
        engine.close()


def test_vllm_generates_with_the_moe_and_matches_the_learner(moe_engine, moe_dir: Path) -> None:
    assert load_causal_lm(moe_dir).config.model_type == "qwen3_moe"
    delta, _ = learner_mismatch(moe_engine, moe_dir, seed=3, prompts=4, group_size=4)
    assert delta.numel() >= 16
    assert float(delta.mean()) < LOGPROB_TOLERANCE


def test_routing_replay_asks_vllm_and_converts_its_output(moe_dir: Path) -> None:
    """With ``learner.routing_replay`` the engine asks vLLM for routed experts (an
    ``EngineArgs`` field of this vLLM) and turns a finished ``CompletionOutput`` (vLLM's own
    class) into our frame: the prompt's and the fed-back tokens' rows, the last unrecorded.
    vLLM fills ``routed_experts`` on GPUs only (tests/engines/test_vllm_gpu.py)."""
    import numpy as np
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, WeightVersionSpan

    from rollouters.engines.vllm_launch import serving_flags
    from rollouters.engines.vllm_options import (
        VLLMOptions,
        completion,
        engine_arg_names,
        engine_kwargs,
    )
    from rollouters.engines.vllm_routing import OPTION, RoutingLayout

    opts = VLLMOptions(eos_ids=(EOS_ID,), device="cuda", routed_experts=True)
    assert OPTION in engine_arg_names() and engine_kwargs(moe_dir, opts)[OPTION] is True
    assert OPTION not in engine_kwargs(moe_dir, VLLMOptions(eos_ids=(EOS_ID,)))
    assert "--enable-return-routed-experts" in serving_flags(opts)  # a launched server
    tokens, prompt_length, layout = [7, 8, EOS_ID], 4, RoutingLayout.of(moe_dir)
    routed = np.arange(6 * 2 * 2, dtype=np.uint8).reshape(6, 2, 2) % 4  # 4 + 3 − 1 rows
    sample = CompletionOutput(
        index=0, text="", token_ids=tokens, cumulative_logprob=None,
        logprobs=[{t: Logprob(-0.5)} for t in tokens], routed_experts=routed,
        finish_reason="stop", weight_versions=[WeightVersionSpan("3", 0, 3)])
    row = completion(sample, 0, prompt_length, layout)
    assert row.versions == [3, 3, 3] and row.routing.shape == (7, 2, 2)
    np.testing.assert_array_equal(row.routing[:6], routed)
    assert (row.routing[6] == 255).all()


def test_a_cpu_engine_refuses_routing_replay_before_vllm_starts(vllm_env, moe_dir: Path
                                                                ) -> None:
    """vLLM's CPU install refuses ``enable_return_routed_experts`` 13 s into its start, with
    a misleading hint; ours comes at once, with our keys."""
    from rollouters.engines.vllm_engine import VLLMEngine
    from rollouters.engines.vllm_options import VLLMOptions

    with pytest.raises(ValueError, match="learner.routing_replay = true .* on CPU"):
        VLLMEngine(moe_dir, VLLMOptions(eos_ids=(EOS_ID,), routed_experts=True))
