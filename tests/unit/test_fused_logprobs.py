"""The chunked LM-head logprobs and entropy equal the full-logits computation, values and
gradients, alone and through a whole HF model (padded and packed)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from learners.batching import collate
from learners.fused_logprobs import chunked_logprobs_entropy, fusable, plain_logprobs_entropy
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
