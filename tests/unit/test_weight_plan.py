"""The weight-update bucket plan: sizes, order, JSON round trip, and a lossless pack → unpack."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from asyncrl.weights.plan import (
    ALIGN,
    BucketBuffers,
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


def _roundtrip(plan: BucketPlan, state: dict[str, torch.Tensor],
               staging: BucketBuffers | None = None) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for index, nbytes in enumerate(plan.bucket_nbytes):
        slot = staging.slot(index) if staging is not None and staging.holds(index) else None
        flat = pack_bucket(plan, index, state, slot).clone()  # what a receiver would hold
        assert flat.dtype == torch.uint8 and flat.numel() == nbytes
        out.update(unpack_bucket(plan, index, flat))
    return out


def _assert_same(out: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> None:
    assert list(out) == list(state)
    for name, tensor in state.items():
        assert out[name].dtype == tensor.dtype and out[name].shape == tensor.shape, name
        assert torch.equal(out[name], tensor), name


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
        assert all(a.offset + a.nbytes <= b.offset for a, b in itertools.pairwise(specs))
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
    _assert_same(_roundtrip(plan, state), state)
    staging = BucketBuffers(plan, torch.device("cpu"), slots=2, skip_lone=True)
    _assert_same(_roundtrip(plan, state, staging), state)


@pytest.mark.parametrize("align", [1, 2, 3, 64])
def test_other_alignments_roundtrip(align: int) -> None:
    """``align=1`` is SGLang's flattened layout: no padding; misaligned tensors are copied."""
    state = _state()
    plan = plan_buckets(state, bucket_bytes=1024, align=align)
    assert all(s.offset % align == 0 for s in plan.tensors)
    if align == 1:
        assert plan.total_bytes == sum(t.numel() * t.element_size() for t in state.values())
    _assert_same(_roundtrip(plan, state), state)


def test_large_tensors_travel_alone_from_their_own_memory() -> None:
    """``alone_bytes``: each tensor of at least that size is a bucket of its own (packed as
    its own bytes, no copy); smaller neighbours still share buckets; the roundtrip holds."""
    state = {"s1": torch.randn(3), "big": torch.randn(64), "s2": torch.randn(2),
             "s3": torch.randn(5), "big2": torch.randn(8, 8)}
    plan = plan_buckets(state, bucket_bytes=1 << 20, alone_bytes=256)
    assert [[s.name for s in plan.in_bucket(i)] for i in range(len(plan.bucket_nbytes))] == \
        [["s1"], ["big"], ["s2", "s3"], ["big2"]]
    packed = pack_bucket(plan, 1, state)
    assert packed.data_ptr() == state["big"].data_ptr()
    _assert_same(_roundtrip(plan, state), state)
    assert plan_buckets(state, 1 << 20, alone_bytes=0).bucket_nbytes == \
        plan_buckets(state, 1 << 20).bucket_nbytes


def test_staging_buffers_are_reused_and_double_buffered() -> None:
    state = _state()
    plan = plan_buckets(state, bucket_bytes=100)
    staging = BucketBuffers(plan, torch.device("cpu"), slots=2, skip_lone=True)
    lone = {i for i in range(len(plan.bucket_nbytes)) if len(plan.in_bucket(i)) == 1}
    shared = [i for i in range(len(plan.bucket_nbytes)) if i not in lone]
    assert lone and len(shared) >= 2
    assert not any(staging.holds(i) for i in lone)
    with pytest.raises(KeyError):
        staging.slot(min(lone))
    assert staging.nbytes <= 2 * max(plan.bucket_nbytes[i] for i in shared)
    first, second = shared[0], shared[1]
    for index in shared:
        slot = staging.slot(index)
        assert slot.numel() == plan.bucket_nbytes[index]
        packed = pack_bucket(plan, index, state, slot)
        assert packed.data_ptr() == slot.data_ptr(), "packed into the staging buffer"
    if first % 2 != second % 2:
        assert staging.slot(first).data_ptr() != staging.slot(second).data_ptr()
    assert staging.fits(plan, torch.device("cpu"))
    assert not staging.fits(plan_buckets(state, bucket_bytes=1 << 20), torch.device("cpu"))


def test_receive_pool_has_a_slot_per_bucket() -> None:
    plan = plan_buckets(_state(), bucket_bytes=100)
    pool = BucketBuffers(plan, torch.device("cpu"), slots=len(plan.bucket_nbytes))
    slots = [pool.slot(i) for i in range(len(plan.bucket_nbytes))]
    assert len({s.data_ptr() for s in slots}) == len(slots)
    assert all(s.storage_offset() % 64 == 0 for s in slots), "every slot starts aligned"
    spans = sorted((s.storage_offset(), s.storage_offset() + s.numel()) for s in slots)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), "slots do not overlap"
    assert plan.total_bytes <= pool.nbytes < plan.total_bytes + 64 * len(slots)


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
    with pytest.raises(ValueError):
        plan_buckets(_state(), 1024, align=0)
