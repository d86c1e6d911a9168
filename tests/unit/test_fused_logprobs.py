"""The chunked LM-head logprobs and entropy equal the full-logits computation, values and
gradients, alone and through a whole HF model (padded and packed)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from learners.batching import collate
from learners.compile_blocks import CompileCounter
from learners.fused_logprobs import (HeadKernels, chunk_bounds, chunked_logprobs_entropy,
                                     fusable, plain_logprobs_entropy)
from learners.packing import token_logprobs_and_entropy
from tests.unit.test_packing import make_groups

torch.set_num_threads(1)

# fp32 on CPU: the chunked sums run in another order than the full ones; measured differences
# are ~1e-6, so 1e-5 (values) and 1e-5 + 1e-4 relative (gradients) state the tolerance.
ATOL = 1e-5


def _inputs(n: int, hidden: int, vocab: int, bias: bool, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g, dtype=dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g, dtype=dtype) / hidden ** 0.5).requires_grad_()
    b = torch.randn(vocab, generator=g, dtype=dtype).requires_grad_() if bias else None
    targets = torch.randint(0, vocab, (n,), generator=g)
    g_lp, g_h = torch.randn(n, generator=g), torch.randn(n, generator=g)
    return h, w, b, targets, g_lp, g_h


def _grads(lp, ent, g_lp, g_h, params, entropy_grad=True):
    loss = (lp * g_lp).sum() + ((ent * g_h).sum() if entropy_grad else 0.0)
    return torch.autograd.grad(loss, [p for p in params if p is not None])


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_equals_plain_values_and_gradients(chunk: int, bias: bool) -> None:
    h, w, b, targets, g_lp, g_h = _inputs(50, 16, 300, bias)
    lp, ent = chunked_logprobs_entropy(h, w, b, targets, chunk)
    ref_lp, ref_ent = plain_logprobs_entropy(nn.functional.linear(h, w, b), targets,
                                             entropy_grad=True)
    torch.testing.assert_close(lp, ref_lp, atol=ATOL, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=ATOL, rtol=0)
    for got, want in zip(_grads(lp, ent, g_lp, g_h, (h, w, b)),
                         _grads(ref_lp, ref_ent, g_lp, g_h, (h, w, b))):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)


def test_logprob_gradient_alone_and_frozen_head() -> None:
    """Only the logprobs differentiated (entropy reported, not trained), and a head without
    gradient (LoRA freezes it): the hidden states' gradient still matches."""
    h, w, b, targets, g_lp, g_h = _inputs(33, 8, 97, False, seed=1)
    w.requires_grad_(False)
    lp, ent = chunked_logprobs_entropy(h, w, None, targets, 10)
    ref_lp, _ = plain_logprobs_entropy(h @ w.T, targets)
    (got,) = _grads(lp, ent, g_lp, g_h, (h,), entropy_grad=False)
    (want,) = _grads(ref_lp, None, g_lp, g_h, (h,), entropy_grad=False)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)


def test_bf16_head_within_bf16_rounding() -> None:
    """bf16 hidden and head (FSDP2 mixed precision on CUDA): the logits are rounded to bf16
    by both paths alike; the fp32 softmax on top agrees to bf16's precision."""
    h, w, b, targets, g_lp, g_h = _inputs(40, 32, 500, True, dtype=torch.bfloat16, seed=2)
    lp, ent = chunked_logprobs_entropy(h, w, b, targets, 16)
    ref_lp, ref_ent = plain_logprobs_entropy(nn.functional.linear(h, w, b), targets, True)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    for got, want in zip(_grads(lp, ent, g_lp, g_h, (h, w, b)),
                         _grads(ref_lp, ref_ent, g_lp, g_h, (h, w, b))):
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def _chunked_and_grads(kernels: HeadKernels, inputs, chunk: int, entropy_grad: bool = True):
    h, w, b, targets, g_lp, g_h = inputs
    lp, ent = chunked_logprobs_entropy(h, w, b, targets, chunk, kernels)
    return lp.detach(), ent.detach(), _grads(lp, ent, g_lp, g_h, (h, w, b), entropy_grad)


@pytest.mark.parametrize("entropy_grad", [True, False])
@pytest.mark.parametrize("bias", [False, True])
def test_compiled_kernels_equal_eager(bias: bool, entropy_grad: bool) -> None:
    """learner.compile's head kernels (their out-of-place spelling, through dynamo and
    aot_eager: the graphs inductor receives) take the eager in-place kernels' values and
    gradients (the same operations in the same order: to 1e-6), whichever of the two outputs
    is differentiated; chunks of 7 of 50 tokens end in a chunk of 8 (:func:`chunk_bounds`)."""
    inputs = _inputs(50, 16, 300, bias, seed=3)
    eager = _chunked_and_grads(HeadKernels(), inputs, 7, entropy_grad)
    compiled = _chunked_and_grads(HeadKernels("aot_eager"), inputs, 7, entropy_grad)
    torch.testing.assert_close(compiled[0], eager[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(compiled[1], eager[1], atol=1e-6, rtol=0)
    for got, want in zip(compiled[2], eager[2]):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_inductor_kernels_match_full_logits_without_recompiling() -> None:
    """inductor itself (its CPU code; on CUDA the gpu test below): the compiled kernels give
    the full-logits values and gradients, and new token counts compile nothing more, one
    past a multiple of the chunk included (dynamo specialises size 1: :func:`chunk_bounds`)."""
    kernels = HeadKernels("inductor")
    counter = CompileCounter()
    for n, seed in ((45, 4), (30, 5), (41, 6)):   # chunks of 8: last chunks of 5, 6 and 1
        h, w, b, targets, g_lp, g_h = inputs = _inputs(n, 16, 300, True, seed=seed)
        lp, ent, grads = _chunked_and_grads(kernels, inputs, 8)
        ref_lp, ref_ent = plain_logprobs_entropy(nn.functional.linear(h, w, b), targets, True)
        torch.testing.assert_close(lp, ref_lp.detach(), atol=ATOL, rtol=0)
        torch.testing.assert_close(ent, ref_ent.detach(), atol=ATOL, rtol=0)
        for got, want in zip(grads, _grads(ref_lp, ref_ent, g_lp, g_h, (h, w, b))):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)
        if n == 45:
            assert counter.take() > 0
    assert counter.take() == 0


def test_chunk_bounds_give_a_last_single_row_to_the_chunk_before() -> None:
    assert chunk_bounds(0, 4) == []
    assert chunk_bounds(1, 4) == [(0, 1)]
    assert chunk_bounds(8, 4) == [(0, 4), (4, 8)]
    assert chunk_bounds(9, 4) == [(0, 4), (4, 9)]
    assert chunk_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_bounds(5, 1) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_inductor_kernels_in_bf16_on_cuda() -> None:
    """The learner's case on a GPU: bf16 logits, fp32 softmax; inductor's Triton kernels
    against the eager chunks, and against the full logits to bf16's precision."""
    inputs = tuple(t.cuda() if t is not None else None
                   for t in _inputs(3000, 64, 5000, False, dtype=torch.bfloat16, seed=6))
    eager = _chunked_and_grads(HeadKernels(), inputs, 1024)
    compiled = _chunked_and_grads(HeadKernels("inductor"), inputs, 1024)
    torch.testing.assert_close(compiled[0], eager[0], atol=1e-4, rtol=0)
    torch.testing.assert_close(compiled[1], eager[1], atol=1e-4, rtol=0)
    for got, want in zip(compiled[2], eager[2]):
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def _tiny_model(tie: bool) -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=tie)
    return Qwen2ForCausalLM(config).eval()


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("tie", [False, True])
def test_model_path_equals_full_logits(packing: bool, tie: bool) -> None:
    """Through a whole HF model: the fused forward (chunks of 5 tokens) gives the full-logits
    path's logprobs, entropy and every parameter's gradient (the entropy trained too)."""
    model = _tiny_model(tie)
    assert fusable(model)
    batch = collate(make_groups([[9, 4, 12], [3, 7]]), std_norm=True, pad_id=0)
    mask = batch.loss_mask

    def run(chunk: int):
        model.zero_grad()
        lp, ent = token_logprobs_and_entropy(model, batch, packing, chunk_tokens=chunk,
                                             entropy_grad=True)
        ((lp * mask).sum() + 0.1 * (ent * mask).sum()).backward()
        return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in
                                           model.named_parameters()}

    lp, ent, grads = run(5)
    ref_lp, ref_ent, ref_grads = run(0)
    real = batch.attention_mask.bool()
    torch.testing.assert_close(lp[real], ref_lp[real], atol=ATOL, rtol=0)
    torch.testing.assert_close(ent[real], ref_ent[real], atol=ATOL, rtol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], atol=ATOL, rtol=1e-4)
    # The head's forward is the model's own again afterwards.
    assert "forward" not in vars(model.get_output_embeddings())


@pytest.mark.parametrize("chunk", [5, 0])
@pytest.mark.parametrize("packing", [False, True])
def test_positions_skip_untrained_tokens(packing: bool, chunk: int) -> None:
    """``positions`` (the learner passes its loss mask): the logprobs and entropy there, and
    every gradient of a loss on them, are those of the whole forward; elsewhere both are 0.
    The fused head (chunks of 5) runs on those tokens alone; the plain one (0) zeroes the
    rest."""
    model = _tiny_model(True)
    batch = collate(make_groups([[9, 4, 12], [3, 7]]), std_norm=True, pad_id=0)
    mask = batch.loss_mask
    on = mask != 0
    assert 0 < int(on.sum()) < int(batch.attention_mask.sum())   # prompts are left out

    def run(positions):
        model.zero_grad()
        lp, ent = token_logprobs_and_entropy(model, batch, packing, chunk_tokens=chunk,
                                             entropy_grad=True, positions=positions)
        ((lp * mask).sum() + 0.1 * (ent * mask).sum()).backward()
        return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in
                                           model.named_parameters()}

    lp, ent, grads = run(on)
    ref_lp, ref_ent, ref_grads = run(None)
    torch.testing.assert_close(lp[on], ref_lp[on], atol=ATOL, rtol=0)
    torch.testing.assert_close(ent[on], ref_ent[on], atol=ATOL, rtol=0)
    assert not lp[~on].any() and not ent[~on].any()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], atol=ATOL, rtol=1e-4)


def test_no_positions_still_gives_every_parameter_a_gradient() -> None:
    """A micro-batch with nothing to train (the zero-weight one that evens out ranks' counts):
    the head runs on no token, yet every parameter gets a (zero) gradient, so FSDP2 reduces
    the same parameters on every rank."""
    model = _tiny_model(False)
    batch = collate(make_groups([[6, 5]]), std_norm=True, pad_id=0)
    lp, ent = token_logprobs_and_entropy(model, batch, chunk_tokens=4, entropy_grad=True,
                                         positions=torch.zeros_like(batch.loss_mask, dtype=bool))
    (lp.sum() + ent.sum()).backward()
    assert not lp.any() and not ent.any()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and not parameter.grad.any(), name


def test_entropy_detached_by_default() -> None:
    model = _tiny_model(False)
    batch = collate(make_groups([[6, 5]]), std_norm=True, pad_id=0)
    lp, ent = token_logprobs_and_entropy(model, batch, chunk_tokens=4)
    assert lp.requires_grad and not ent.requires_grad


def test_scaled_logits_are_not_fused() -> None:
    """A model whose logits are more than lm_head(hidden) takes the plain path."""
    model = _tiny_model(False)
    model.config.final_logit_softcapping = 30.0
    assert not fusable(model)
