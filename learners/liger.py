"""``learner.liger``: Liger's Triton kernels for RMSNorm, SwiGLU and RoPE in the learner's
models (the ``liger-kernel`` package: the ``gpu`` extra).

The LM head and its logprobs are not Liger's: :mod:`learners.fused_logprobs` already computes
them in chunks, with the entropy, for any loss (Liger's fused linear cross-entropy returns a
loss, not the per-token logprobs that the RL losses need). The kernels replace modules'
forwards in place (names, parameters and state dicts unchanged), before sharding.
"""

from __future__ import annotations

import importlib.util
import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)


def check_liger(device: torch.device) -> None:
    """Refuse ``learner.liger = true`` where it cannot run: without ``liger-kernel``, or off
    CUDA (its kernels are Triton GPU kernels)."""
    if importlib.util.find_spec("liger_kernel") is None:
        raise ValueError("learner.liger = true needs the liger-kernel package, which is not "
                         "installed (pip install 'asyncrl[gpu]', or liger-kernel itself); "
                         "or set learner.liger = false")
    if device.type != "cuda":
        raise ValueError(f"learner.liger = true needs a CUDA learner (Liger's kernels are "
                         f"Triton GPU kernels); this one runs on {device.type}")


def apply_liger(model: nn.Module) -> None:
    """Liger's RMSNorm, SwiGLU and RoPE on ``model`` (an HF causal LM or its decoder) in place;
    a model type Liger does not know is left as it is, and logged."""
    from liger_kernel.transformers.monkey_patch import (MODEL_TYPE_TO_APPLY_LIGER_FN,
                                                        _apply_liger_kernel_to_instance)

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        logger.warning("learner.liger: Liger has no kernels for model type %r; left as is",
                       model_type)
        return
    _apply_liger_kernel_to_instance(model=model, rope=True, rms_norm=True, swiglu=True,
                                    cross_entropy=False, fused_linear_cross_entropy=False)
    logger.info("learner.liger: RMSNorm, SwiGLU and RoPE kernels on %s", type(model).__name__)


__all__ = ["apply_liger", "check_liger"]
