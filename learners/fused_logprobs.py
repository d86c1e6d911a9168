"""Per-token logprobs and entropy from the last hidden states, a chunk of tokens at a time.

The plain path materialises the model's logits for every token, ``[tokens, vocab]``, and an
fp32 copy of them, and its softmax and its backward make more of the same size: at the Qwen2.5
vocabulary (151,936) that is 0.6 MB per token per copy. Here the LM head runs on
``chunk_tokens`` tokens at a time: each chunk's fp32 logits give its logprob of the taken
token, ``log p = z[target] − logsumexp(z)``, and its entropy, ``H = logsumexp(z) − Σ p·z``, and
are freed before the next chunk. Only ``logsumexp`` and ``H`` per token are kept for backward,
which recomputes each chunk's logits (one more LM-head matmul than the plain path) to form

    ∂/∂z = g_logp · (onehot(target) − p)  −  g_H · p · (log p + H)

and from it the gradients of the hidden states and of the head's weight and bias. The entropy
has a true gradient (an entropy bonus can train on it); callers that only report it detach it.

:func:`head_logprobs` runs a whole HF causal LM this way: during one forward the LM head's
``forward`` is swapped for the chunked computation, so the head still runs inside the model's
own forward, under FSDP2's and DeepSpeed's hooks (its weight gathered, its gradient reduced),
and the state-dict names never change. Models whose logits are more than ``lm_head(hidden)``
(a soft cap, a logit scale) or whose head is not a plain ``nn.Linear`` (a LoRA-wrapped head)
are not fused: :func:`fusable` says so and the caller takes the plain path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Config attributes whose presence means the logits are not lm_head(hidden) alone.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling",
                    "output_multiplier_scale")


class ChunkedHeadLogprobs(torch.autograd.Function):
    """``(logprobs [N], entropy [N])`` float32 of ``hidden [N, H] @ weight[V, H].T + bias``,
    ``chunk`` rows at a time; backward recomputes each chunk (module docstring)."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                chunk: int) -> tuple[Tensor, Tensor]:
        n = hidden.shape[0]
        logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy, lse = torch.empty_like(logprobs), torch.empty_like(logprobs)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            logp = F.linear(hidden[s:e], weight, bias).float()
            lse[s:e] = torch.logsumexp(logp, -1)
            logp.sub_(lse[s:e, None])
            logprobs[s:e] = logp.gather(-1, targets[s:e, None]).squeeze(-1)
            entropy[s:e] = -logp.exp().mul_(logp).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.chunk = chunk
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx: Any, g_logp: Tensor | None, g_entropy: Tensor | None
                 ) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if want_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) \
            if want_b else None
        if g_logp is None and g_entropy is None:
            return grad_h, grad_w, grad_b, None, None
        for s in range(0, hidden.shape[0], ctx.chunk):
            e = min(s + ctx.chunk, hidden.shape[0])
            grad = _chunk_logit_grad(F.linear(hidden[s:e], weight, bias).float(), lse[s:e],
                                     entropy[s:e], targets[s:e],
                                     None if g_logp is None else g_logp[s:e],
                                     None if g_entropy is None else g_entropy[s:e])
            low = grad.to(hidden.dtype)
            if grad_h is not None:
                grad_h[s:e] = low @ weight
            if grad_w is not None:
                if low.dtype == torch.float32:
                    grad_w.addmm_(low.T, hidden[s:e])
                else:
                    grad_w += low.T @ hidden[s:e]
            if grad_b is not None:
                grad_b += grad.sum(0)
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None)


def _chunk_logit_grad(logits: Tensor, lse: Tensor, entropy: Tensor, targets: Tensor,
                      g_logp: Tensor | None, g_entropy: Tensor | None) -> Tensor:
    """∂loss/∂z of one chunk, in place in ``logits``' memory where it can be (fp32 [n, V])."""
    logp = logits.sub_(lse[:, None])
    p = logp.exp()
    if g_entropy is not None:   # −g_H · p · (log p + H)
        term = logp.add_(entropy[:, None]).mul_(p).mul_(-g_entropy[:, None])
    if g_logp is None:
        return term
    grad = p.mul_(-g_logp[:, None])   # g · (onehot − p)
    grad.scatter_add_(1, targets[:, None], g_logp[:, None])
    return grad.add_(term) if g_entropy is not None else grad


def chunked_logprobs_entropy(hidden: Tensor, weight: Tensor, bias: Tensor | None,
                             targets: Tensor, chunk_tokens: int) -> tuple[Tensor, Tensor]:
    """Logprob of each target and entropy, both float32 of ``targets``' shape, from
    ``hidden [..., H]`` through the head ``(weight, bias)``; ``chunk_tokens`` rows at a time."""
    shape = targets.shape
    flat = hidden.reshape(-1, hidden.shape[-1])
    logprobs, entropy = ChunkedHeadLogprobs.apply(flat, weight, bias, targets.reshape(-1),
                                                  max(int(chunk_tokens), 1))
    return logprobs.view(shape), entropy.view(shape)


def plain_logprobs_entropy(logits: Tensor, targets: Tensor, entropy_grad: bool = False
                           ) -> tuple[Tensor, Tensor]:
    """The full-logits computation the chunked one replaces (and must equal): float32
    ``z[target] − logsumexp(z)``, and the entropy from ``log_softmax`` (without gradient
    unless ``entropy_grad``)."""
    logits = logits.float()
    logprobs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, -1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        logp = torch.log_softmax(logits, dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
    return logprobs, entropy


def fusable(model: nn.Module) -> bool:
    """Whether :func:`head_logprobs` computes ``model``'s logits exactly: its output
    embeddings are a plain ``nn.Linear`` and its config scales or caps no logits."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    config = getattr(model, "config", None)
    return type(head) is nn.Linear and not any(
        getattr(config, name, None) not in (None, 1.0) for name in LOGIT_TRANSFORMS)


def head_logprobs(model: nn.Module, head: nn.Linear, targets: Tensor, chunk_tokens: int,
                  temperature: float = 1.0, **inputs: Any) -> tuple[Tensor, Tensor]:
    """``model(**inputs)`` with its LM head ``head`` computing :func:`chunked_logprobs_entropy`
    of ``targets`` (shaped like ``input_ids``) instead of the logits. ``head`` is the output
    embedding of a :func:`fusable` model (inside a peft wrapper: ``learners.lora.hf_model``).
    ``temperature``: the logits are ``(hidden @ W.T + b) / T``, taken as ``(hidden / T) @ W.T
    + b / T`` so the chunks never see an unscaled copy."""

    def fused(hidden: Tensor) -> Tensor:
        bias = head.bias
        if temperature != 1.0:
            hidden = hidden / temperature
            bias = None if bias is None else bias / temperature
        logprobs, entropy = chunked_logprobs_entropy(hidden, head.weight, bias, targets,
                                                     chunk_tokens)
        # One tensor back through the model's forward, so hooks on the head's output (ZeRO-3's
        # re-gather for backward) see the computation; [..., 2] costs 8 bytes a token.
        return torch.stack((logprobs, entropy), -1)

    with _forward_replaced(head, fused):
        out = model(**inputs).logits
    return out[..., 0], out[..., 1]


@contextmanager
def _forward_replaced(module: nn.Module, forward: Callable[[Tensor], Tensor]) -> Iterator[None]:
    """``module.forward`` is ``forward`` inside the block (an instance attribute shadows the
    class's method; ``nn.Module.__call__`` and its hooks stay)."""
    module.forward = forward   # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.forward


__all__ = ["ChunkedHeadLogprobs", "chunked_logprobs_entropy", "fusable", "head_logprobs",
           "plain_logprobs_entropy"]
