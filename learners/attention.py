"""The learner's attention kernel (``model.attn_implementation``), and a varlen ``sdpa``.

A packed micro-batch is one row of several sequences (``learners.packing``). With ``sdpa`` or
``eager``, transformers gives it a dense block-diagonal mask, which takes ``sdpa`` off its
fused causal kernel: packing then lost to padding (0.47x, ``bench/RESULTS.md``). A varlen
kernel attends within each sequence and needs no mask:

- ``flash_attention_2`` (the ``flash-attn`` package, CUDA): transformers' varlen path; the
  sequence boundaries come from the packed forward (``cu_seq_lens_*``).
- ``flex_attention``: transformers builds a block mask of the packed sequences. torch (2.13)
  runs it on CPU without a backward pass, so it trains on CUDA only (refused on CPU), where
  inductor's kernel needs a head dimension of at least 16 (refused below: the first GPU run
  failed there with a tiny model's 8).
- ``varlen_sdpa`` (here, any device): ``sdpa`` with its causal kernel once per sequence of
  the packed row, no mask at all; on CUDA in fp16/bf16, one call of torch's own
  flash-attention varlen kernel for the whole row instead, where it runs
  (:mod:`learners.flash_varlen`). A padded batch runs ``sdpa`` once per row: right padding
  (the learner's) never reaches a real token under a causal mask, so no padding mask is
  needed either; a left-padded mask or a KV cache (generation) is refused.

``auto`` takes ``flash_attention_2`` where it can run, else ``varlen_sdpa``; the choice is
logged. transformers finds ``varlen_sdpa`` by name in its attention registry, where
:func:`register_varlen_sdpa` puts it (idempotent) before a model is loaded with it.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from asyncrl.models import attention_head_dim
from learners import flash_varlen

logger = logging.getLogger(__name__)

VARLEN_SDPA = "varlen_sdpa"
KEY = "model.attn_implementation"
FLEX_MIN_HEAD_DIM = 16   # inductor's flex_attention lowering (torch 2.11 on an H200)


def resolve_attn_implementation(requested: str, device: torch.device,
                                model_config: Any = None) -> str:
    """The kernel to load the learner's models with: ``requested``, or ``auto``'s pick
    (logged; ``sdpa`` for a model with sliding-window layers, which ``varlen_sdpa`` lacks).
    Refuses, naming the key, a kernel that cannot train on ``device``."""
    flash = device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None
    if requested == "auto":
        chosen = "flash_attention_2" if flash else \
            "sdpa" if _sliding(model_config) else VARLEN_SDPA
        logger.info("%s = auto: %s on %s (flash-attn %s)", KEY, chosen, device.type,
                    "installed" if flash else "not usable here")
        return chosen
    if requested == "flash_attention_2" and not flash:
        raise ValueError(f"{KEY} = \"flash_attention_2\" needs CUDA and the flash-attn "
                         f"package (device {device.type}); use \"auto\" or \"{VARLEN_SDPA}\"")
    if requested == "flex_attention" and device.type == "cpu":
        raise ValueError(f"{KEY} = \"flex_attention\": torch {torch.__version__} has no "
                         f"flex_attention backward on CPU, so it cannot train there; use "
                         f"\"{VARLEN_SDPA}\" (the same varlen attention with sdpa)")
    if requested == "flex_attention" and model_config is not None \
            and (head_dim := attention_head_dim(model_config)) < FLEX_MIN_HEAD_DIM:
        raise ValueError(f"{KEY} = \"flex_attention\": its CUDA kernel needs a head dimension "
                         f"of at least {FLEX_MIN_HEAD_DIM}, and this model's is {head_dim}; "
                         f"use \"{VARLEN_SDPA}\" or \"auto\"")
    return requested


def _sliding(config: Any) -> bool:
    """Whether an HF config has sliding-window attention layers (or may: a window is set and
    nothing says it is off)."""
    if config is None:
        return False
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return True
    return bool(getattr(config, "sliding_window", None)) and \
        getattr(config, "use_sliding_window", True) and \
        getattr(config, "layer_types", None) is None


def register_varlen_sdpa() -> str:
    """Register :func:`varlen_sdpa_attention` (and its mask: none) with transformers under
    :data:`VARLEN_SDPA`; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_attention)
    AttentionMaskInterface.register(VARLEN_SDPA, varlen_sdpa_mask)
    return VARLEN_SDPA


def attn_kwargs(requested: str) -> dict[str, str]:
    """``from_pretrained`` keyword for an already resolved kernel (registering ours)."""
    if requested == VARLEN_SDPA:
        register_varlen_sdpa()
    return {"attn_implementation": requested}


def varlen_kwargs(lengths: Tensor) -> dict[str, Any]:
    """The forward's keywords that tell the varlen kernels where a packed row's sequences
    start: flash-attention's ``cu_seq_lens_q/k`` (int32, ``[0, l0, l0 + l1, ...]``, on the
    lengths' device) and ``max_length_q/k``, and the same offsets on the CPU for
    :func:`varlen_sdpa_attention` (``cu_seq_lens_cpu``: read without a device sync per layer)."""
    cpu = lengths.detach().cpu()
    cu = F.pad(torch.cumsum(cpu, 0, dtype=torch.int32), (1, 0))
    longest = int(cpu.max()) if cpu.numel() else 0
    on_device = cu.to(lengths.device)
    return {"cu_seq_lens_q": on_device, "cu_seq_lens_k": on_device, "max_length_q": longest,
            "max_length_k": longest, "cu_seq_lens_cpu": cu}


def varlen_sdpa_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
                     kv_offset: int = 0, attention_mask: Tensor | None = None,
                     **kwargs: Any) -> None:
    """No mask: :func:`varlen_sdpa_attention` is causal within each sequence. Refuses what
    that would get wrong: a KV cache (queries offset into the keys) and left padding."""
    if q_length != kv_length or q_offset or kv_offset:
        raise ValueError(f"{KEY} = \"{VARLEN_SDPA}\" is for training forwards without a KV "
                         "cache (use_cache=False), not for generation")
    if attention_mask is not None and attention_mask.ndim == 2:
        mask = attention_mask.bool()
        # Right padding only: no real token after a pad in any row.
        if bool((mask[:, 1:] & ~mask[:, :-1]).any()):
            raise ValueError(f"{KEY} = \"{VARLEN_SDPA}\" needs right padding; this batch "
                             "has a pad before a real token")
    return None


@torch.compiler.disable
def varlen_sdpa_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                          attention_mask: Tensor | None, dropout: float = 0.0,
                          scaling: float | None = None, sliding_window: int | None = None,
                          cu_seq_lens_cpu: Tensor | None = None, **kwargs: Any
                          ) -> tuple[Tensor, None]:
    """Causal ``sdpa`` of ``query [B, Hq, T, D]`` against ``key, value [B, Hkv, T, D]``, per
    sequence of ``cu_seq_lens_cpu`` when given (one packed row: :func:`varlen_kwargs`; on
    CUDA one flash varlen call over ``cu_seq_lens_q`` where it runs), else per row; the
    output as transformers' kernels return it, ``[B, T, Hq, D]``. Runs outside
    ``torch.compile`` (the per-sequence loop would recompile for every new set of lengths)."""
    if sliding_window is not None:
        raise ValueError(f"{KEY} = \"{VARLEN_SDPA}\" has no sliding window; this model uses "
                         "one: choose \"sdpa\" or \"flash_attention_2\"")
    gqa = query.shape[1] != key.shape[1]

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True,
                                              scale=scaling, enable_gqa=gqa)

    cu_seq_lens = kwargs.get("cu_seq_lens_q")
    if cu_seq_lens_cpu is None or query.shape[0] != 1:
        out = attend(query, key, value)
    elif cu_seq_lens is not None and flash_varlen.usable(query, key, dropout):
        out = flash_varlen.attend(query[0].transpose(0, 1), key[0].transpose(0, 1),
                                  value[0].transpose(0, 1), cu_seq_lens,
                                  int(torch.diff(cu_seq_lens_cpu).max()), scaling)
        return out.unsqueeze(0), None
    else:
        bounds = cu_seq_lens_cpu.tolist()
        out = torch.cat([attend(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e])
                         for s, e in zip(bounds[:-1], bounds[1:]) if e > s], dim=2)
    return out.transpose(1, 2).contiguous(), None


__all__ = ["VARLEN_SDPA", "attn_kwargs", "register_varlen_sdpa", "resolve_attn_implementation",
           "varlen_kwargs", "varlen_sdpa_attention"]
