"""The model FLOPs of a training step, and the device's peak: the learner's ``perf/mfu``.

MFU is the FLOPs the model needs for the step's tokens over the step's time and the ranks'
summed peak. It credits what the model needs, not what the kernels did: padding, activation
recomputation (``learner.activation_checkpointing``) and the chunked head's recomputed
logits are work it does not count, so it drops when they grow, which is the point.

One forward over a sequence of ``s`` tokens, in multiply-adds × 2:

- ``2 · dense · s``: every parameter a token goes through, i.e. all of them but the input
  embedding (a lookup), the LM head (below) and a vision tower (it runs on image patches,
  not text tokens: a vision-language model's MFU is its language model's); a mixture of
  experts' expert weights count ``k / E`` (the experts a token is routed to);
- ``2 · head · h``: the LM head on the ``h`` tokens it runs on (the learner's fused head runs
  on the trained tokens alone: ``learners.fused_logprobs``);
- ``2 · layers · heads · head_dim · s²``: attention's two products, causal (half of ``s²``).

A training forward and backward is three forwards; a frozen forward (the proximal or the
reference logprobs) one. A GAE critic's own step is not counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from asyncrl.models import attention_head_dim
from asyncrl.vlm import vision_prefix

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity), by a substring of the device's name;
# the first that matches counts, so a longer name comes before its prefix ("H200" before
# "H20"). ``learner.peak_tflops`` overrides them, and names a GPU not here.
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("H800", 989.0),
                    ("H20", 148.0), ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0),
                    ("L40S", 362.0))


@dataclass(frozen=True)
class ModelFlops:
    """The parameter counts and attention shape that set a model's FLOPs per token."""

    dense: float   # parameters per token outside the LM head (experts scaled by k / E)
    head: int      # the LM head's weights
    attention: int  # layers · query heads · head_dim

    @classmethod
    def of(cls, model: nn.Module) -> ModelFlops:
        """Counted from an HF model, sharded too: a DTensor's ``numel`` is the whole tensor's,
        and a ZeRO-3 partitioned parameter's its ``ds_numel``."""
        config = model.config
        text = config.get_text_config()
        head_module = model.get_output_embeddings()
        embed = model.get_input_embeddings().weight
        head = head_module.weight if head_module is not None else None
        tower = vision_prefix(model)
        experts = next((getattr(text, key) for key in ("num_experts", "num_local_experts",
                                                     "n_routed_experts")
                        if getattr(text, key, None)), None)
        share = getattr(text, "num_experts_per_tok", 0) / experts if experts else 1.0
        dense = 0.0
        for name, parameter in model.named_parameters():
            if parameter is embed or parameter is head or (
                    tower is not None and name.startswith(tower + ".")):
                continue
            dense += _numel(parameter) * (share if ".experts." in name else 1.0)
        layers = getattr(text, "num_hidden_layers", 0)
        return cls(dense=dense, head=_numel(head) if head is not None else 0,
                   attention=layers * text.num_attention_heads * attention_head_dim(config))

    def forward(self, lengths: Sequence[int], head_tokens: int) -> float:
        """FLOPs of one forward over sequences of ``lengths``, the head on ``head_tokens``."""
        return (2 * self.dense * sum(lengths) + 2 * self.head * head_tokens
                + 2 * self.attention * sum(s * s for s in lengths))

    def step(self, lengths: Sequence[int], head_tokens: int, frozen_forwards: int = 0) -> float:
        """FLOPs of a training step: a forward and backward (three forwards), and
        ``frozen_forwards`` forwards without gradients."""
        return (3 + frozen_forwards) * self.forward(lengths, head_tokens)


def _numel(parameter: torch.Tensor) -> int:
    return getattr(parameter, "ds_numel", None) or parameter.numel()


def peak_flops(device: torch.device, override_tflops: float | None = None) -> float | None:
    """The device's dense bf16 peak in FLOP/s: ``override_tflops`` (``learner.peak_tflops``)
    if set, else by the GPU's name (:data:`PEAK_BF16_TFLOPS`); None on a CPU or an unknown
    GPU (no MFU then)."""
    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    return peak_for_name(torch.cuda.get_device_name(device))


def peak_for_name(name: str) -> float | None:
    """FLOP/s of the first :data:`PEAK_BF16_TFLOPS` entry whose key is in ``name``."""
    return next((tflops * 1e12 for key, tflops in PEAK_BF16_TFLOPS if key in name), None)


def mfu(flops: float, seconds: float, peak: float | None, world: int) -> float | None:
    """``flops`` done in ``seconds`` by ``world`` devices of ``peak`` FLOP/s each, as a share
    of their peak (None without a peak)."""
    if peak is None or seconds <= 0:
        return None
    return flops / seconds / (peak * world)


__all__ = ["ModelFlops", "PEAK_BF16_TFLOPS", "mfu", "peak_flops", "peak_for_name"]
