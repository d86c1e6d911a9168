"""One flash-attention call for a whole packed row on CUDA, with torch's own kernel.

``varlen_sdpa`` (:mod:`learners.attention`) attends a packed row one sequence at a time. On
the first GPU run that loop made packing lose to padding (0.73x at the 0.5B shape, 0.80x at
1.5B, H200, ``bench/RESULTS.md``): some 32 small ``sdpa`` calls per layer and micro-batch.
torch ships FlashAttention-2's varlen kernel as ``aten._flash_attention_forward`` (CUDA,
fp16 or bf16, head dimension up to 256, fewer key/value heads handled natively), with its
backward registered, so no ``flash-attn`` package is needed for it.

Whether it runs in this process (torch's build, the GPU, the op's signature in this torch)
is found out once per device, dtype and head layout: a small forward and backward, checked
against ``sdpa``. Where it does not run, :func:`usable` says no, ``varlen_sdpa`` keeps its
loop, and a warning says why, once.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import Tensor

logger = logging.getLogger(__name__)

DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


def attend(query: Tensor, key: Tensor, value: Tensor, cu_seq_lens: Tensor, longest: int,
           scale: float | None) -> Tensor:
    """Causal attention within each sequence of a packed row: ``query [T, Hq, D]``,
    ``key, value [T, Hkv, D]``, ``cu_seq_lens`` int32 ``[0, l0, l0 + l1, ...]`` on the same
    device, ``longest`` the longest sequence. Returns ``[T, Hq, D]``."""
    out = torch.ops.aten._flash_attention_forward(
        query, key, value, cu_seq_lens, cu_seq_lens, longest, longest, 0.0, True, False,
        scale=scale)
    return out[0]


def usable(query: Tensor, key: Tensor, dropout: float) -> bool:
    """Can :func:`attend` take ``query [B, Hq, T, D]`` and ``key [B, Hkv, T, D]`` here?"""
    head_dim = query.shape[-1]
    if not query.is_cuda or query.dtype not in DTYPES or dropout or head_dim > MAX_HEAD_DIM \
            or head_dim % 8:
        return False
    return works(query.device, query.dtype, head_dim, query.shape[1], key.shape[1])


@functools.cache   # a fact about this process's torch and GPU: probed once per layout
def works(device: torch.device, dtype: torch.dtype, head_dim: int, heads: int,
          kv_heads: int) -> bool:
    """Run :func:`attend` forward and backward on two short sequences and compare it with
    ``sdpa`` one sequence at a time; False (with a warning) if it fails or differs. It runs
    inside the first forward that asks, which may be a no-grad or inference one, or a layer
    under activation checkpointing."""
    lengths = (5, 11)
    bounds = ((0, lengths[0]), (lengths[0], sum(lengths)))
    try:   # its own autograd, also inside a no-grad or inference forward
        with torch.inference_mode(False), torch.enable_grad():
            gen = torch.Generator(device=device).manual_seed(0)

            def rand(n_heads: int) -> Tensor:   # [1, H, T, D], as a model's layer hands it
                return torch.randn(1, n_heads, sum(lengths), head_dim, device=device,
                                   dtype=dtype, generator=gen).requires_grad_()

            q, k, v = rand(heads), rand(kv_heads), rand(kv_heads)
            cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32, device=device)
            got = attend(*(x[0].transpose(0, 1) for x in (q, k, v)), cu, max(lengths), None)
            got.float().sum().backward()
            want = torch.cat([F.scaled_dot_product_attention(
                q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True,
                enable_gqa=heads != kv_heads) for s, e in bounds], dim=2)[0].transpose(0, 1)
            if not torch.allclose(got.float(), want.float(), atol=2e-2, rtol=0):
                raise RuntimeError("its output differs from sdpa's")
            if q.grad is None or not bool(torch.isfinite(q.grad).all()):
                raise RuntimeError("no finite gradient")
    except (RuntimeError, TypeError, AttributeError, NotImplementedError) as exc:
        logger.warning("varlen_sdpa: torch's flash-attention varlen kernel does not run here "
                       "(%s, %s, heads %d/%d of %d): one sdpa call per sequence instead (%s)",
                       device, dtype, heads, kv_heads, head_dim,
                       (str(exc).splitlines() or [type(exc).__name__])[0][:200])
        return False
    logger.info("varlen_sdpa: one flash-attention varlen call per packed row (%s, %s)",
                device, dtype)
    return True
