"""vLLM's routed experts in routing replay's frame (``rollouters/engines/vllm_routing.py``).

vLLM returns them only on GPUs (Model Runner V2), so the arrays here are built as vLLM's source
says it returns them (rows ``[0, prompt + generated − 1)``, a row per decoder layer, uint8 up
to 256 experts) from what the torch engine recorded on the tiny Qwen3-MoE for the same tokens:
the conversion must give back exactly the torch engine's frame. The engine on a GPU:
``tests/engines/test_vllm_gpu.py``. No vLLM import here.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest
from transformers import Qwen2MoeConfig, Qwen3MoeConfig

from asyncrl.config import ConfigError, load_config
from asyncrl.models import EOS_ID, PAD_ID, load_causal_lm
from rollouters.engines.torch_engine import TorchEngine
from rollouters.engines.vllm_routing import (
    RoutingLayout,
    decode_routed_experts,
    refuse_on_cpu,
    to_routing,
)
from tests.unit.test_moe import moe_dir  # noqa: F401  (the module-scoped fixture)

ROOT = Path(__file__).resolve().parents[2]


def as_vllm_returns(ours: np.ndarray, layers: int, moe_layers: tuple[int, ...],
                    dtype: str = "u1") -> np.ndarray:
    """Our frame of a sample as vLLM's ``routed_experts``: without the last (never forwarded)
    row, a row per decoder layer (a dense one never written: 0), vLLM's dtype."""
    out = np.zeros((len(ours) - 1, layers, ours.shape[2]), dtype=dtype)
    out[:, list(moe_layers)] = ours[:-1]
    return out


def test_the_conversion_gives_back_the_torch_engines_frame(moe_dir: Path) -> None:  # noqa: F811
    """Prompts of different lengths, completions of different lengths: vLLM's array for the
    same positions converts to the torch engine's array, dtype and unrecorded last row
    included; with a dense layer between the MoE ones, its rows are left out."""
    layout = RoutingLayout.of(moe_dir)
    assert layout == RoutingLayout((0, 1), 4)
    engine = TorchEngine(load_causal_lm(moe_dir), eos_ids=[EOS_ID], pad_id=PAD_ID, seed=0,
                         record_routing=True)
    prompts = [[1, 5, 6, 7, 2], [1, 8, 2]]
    for prompt, completions in zip(prompts, engine.generate(prompts, n=3, temperature=1.0,
                                                            max_new_tokens=6)):
        for completion in completions:
            torch_frame = completion.routing
            n = len(completion.tokens)
            routed = as_vllm_returns(torch_frame, 2, layout.layers)
            converted = to_routing(routed, len(prompt), n, layout)
            assert converted.dtype == torch_frame.dtype
            np.testing.assert_array_equal(converted, torch_frame)
            with_dense = as_vllm_returns(torch_frame, 3, (0, 2))  # layer 1 dense: zeros
            np.testing.assert_array_equal(
                to_routing(with_dense, len(prompt), n, RoutingLayout((0, 2), 4)), torch_frame)


def test_shorter_longer_and_missing_arrays() -> None:
    """A stop string's surplus tokens are trimmed with their rows (fewer rows: unrecorded);
    more rows than positions, or none, is an error rather than a shifted replay."""
    layout = RoutingLayout((0,), 4)
    routed = np.ones((3, 1, 2), np.uint8)
    short = to_routing(routed, prompt_length=2, num_tokens=4, layout=layout)
    assert short.shape == (6, 1, 2) and (short[3:] == 255).all() and (short[:3] == 1).all()
    with pytest.raises(ValueError, match="do not fit a sample of 4 tokens"):
        to_routing(np.ones((5, 1, 2), np.uint8), 2, 2, layout)
    with pytest.raises(RuntimeError, match="enable_return_routed_experts"):
        to_routing(None, 2, 2, layout)


def test_many_experts_widen_to_int16() -> None:
    """vLLM's uint16 (over 256 experts) becomes our int16, unrecorded −1; expert 255 stays
    an expert (uint8 could not tell it from the mark)."""
    routed = np.array([[[255, 299]], [[0, 1]]], np.uint16)
    ours = to_routing(routed, 1, 2, RoutingLayout((0,), 300))
    assert ours.dtype == np.dtype("<i2")
    np.testing.assert_array_equal(ours[:, 0], [[255, 299], [0, 1], [-1, -1]])


@pytest.mark.parametrize("cls, sets, layers", [
    (Qwen3MoeConfig, {}, (0, 1, 2, 3)),
    (Qwen3MoeConfig, {"mlp_only_layers": [0, 3]}, (1, 2)),
    (Qwen2MoeConfig, {"decoder_sparse_step": 2}, (1, 3)),
])
def test_the_moe_layers_are_those_transformers_builds(cls, sets, layers) -> None:
    config = cls(num_hidden_layers=4, num_experts=8, hidden_size=32, num_attention_heads=2,
                 num_key_value_heads=1, **sets)
    assert RoutingLayout.from_config(config) == RoutingLayout(layers, 8)


def test_an_unknown_model_type_is_refused() -> None:
    from transformers import Qwen2Config

    with pytest.raises(ConfigError, match="learner.routing_replay with a vLLM engine"):
        RoutingLayout.from_config(Qwen2Config())


def test_the_servers_base64_npy_decodes() -> None:
    """The server's encoding (vLLM's ``numpy2base64``: ``np.save`` bytes, base64)."""
    routed = np.arange(12, dtype=np.uint8).reshape(3, 2, 2)
    with io.BytesIO() as buffer:
        np.save(buffer, routed, allow_pickle=False)
        encoded = base64.b64encode(buffer.getbuffer()).decode("ascii")
    np.testing.assert_array_equal(decode_routed_experts(encoded), routed)
    assert decode_routed_experts(None) is None


@pytest.mark.parametrize("sets, refused", [
    (["rollout.engine='vllm'"], True),  # rollout.device = 'cpu', the default
    (["rollout.engine='vllm-server'"], True),
    (["rollout.engine='vllm'", "rollout.device='cuda'"], False),
    (["rollout.engine='vllm'", "rollout.device='auto'"], False),  # decided where it starts
    (["rollout.engine='vllm-server'", "rollout.url='http://gpu-host:8000'",
      "rollout.workers=1"], False),
])
def test_the_config_refuses_vllm_routing_on_cpu(sets: list[str], refused: bool) -> None:
    """vLLM's CPU install refuses ``enable_return_routed_experts`` 13 s into the engine's start
    with a misleading hint (set VLLM_USE_V2_MODEL_RUNNER=1, which then fails for want of
    Triton): the config refuses it at once, naming the keys."""
    args = ["learner.routing_replay=true", *sets]
    if not refused:
        load_config(ROOT / "configs/moe_quickstart.toml", args)
        return
    with pytest.raises(ConfigError) as error:
        load_config(ROOT / "configs/moe_quickstart.toml", args)
    for key in ("learner.routing_replay", "rollout.engine", "rollout.device = 'cpu'",
                "Triton"):
        assert key in str(error.value)


def test_an_engine_on_cpu_refuses_before_vllm_starts() -> None:
    """``rollout.device = 'auto'`` on a machine without CUDA reaches the engine: it refuses
    with the same keys, before vLLM is imported."""
    with pytest.raises(ConfigError, match="learner.routing_replay = true .* on CPU"):
        refuse_on_cpu("cpu")  # a ConfigError: the launchers stop the run, no restart loop
    refuse_on_cpu("cuda")
