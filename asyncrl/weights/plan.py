"""The bucket plan of a weight update: which bytes of which tensor travel in which bucket.

Pure and device-agnostic (no process groups here), so the format can be tested alone and reused
unchanged when the transport becomes NCCL or when several learner ranks each serve a slice of
the engines: a plan is a function of names, shapes and dtypes only.

Buckets are packed as raw bytes (one flat ``uint8`` tensor per bucket), not one dtype per bucket:
a model that mixes dtypes (bf16 weights, fp32 norms) then still fills its buckets, every bucket
is a single collective whatever it holds, and NCCL and gloo both broadcast ``uint8``. Each
tensor starts at an offset aligned to :data:`ALIGN` bytes so the receiver can view its bytes as
the original dtype without copying; a plan may ask for another alignment (SGLang's flattened
buckets need ``align=1``: no padding), and :func:`unpack_bucket` copies a tensor that lands
misaligned for its dtype. A tensor larger than a bucket travels alone in its own
bucket. Names keep the state-dict order; tied weights (two names, one tensor) travel twice,
because after an FSDP gather they are separate tensors anyway and each name must be loadable.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

ALIGN = 16  # bytes; covers every torch dtype's element size (complex128 is the widest)
SLOT_ALIGN = 64  # bytes; where each reusable bucket buffer starts inside its shared storage


@dataclass(frozen=True)
class TensorSpec:
    """Where one named tensor lives: its bucket and byte range inside it."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # "float32", "bfloat16", ... (torch attribute name)
    bucket: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class BucketPlan:
    """Every tensor of an update, in state-dict order, and the byte size of every bucket."""

    tensors: tuple[TensorSpec, ...]
    bucket_nbytes: tuple[int, ...]

    @property
    def total_bytes(self) -> int:
        return sum(self.bucket_nbytes)

    def in_bucket(self, index: int) -> list[TensorSpec]:
        return [spec for spec in self.tensors if spec.bucket == index]

    def to_json(self) -> tuple[list[dict[str, Any]], list[dict[str, int]]]:
        """``(manifest, buckets)`` as JSON-able lists, the form an announcement carries."""
        manifest = [{"name": s.name, "shape": list(s.shape), "dtype": s.dtype,
                     "bucket": s.bucket, "offset": s.offset, "nbytes": s.nbytes}
                    for s in self.tensors]
        counts = [0] * len(self.bucket_nbytes)
        for spec in self.tensors:
            counts[spec.bucket] += 1
        buckets = [{"nbytes": n, "count": c} for n, c in zip(self.bucket_nbytes, counts)]
        return manifest, buckets

    @classmethod
    def from_json(cls, manifest: list[dict[str, Any]],
                  buckets: list[dict[str, Any]]) -> BucketPlan:
        tensors = tuple(TensorSpec(name=m["name"], shape=tuple(m["shape"]), dtype=m["dtype"],
                                   bucket=m["bucket"], offset=m["offset"], nbytes=m["nbytes"])
                        for m in manifest)
        return cls(tensors=tensors, bucket_nbytes=tuple(int(b["nbytes"]) for b in buckets))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _aligned(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


def plan_buckets(state: Mapping[str, torch.Tensor], bucket_bytes: int,
                 align: int = ALIGN, alone_bytes: int = 0) -> BucketPlan:
    """Greedy plan in state-dict order: open a new bucket when the next tensor would overflow.
    Tensors start at multiples of ``align`` bytes inside their bucket, and never misaligned
    for their own dtype: with an ``align`` below a tensor's element size (SGLang's 1), a
    tensor the bytes before it would misalign (fp32 after a bf16 tensor of odd size) opens
    a new bucket, since SGLang refuses to view it in place ("Unaligned received tensor").

    ``alone_bytes`` > 0: a tensor of at least that many bytes gets a bucket of its own, so the
    sender broadcasts the tensor's own memory instead of first copying it into a staging
    buffer (:func:`pack_bucket`); only the small tensors are packed. One copy of the model
    fewer on the sender, for one collective per large tensor."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    if align <= 0:
        raise ValueError(f"align must be positive, got {align}")
    specs: list[TensorSpec] = []
    sizes: list[int] = []
    closed = False  # the last bucket holds a tensor travelling alone: nothing joins it
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        alone = 0 < alone_bytes <= nbytes
        offset = _aligned(sizes[-1], align) if sizes else 0
        if not sizes or closed or (alone and sizes[-1] > 0) \
                or (offset + nbytes > bucket_bytes and sizes[-1] > 0) \
                or offset % tensor.element_size():
            sizes.append(0)
            offset = 0
        closed = alone
        specs.append(TensorSpec(name, tuple(tensor.shape), dtype_name(tensor.dtype),
                                len(sizes) - 1, offset, nbytes))
        sizes[-1] = offset + nbytes
    return BucketPlan(tensors=tuple(specs), bucket_nbytes=tuple(sizes))


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def pack_bucket(plan: BucketPlan, index: int, state: Mapping[str, torch.Tensor],
                out: torch.Tensor | None = None) -> torch.Tensor:
    """The bucket's bytes as one flat ``uint8`` tensor on the tensors' device.

    A bucket holding one contiguous tensor is that tensor's own bytes (no copy): the sender
    only reads it. Otherwise the bytes are copied into ``out`` (a reusable staging buffer of
    at least the bucket's size; the result is its prefix) or, without one, a fresh tensor,
    which costs a first-touch page fault per page on every update.
    """
    specs = plan.in_bucket(index)
    first = state[specs[0].name]
    if len(specs) == 1 and first.is_contiguous():
        return _as_bytes(first)
    nbytes = plan.bucket_nbytes[index]
    if out is None:
        flat = torch.empty(nbytes, dtype=torch.uint8, device=first.device)
    else:
        flat = out[:nbytes]
    for spec in specs:
        flat[spec.offset:spec.offset + spec.nbytes].copy_(_as_bytes(state[spec.name]))
    return flat


def unpack_bucket(plan: BucketPlan, index: int, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Named tensors viewing ``flat`` (no copy): valid only while ``flat`` is not reused.
    A tensor whose offset is misaligned for its dtype (an ``align`` smaller than its element
    size) cannot be a view, and is copied."""
    out: dict[str, torch.Tensor] = {}
    for spec in plan.in_bucket(index):
        raw = flat[spec.offset:spec.offset + spec.nbytes]
        dtype = parse_dtype(spec.dtype)
        if raw.storage_offset() % _element_size(dtype):
            raw = raw.clone()
        out[spec.name] = raw.view(dtype).view(spec.shape)
    return out


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


class BucketBuffers:
    """Reusable flat ``uint8`` buffers for the buckets of one plan, ``slots`` of them.

    Why: a fresh buffer per bucket and update is served by glibc from a fresh ``mmap``, so
    every byte costs a first-touch page fault (a 512 MB pack ran ~10x slower than into reused
    memory). Bucket ``i`` uses slot ``i % slots``; the caller must make sure the previous user
    of a slot is done with it (the broadcaster double-buffers: 2 slots, at most 2 buckets in
    flight; a receiver uses one slot per bucket). Built for one plan and device: :meth:`fits`
    says whether it can serve another, so the owner rebuilds it when the plan changes.
    """

    def __init__(self, plan: BucketPlan, device: torch.device, slots: int,
                 skip_lone: bool = False) -> None:
        self.plan = plan
        self.device = torch.device(device)
        self.skips_lone = skip_lone
        self._skip = ({i for i in range(len(plan.bucket_nbytes)) if len(plan.in_bucket(i)) == 1}
                      if skip_lone else set())
        self.slots = max(1, min(slots, len(plan.bucket_nbytes)))
        sizes = [max((n for i, n in enumerate(plan.bucket_nbytes)
                      if i % self.slots == slot and i not in self._skip), default=0)
                 for slot in range(self.slots)]
        starts, end = [], 0
        for size in sizes:  # one allocation, each slot aligned: unpacked views need it
            starts.append(_aligned(end, SLOT_ALIGN))
            end = starts[-1] + size
        storage = torch.empty(end, dtype=torch.uint8, device=self.device)
        self._slots = [storage[s:s + n] for s, n in zip(starts, sizes)]
        self.nbytes = storage.numel()

    def fits(self, plan: BucketPlan, device: torch.device) -> bool:
        return self.plan == plan and self.device == torch.device(device)

    def holds(self, index: int) -> bool:
        """False for a lone-tensor bucket when built with ``skip_lone``: no buffer is kept for
        it (the sender sends that tensor's own bytes)."""
        return index not in self._skip

    def slot(self, index: int) -> torch.Tensor:
        """The buffer for bucket ``index``, exactly the bucket's size."""
        if index in self._skip:
            raise KeyError(f"bucket {index} holds one tensor and has no staging buffer")
        return self._slots[index % self.slots][:self.plan.bucket_nbytes[index]]


def staging_fits(current: BucketBuffers | None, plan: BucketPlan,
                 state: Mapping[str, torch.Tensor], device: torch.device) -> bool:
    """Can a sender's ``current`` staging serve this update (see :func:`new_staging`)?"""
    return current is not None and current.fits(plan, device) \
        and current.skips_lone == _on(state, device)


def new_staging(plan: BucketPlan, state: Mapping[str, torch.Tensor],
                device: torch.device) -> BucketBuffers:
    """A sender's two staging slots on the transport's ``device``. A bucket of one tensor goes
    out from the tensor's own memory when it is on ``device`` (no slot kept for it); state
    held elsewhere (host memory, a CUDA transport) goes through the slots."""
    return BucketBuffers(plan, device, slots=2, skip_lone=_on(state, device))


def _on(state: Mapping[str, torch.Tensor], device: torch.device) -> bool:
    return next(iter(state.values())).device == torch.device(device)


def stage(plan: BucketPlan, index: int, state: Mapping[str, torch.Tensor],
          staging: BucketBuffers, device: torch.device) -> torch.Tensor:
    """Bucket ``index`` as the transport sends it, on ``device``: packed into its staging slot,
    or a lone tensor's own bytes when those are on ``device`` already."""
    out = staging.slot(index) if staging.holds(index) else None
    flat = pack_bucket(plan, index, state, out)
    if flat.device != device:  # a lone tensor elsewhere: through its slot
        assert out is not None, "staging keeps a slot for every bucket off the device"
        flat = out.copy_(flat)
    return flat
