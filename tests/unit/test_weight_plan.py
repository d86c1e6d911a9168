"""The weight-update bucket plan: sizes, order, JSON round trip, and a lossless pack → unpack."""

from __future__ import annotations

import json

import pytest
import torch

from learners.weights_plan import (
    ALIGN,
    BucketPlan,
    dtype_name,
    pack_bucket,
    parse_dtype,
    plan_buckets,
    unpack_bucket,
)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(16, 8, generator=g),                  # 512 B
        "norm.weight": torch.randn(8, generator=g).to(torch.bfloat16),    # 16 B
        "odd.bias": torch.randn(3, generator=g),                          # 12 B (unaligned)
        "big.weight": torch.randn(64, 64, generator=g),                   # 16 KiB > bucket
        "steps": torch.tensor(7, dtype=torch.int64),                      # 0-dim
        "empty": torch.empty(0, 4),
        "mask": torch.tensor([True, False, True]),
        "half.weight": torch.randn(5, 3, generator=g).to(torch.float16),
    }


def _roundtrip(plan: BucketPlan, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for index, nbytes in enumerate(plan.bucket_nbytes):
        flat = pack_bucket(plan, index, state).clone()  # what a receiver would hold
        assert flat.dtype == torch.uint8 and flat.numel() == nbytes
        out.update(unpack_bucket(plan, index, flat))
    return out


def test_plan_keeps_order_and_bucket_limit() -> None:
    state = _state()
    plan = plan_buckets(state, bucket_bytes=1024)
    assert [s.name for s in plan.tensors] == list(state)
    for index, nbytes in enumerate(plan.bucket_nbytes):
        specs = plan.in_bucket(index)
        assert specs, "no empty buckets"
        assert nbytes <= 1024 or len(specs) == 1, "only a lone tensor may exceed a bucket"
        assert all(s.offset % ALIGN == 0 for s in specs)
        ends = [s.offset + s.nbytes for s in specs]
        assert max(ends) == nbytes
        assert all(a.offset + a.nbytes <= b.offset for a, b in zip(specs, specs[1:]))
    big = next(s for s in plan.tensors if s.name == "big.weight")
    assert plan.in_bucket(big.bucket) == [big]
    assert plan.total_bytes >= sum(t.numel() * t.element_size() for t in state.values())


def test_one_huge_bucket_holds_everything() -> None:
    plan = plan_buckets(_state(), bucket_bytes=1 << 30)
    assert len(plan.bucket_nbytes) == 1


@pytest.mark.parametrize("bucket_bytes", [1, 100, 1024, 1 << 20])
def test_pack_unpack_is_exact(bucket_bytes: int) -> None:
    state = _state()
    plan = plan_buckets(state, bucket_bytes)
    out = _roundtrip(plan, state)
    assert list(out) == list(state)
    for name, tensor in state.items():
        assert out[name].dtype == tensor.dtype and out[name].shape == tensor.shape, name
        assert torch.equal(out[name], tensor), name


def test_non_contiguous_tensors_pack_by_value() -> None:
    state = {"t": torch.arange(12.0).reshape(3, 4).t(), "u": torch.arange(4.0)[::2]}
    plan = plan_buckets(state, bucket_bytes=8)
    out = _roundtrip(plan, state)
    assert torch.equal(out["t"], state["t"]) and torch.equal(out["u"], state["u"])


def test_lone_contiguous_tensor_is_sent_without_copy() -> None:
    state = {"w": torch.randn(32, 32)}
    plan = plan_buckets(state, bucket_bytes=16)
    assert pack_bucket(plan, 0, state).data_ptr() == state["w"].data_ptr()


def test_json_roundtrip() -> None:
    plan = plan_buckets(_state(), bucket_bytes=256)
    manifest, buckets = plan.to_json()
    manifest, buckets = json.loads(json.dumps([manifest, buckets]))
    assert BucketPlan.from_json(manifest, buckets) == plan
    assert sum(b["count"] for b in buckets) == len(plan.tensors)


def test_dtype_names() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
        assert parse_dtype(dtype_name(dtype)) is dtype
    with pytest.raises(ValueError):
        parse_dtype("Tensor")
    with pytest.raises(ValueError):
        plan_buckets(_state(), 0)
