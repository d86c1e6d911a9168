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


def chunk_stats(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One chunk's ``(logprob of the target, entropy, logsumexp)``, float32 ``[n]``, from its
    logits ``[n, V]`` of any float dtype. In place on the fp32 copy: eager holds one
    ``[n, V]`` fp32 tensor and the ``exp`` beside it."""
    logp = logits.float()
    lse = torch.logsumexp(logp, -1)
    logp.sub_(lse[:, None])
    logprob = logp.gather(-1, targets[:, None]).squeeze(-1)
    return logprob, -logp.exp().mul_(logp).sum(-1), lse


def chunk_logit_grad(logits: Tensor, lse: Tensor, entropy: Tensor, targets: Tensor,
                     g_logp: Tensor | None, g_entropy: Tensor | None) -> Tensor:
    """∂loss/∂z of one chunk in ``logits``' dtype, from its recomputed logits (in place on the
    fp32 copy where it can be):

        ∂/∂z = g_logp · (onehot(target) − p)  −  g_H · p · (log p + H)
    """
    logp = logits.float().sub_(lse[:, None])
    p = logp.exp()
    if g_entropy is not None:   # −g_H · p · (log p + H)
        term = logp.add_(entropy[:, None]).mul_(p).mul_(-g_entropy[:, None])
    if g_logp is None:
        return term.to(logits.dtype)
    grad = p.mul_(-g_logp[:, None])   # g · (onehot − p)
    grad.scatter_add_(1, targets[:, None], g_logp[:, None])
    if g_entropy is not None:
        grad.add_(term)
    return grad.to(logits.dtype)


def fusable_chunk_stats(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`chunk_stats` written for a compiler: the same operations in the same order,
    none in place (an in-place op on an input costs a compiled graph one more ``[n, V]``
    fp32 buffer)."""
    logp = logits.float()
    lse = torch.logsumexp(logp, -1)
    logp = logp - lse[:, None]
    return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1), lse


def fusable_chunk_logit_grad(logits: Tensor, lse: Tensor, entropy: Tensor, targets: Tensor,
                             g_logp: Tensor | None, g_entropy: Tensor | None) -> Tensor:
    """:func:`chunk_logit_grad` written for a compiler: the same operations in the same
    order, none in place, and the target's term added where a column index equals it rather
    than scattered, so inductor makes it one elementwise kernel from the bf16 logits to the
    bf16 gradient."""
    logp = logits.float() - lse[:, None]
    p = logp.exp()
    grad = None
    if g_logp is not None:   # g · (onehot − p)
        onehot = torch.arange(p.shape[1], device=p.device)[None, :] == targets[:, None]
        grad = p * -g_logp[:, None] + torch.where(onehot, g_logp[:, None], 0.0)
    if g_entropy is not None:   # −g_H · p · (log p + H)
        term = (logp + entropy[:, None]) * p * -g_entropy[:, None]
        grad = term if grad is None else grad + term
    assert grad is not None, "the caller passes at least one gradient"
    return grad.to(logits.dtype)


def chunk_bounds(n: int, chunk: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` covering ``range(n)`` ``chunk`` rows at a time, except that a
    last chunk of a single row joins the one before it (:class:`HeadKernels`: a size-1 chunk
    would compile the head's kernels once more), unless every chunk is one row."""
    bounds = [(s, min(s + chunk, n)) for s in range(0, n, chunk)]
    if chunk > 1 and len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        bounds[-2:] = [(bounds[-2][0], n)]
    return bounds


class HeadKernels:
    """The per-chunk arithmetic after the LM head's matmul (:func:`chunk_stats`,
    :func:`chunk_logit_grad`), eager or compiled.

    Eager, each is ~10 passes over a ``[chunk, vocab]`` fp32 tensor (the cast, ``logsumexp``,
    the subtraction, ``exp``, the products and sums). On a GPU these are memory traffic: at
    1024 tokens and Qwen2.5's vocabulary a pass moves 0.6 GB, and by the bandwidth the ten
    take about twice as long as the chunk's matmul at the 1.5B width (an estimate;
    ``bench/gpu_check.sh``'s ``logprob_head`` step measures it). Compiled
    (``learner.compile``), inductor fuses each into reductions that read the chunk's bf16
    logits once or twice, and writes the gradient in bf16 directly. Shapes are dynamic: a
    shorter last chunk does not recompile. dynamo specialises sizes 0 and 1, so a last chunk of
    one token would compile once more: :func:`chunk_bounds` gives that token to the chunk
    before it.

    Two spellings of the same operations in the same order, each the lighter for its
    runner: eager works in place, the compiled one out of place. Measured on a CPU in fp32
    (``bench/learner_memory.py``'s child, 512 tokens in chunks of 256): eager in place 444
    MiB of activations, eager out of place 1,076; compiled out of place 443, compiled in
    place 743 (an input mutated in place costs the graph a buffer). The tests hold the two
    equal."""

    def __init__(self, compile_backend: str | None = None) -> None:
        self.stats: Callable[..., tuple[Tensor, Tensor, Tensor]] = chunk_stats
        self.logit_grad: Callable[..., Tensor] = chunk_logit_grad
        if compile_backend is not None:
            self.stats = torch.compile(fusable_chunk_stats, backend=compile_backend,
                                       dynamic=True)
            self.logit_grad = torch.compile(fusable_chunk_logit_grad,
                                            backend=compile_backend, dynamic=True)


class ChunkedHeadLogprobs(torch.autograd.Function):
    """``(logprobs [N], entropy [N])`` float32 of ``hidden [N, H] @ weight[V, H].T + bias``,
    ``chunk`` rows at a time; backward recomputes each chunk (module docstring). ``kernels``:
    the per-chunk arithmetic (:class:`HeadKernels`)."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                chunk: int, kernels: HeadKernels) -> tuple[Tensor, Tensor]:
        n = hidden.shape[0]
        logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy, lse = torch.empty_like(logprobs), torch.empty_like(logprobs)
        for s, e in chunk_bounds(n, chunk):
            logprobs[s:e], entropy[s:e], lse[s:e] = kernels.stats(
                F.linear(hidden[s:e], weight, bias), targets[s:e])
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.chunk, ctx.kernels = chunk, kernels
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
            return grad_h, grad_w, grad_b, None, None, None
        for s, e in chunk_bounds(hidden.shape[0], ctx.chunk):
            low = ctx.kernels.logit_grad(F.linear(hidden[s:e], weight, bias), lse[s:e],
                                         entropy[s:e], targets[s:e],
                                         None if g_logp is None else g_logp[s:e],
                                         None if g_entropy is None else g_entropy[s:e])
            if grad_h is not None:
                grad_h[s:e] = low @ weight
            if grad_w is not None:
                if low.dtype == torch.float32:
                    grad_w.addmm_(low.T, hidden[s:e])
                else:
                    grad_w += low.T @ hidden[s:e]
            if grad_b is not None:
                grad_b += low.sum(0, dtype=torch.float32)
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None)


def chunked_logprobs_entropy(hidden: Tensor, weight: Tensor, bias: Tensor | None,
                             targets: Tensor, chunk_tokens: int,
                             kernels: HeadKernels | None = None) -> tuple[Tensor, Tensor]:
    """Logprob of each target and entropy, both float32 of ``targets``' shape, from
    ``hidden [..., H]`` through the head ``(weight, bias)``; ``chunk_tokens`` rows at a time,
    by ``kernels`` (default: eager)."""
    shape = targets.shape
    flat = hidden.reshape(-1, hidden.shape[-1])
    logprobs, entropy = ChunkedHeadLogprobs.apply(flat, weight, bias, targets.reshape(-1),
                                                  max(int(chunk_tokens), 1),
                                                  kernels or HeadKernels())
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
                  temperature: float = 1.0, kernels: HeadKernels | None = None,
                  where: Tensor | None = None, **inputs: Any) -> tuple[Tensor, Tensor]:
    """``model(**inputs)`` with its LM head ``head`` computing :func:`chunked_logprobs_entropy`
    of ``targets`` (shaped like ``input_ids``) instead of the logits. ``head`` is the output
    embedding of a :func:`fusable` model (inside a peft wrapper: ``learners.lora.hf_model``).
    ``temperature``: the logits are ``(hidden @ W.T + b) / T``, taken as ``(hidden / T) @ W.T
    + b / T`` so the chunks never see an unscaled copy. ``kernels``: :class:`HeadKernels`
    (default: eager). ``where`` (bool, shaped like ``targets``): the head runs on those tokens
    alone, and the others' logprob and entropy are 0. Finding them costs one device sync."""
    index = None if where is None else where.reshape(-1).nonzero().squeeze(1)

    def fused(hidden: Tensor) -> Tensor:
        bias = head.bias
        flat, wanted = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
        if index is not None:
            flat, wanted = flat.index_select(0, index), wanted.index_select(0, index)
        if temperature != 1.0:
            flat = flat / temperature
            bias = None if bias is None else bias / temperature
        logprobs, entropy = chunked_logprobs_entropy(flat, head.weight, bias, wanted,
                                                     chunk_tokens, kernels)
        # One tensor back through the model's forward, so hooks on the head's output (ZeRO-3's
        # re-gather for backward) see the computation; [..., 2] costs 8 bytes a token.
        # A new tensor, not a view: FSDP2 warns that an in-place op on a view output would
        # skip its pre-backward hook.
        if index is None:
            return torch.stack((logprobs.view(targets.shape), entropy.view(targets.shape)), -1)
        return logprobs.new_zeros(*targets.shape, 2).index_put(
            torch.unravel_index(index, targets.shape), torch.stack((logprobs, entropy), -1))

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


__all__ = ["ChunkedHeadLogprobs", "HeadKernels", "chunk_bounds", "chunk_logit_grad",
           "chunk_stats", "chunked_logprobs_entropy", "fusable", "fusable_chunk_logit_grad",
           "fusable_chunk_stats", "head_logprobs", "plain_logprobs_entropy"]
