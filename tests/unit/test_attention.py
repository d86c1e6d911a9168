"""The learner's attention kernels: packed micro-batches through a varlen kernel give the
padded layout's logprobs and gradients; ``auto`` and the refusals name the key."""

from __future__ import annotations

import pytest
import torch

from learners.attention import VARLEN_SDPA, attn_kwargs, resolve_attn_implementation
from learners.batching import collate
from learners.packing import token_logprobs
from tests.unit.test_packing import VOCAB, make_groups

torch.set_num_threads(1)
CUDA = torch.cuda.is_available()


def _config(attn: str, hidden: int = 32):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=64, **attn_kwargs(attn))


def _model(attn: str, device: str = "cpu", dtype=torch.float32, hidden: int = 32):
    """hidden 32: heads of 8; 64 (heads of 16) for flex_attention's CUDA kernel."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    config = _config(attn, hidden)
    return Qwen2ForCausalLM(config).eval().to(device, dtype)


def _logprobs_and_grads(model, batch, packing: bool):
    model.zero_grad()
    logprobs = token_logprobs(model, batch, packing=packing)
    (logprobs * batch.loss_mask).sum().backward()
    return logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _batch(device: str = "cpu"):
    return collate(make_groups([[9, 4, 12], [3, 7], [5]]), std_norm=True, pad_id=0).to(device)


def test_varlen_sdpa_packed_equals_padded_sdpa() -> None:
    """Packed through varlen_sdpa = padded through transformers' own sdpa (mask and all):
    logprobs and every gradient; padded through varlen_sdpa (no mask: right padding) too."""
    batch, real = _batch(), _batch().attention_mask.bool()
    want, want_grads = _logprobs_and_grads(_model("sdpa"), batch, packing=False)
    varlen = _model(VARLEN_SDPA)
    for packing in (True, False):
        got, grads = _logprobs_and_grads(varlen, batch, packing)
        torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=0)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, want_grads[name], atol=1e-5, rtol=1e-4)


def test_flex_attention_packed_equals_padded_forward_on_cpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """flex_attention's block mask of the packed row gives the padded logprobs (of sdpa, the
    same weights). On CPU torch has no flex backward, so only the forward here (the
    gradients: the CUDA test below). Eager flex: the block mask is what is under test, and
    transformers' compiled flex cost 30 s warm, 3 min cold on 2 cores; eager takes seconds."""
    def eager(model=None, **_):   # torch.compile(fn) and torch.compile(**options)(fn)
        return model if model is not None else (lambda fn: fn)

    monkeypatch.setattr(torch, "compile", eager)
    batch, real = _batch(), _batch().attention_mask.bool()
    with torch.no_grad():
        padded = token_logprobs(_model("sdpa"), batch, packing=False)
        packed = token_logprobs(_model("flex_attention"), batch, packing=True)
    torch.testing.assert_close(packed[real], padded[real], atol=1e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("attn", ["flex_attention", VARLEN_SDPA])
def test_packed_equals_padded_with_gradients_on_cuda(attn: str) -> None:
    batch = _batch("cuda")
    real = batch.attention_mask.bool()
    want, want_grads = _logprobs_and_grads(_model("sdpa", "cuda", hidden=64), batch,
                                           packing=False)
    got, grads = _logprobs_and_grads(_model(attn, "cuda", hidden=64), batch, packing=True)
    torch.testing.assert_close(got[real], want[real], atol=1e-4, rtol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], atol=1e-4, rtol=1e-3)


def test_auto_and_refusals_name_the_key() -> None:
    assert resolve_attn_implementation("auto", torch.device("cpu")) == VARLEN_SDPA
    assert resolve_attn_implementation("eager", torch.device("cpu")) == "eager"
    with pytest.raises(ValueError, match="model.attn_implementation.*backward on CPU"):
        resolve_attn_implementation("flex_attention", torch.device("cpu"))
    with pytest.raises(ValueError, match="model.attn_implementation.*flash-attn"):
        resolve_attn_implementation("flash_attention_2", torch.device("cpu"))
    cuda = torch.device("cuda")   # resolving touches no GPU
    with pytest.raises(ValueError, match="model.attn_implementation.*at least 16.*is 8"):
        resolve_attn_implementation("flex_attention", cuda, _config("sdpa"))
    assert resolve_attn_implementation("flex_attention", cuda, _config("sdpa", 64)) == \
        "flex_attention"


def test_varlen_sdpa_refuses_a_kv_cache_and_left_padding() -> None:
    model = _model(VARLEN_SDPA)
    ids = torch.tensor([[1, 2, 3, 4]])
    with pytest.raises(ValueError, match="KV cache"):
        model.generate(ids, max_new_tokens=2, do_sample=False)
    with pytest.raises(ValueError, match="right padding"):
        model(input_ids=ids, attention_mask=torch.tensor([[0, 1, 1, 1]]), use_cache=False)
