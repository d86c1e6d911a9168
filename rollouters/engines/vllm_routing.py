"""vLLM's routed experts as routing replay's frame (``learner.routing_replay``).

vLLM 0.32 returns the experts each MoE layer chose when it is built with
``enable_return_routed_experts`` (its AuxOutput connector). It then refuses to start unless it
runs its Model Runner V2, which needs Triton: on GPUs it is the default, on the CPU install vLLM
refuses it (13 s into the engine's start, saying to set ``VLLM_USE_V2_MODEL_RUNNER=1``, which
then fails with "Model Runner V2 requires Triton"). So a CPU device is refused here, before
vLLM starts, with our keys (:func:`refuse_on_cpu`), and the config check refuses
``rollout.device = "cpu"`` (:mod:`asyncrl.engine_kinds`).

What a finished ``CompletionOutput.routed_experts`` holds (vLLM's ``outputs.py``,
``v1/engine/output_processor.py``, ``distributed/aux_output_connector``,
``model_executor/layers/fused_moe/routed_experts_capturer.py``), ``[rows, layers, top_k]``:

* rows: positions ``routed_experts_prompt_start`` (0: the whole prompt) up to the last token,
  excluded: the connector's ``take_output`` stops at ``num_tokens − 1``, as the last sampled
  token is never forwarded. ``prompt + generated − 1`` rows, prompt blocks served from the
  prefix cache included (read back from its store, keyed by block hash); a stop string's
  surplus tokens are trimmed with their rows.
* layers: every decoder layer, by its number in the module name (the capturer's ``layer_id``);
  a dense layer (Qwen-MoE's ``mlp_only_layers``, ``decoder_sparse_step``) is never written,
  and reads 0, a valid expert.
* dtype: uint8 up to 256 experts, else uint16.

Ours (:mod:`asyncrl.moe_routing`, what the torch engine records) has a row per prompt and
generated token, the last one unrecorded; the MoE layers only, in forward order;
:func:`~asyncrl.moe_routing.routing_dtype`. :func:`to_routing` makes one from the other.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from asyncrl.config import ConfigError
from asyncrl.moe_routing import pad_routing, routing_dtype

MOE_TYPES = ("qwen2_moe", "qwen3_moe")
"""The model types whose routers replay knows (:data:`asyncrl.moe_routing.ROUTER_CLASSES`)."""
OPTION = "enable_return_routed_experts"
"""vLLM's ``EngineArgs`` field (``--enable-return-routed-experts`` on its server)."""


@dataclass(frozen=True)
class RoutingLayout:
    """Which of vLLM's layer rows are MoE layers (in forward order), and how many experts."""

    layers: tuple[int, ...]
    num_experts: int

    @classmethod
    def of(cls, model_dir: str | Path) -> RoutingLayout:
        """The layout of the model in ``model_dir`` (its ``config.json``)."""
        from transformers import AutoConfig

        return cls.from_config(AutoConfig.from_pretrained(str(model_dir)).get_text_config())

    @classmethod
    def from_config(cls, config: Any) -> RoutingLayout:
        """From a transformers config: a decoder layer is MoE as Qwen2-/Qwen3-MoE's decoder
        layer decides it (``Qwen3MoeDecoderLayer.__init__``)."""
        if config.model_type not in MOE_TYPES:
            raise ConfigError(f"learner.routing_replay with a vLLM engine: model type "
                             f"{config.model_type!r} is not supported ({', '.join(MOE_TYPES)})")
        skip, step = set(config.mlp_only_layers or ()), config.decoder_sparse_step
        layers = tuple(i for i in range(config.num_hidden_layers)
                       if i not in skip and config.num_experts > 0 and (i + 1) % step == 0)
        if not layers:
            raise ConfigError("learner.routing_replay = true but the model has no MoE layer "
                             "(a dense model: set it false)")
        return cls(layers, int(config.num_experts))


def to_routing(routed: np.ndarray | None, prompt_length: int, num_tokens: int,
               layout: RoutingLayout) -> np.ndarray:
    """``[prompt_length + num_tokens, MoE layers, top_k]`` in our dtype from vLLM's
    ``routed_experts`` of a sample whose prompt and completion have these lengths (requested
    from position 0); the rows vLLM did not route (its last token) unrecorded."""
    if routed is None:
        raise RuntimeError("vLLM returned no routed_experts for a finished completion "
                           f"(learner.routing_replay needs vLLM built with {OPTION})")
    length = prompt_length + num_tokens
    if routed.ndim != 3 or len(routed) > length or routed.shape[1] <= max(layout.layers):
        raise ValueError(f"vLLM's routed_experts of shape {routed.shape} do not fit a sample "
                         f"of {length} tokens and MoE layers {list(layout.layers)}")
    ours = routed[:, list(layout.layers)].astype(routing_dtype(layout.num_experts))
    return pad_routing(ours, length)


def decode_routed_experts(encoded: str | None) -> np.ndarray | None:
    """The server's ``routed_experts`` (base64 of ``.npy`` bytes, its ``numpy2base64``) as an
    array; no pickle is ever loaded."""
    if encoded is None:
        return None
    return np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)


def layout_for(model_dir: str | Path, wanted: bool, device: str) -> RoutingLayout | None:
    """What an engine converts vLLM's routed experts with; None when they are not ``wanted``
    (``learner.routing_replay`` off). A CPU engine is refused (:func:`refuse_on_cpu`)."""
    if not wanted:
        return None
    refuse_on_cpu(device)
    return RoutingLayout.of(model_dir)


def refuse_on_cpu(device: str) -> None:
    """vLLM returns routed experts on GPUs only: refuse a CPU engine before it starts (a
    :class:`ConfigError`: the launchers stop the run rather than restart the worker)."""
    if device == "cpu":
        raise ConfigError(
            "learner.routing_replay = true with rollout.engine 'vllm' or 'vllm-server' on CPU: "
            f"vLLM 0.32 returns routed experts ({OPTION}) only from its Model Runner V2, which "
            "needs Triton, and its CPU install refuses it; use rollout.device = 'cuda' (or "
            "'auto' on a GPU machine), or rollout.engine = 'torch'")


def refusal_context(exc: ValueError) -> ConfigError:
    """vLLM's refusal to start with :data:`OPTION` (a GPU without Triton, Model Runner V2
    turned off, a dense model), with the key that asked for it."""
    return ConfigError(f"learner.routing_replay = true asks vLLM for {OPTION}, and vLLM "
                      f"refused to start: {exc}")
