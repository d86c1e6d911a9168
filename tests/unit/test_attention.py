"""The learner's attention kernels: packed micro-batches through a varlen kernel give the
padded layout's logprobs and gradients; ``auto`` and the refusals name the key."""

from __future__ import annotations

import itertools

import pytest
import torch

from learners import flash_varlen
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


def test_one_flash_call_per_packed_row_has_the_layout_of_the_loop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA in bf16, varlen_sdpa hands the whole packed row to one flash varlen call
    (``[T, H, D]`` and the sequences' offsets). CPU has no such kernel, so a stand-in with
    its contract (sdpa per sequence, computed from the offsets alone) checks the layout the
    layer hands it and takes back: the logprobs and gradients of padded sdpa. The kernel
    itself: the CUDA test below, and the probe before its first use."""
    calls = []

    def attend(q, k, v, cu, longest, scale):
        calls.append((tuple(q.shape), cu.tolist(), longest))
        return _reference_attend(q, k, v, cu, longest, scale)

    monkeypatch.setattr(flash_varlen, "usable", lambda query, key, dropout: True)
    monkeypatch.setattr(flash_varlen, "attend", attend)
    batch, real = _batch(), _batch().attention_mask.bool()
    want, want_grads = _logprobs_and_grads(_model("sdpa"), batch, packing=False)
    got, grads = _logprobs_and_grads(_model(VARLEN_SDPA), batch, packing=True)
    lengths = batch.attention_mask.sum(1).tolist()
    assert calls[0] == ((sum(lengths), 4, 8), [0, *itertools.accumulate(lengths)],
                        max(lengths))   # one call per layer, the whole row
    assert len(calls) == 2
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], atol=1e-5, rtol=1e-4)


def test_the_flash_probe_says_no_once_where_the_kernel_does_not_run(
        caplog: pytest.LogCaptureFixture) -> None:
    """CPU has no flash varlen kernel: the probe answers False with a one-line warning, and
    varlen_sdpa keeps its loop (the tests above)."""
    flash_varlen.works.cache_clear()
    with caplog.at_level("WARNING", logger="learners.flash_varlen"):
        assert not flash_varlen.works(torch.device("cpu"), torch.bfloat16, 16, 4, 2)
        assert not flash_varlen.works(torch.device("cpu"), torch.bfloat16, 16, 4, 2)
    flash_varlen.works.cache_clear()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "one sdpa call per sequence" in warnings[0], warnings
    assert "\n" not in warnings[0]
    query = torch.zeros(1, 4, 8, 16, dtype=torch.bfloat16)
    assert not flash_varlen.usable(query, query[:, :2], 0.0)   # not CUDA: not even probed


def _reference_attend(q, k, v, cu, longest, scale):
    """The flash varlen kernel's contract on CPU: sdpa per sequence of ``[T, H, D]``."""
    bounds = cu.tolist()
    return torch.cat([torch.nn.functional.scaled_dot_product_attention(
        q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1),
        is_causal=True, scale=scale, enable_gqa=True).transpose(0, 1)
        for s, e in zip(bounds[:-1], bounds[1:])])


@pytest.mark.parametrize("context", ["no_grad", "inference_mode", "checkpoint"])
def test_the_probe_runs_inside_whatever_forward_first_asks(
        monkeypatch: pytest.MonkeyPatch, context: str) -> None:
    """The probe runs in the first forward that needs it: a no-grad or inference forward
    (the reference model's), or a layer under activation checkpointing. With a kernel that
    works it says yes in each, and the checkpointed layer's own gradient is untouched."""
    monkeypatch.setattr(flash_varlen, "attend", _reference_attend)
    flash_varlen.works.cache_clear()

    def probe(x: torch.Tensor) -> torch.Tensor:
        assert flash_varlen.works(torch.device("cpu"), torch.float32, 8, 4, 2)
        return x * 2

    x = torch.ones(3, requires_grad=True)
    try:
        if context == "checkpoint":
            torch.utils.checkpoint.checkpoint(probe, x, use_reentrant=False).sum().backward()
            assert x.grad is not None and x.grad.tolist() == [2.0, 2.0, 2.0]
        else:
            with getattr(torch, context)():
                probe(x)
    finally:
        flash_varlen.works.cache_clear()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_packed_bf16_through_torchs_flash_varlen_equals_padded_on_cuda() -> None:
    """What the learner runs on a GPU (bf16 compute): the packed row through one flash
    varlen call gives padded sdpa's logprobs and gradients, to bf16's precision."""
    batch = _batch("cuda")
    real = batch.attention_mask.bool()
    want, want_grads = _logprobs_and_grads(
        _model("sdpa", "cuda", torch.bfloat16, hidden=64), batch, packing=False)
    varlen = _model(VARLEN_SDPA, "cuda", torch.bfloat16, hidden=64)
    assert flash_varlen.works(torch.device("cuda", torch.cuda.current_device()),
                              torch.bfloat16, 16, 4, 2)
    got, grads = _logprobs_and_grads(varlen, batch, packing=True)
    torch.testing.assert_close(got[real].float(), want[real].float(), atol=5e-2, rtol=0)
    for name, grad in grads.items():
        error = (grad.float() - want_grads[name].float()).norm()
        assert error <= 2e-2 * want_grads[name].float().norm() + 1e-6, name


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
