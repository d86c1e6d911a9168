"""The bucket plan of a weight update: which bytes of which tensor travel in which bucket.

Pure and device-agnostic (no process groups here), so the format can be tested alone and reused
unchanged when the transport becomes NCCL or when several learner ranks each serve a slice of
the engines: a plan is a function of names, shapes and dtypes only.

Buckets are packed as raw bytes (one flat ``uint8`` tensor per bucket), not one dtype per bucket:
a model that mixes dtypes (bf16 weights, fp32 norms) then still fills its buckets, every bucket
is a single collective whatever it holds, and NCCL and gloo both broadcast ``uint8``. Each
tensor starts at an offset aligned to :data:`ALIGN` bytes so the receiver can view its bytes as
the original dtype without copying. A tensor larger than a bucket travels alone in its own
bucket. Names keep the state-dict order; tied weights (two names, one tensor) travel twice,
because after an FSDP gather they are separate tensors anyway and each name must be loadable.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

ALIGN = 16  # bytes; covers every torch dtype's element size (complex128 is the widest)


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


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def plan_buckets(state: Mapping[str, torch.Tensor], bucket_bytes: int) -> BucketPlan:
    """Greedy plan in state-dict order: open a new bucket when the next tensor would overflow."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    specs: list[TensorSpec] = []
    sizes: list[int] = []
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        offset = _aligned(sizes[-1]) if sizes else 0
        if not sizes or (offset + nbytes > bucket_bytes and sizes[-1] > 0):
            sizes.append(0)
            offset = 0
        specs.append(TensorSpec(name, tuple(tensor.shape), dtype_name(tensor.dtype),
                                len(sizes) - 1, offset, nbytes))
        sizes[-1] = offset + nbytes
    return BucketPlan(tensors=tuple(specs), bucket_nbytes=tuple(sizes))


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def pack_bucket(plan: BucketPlan, index: int, state: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The bucket's bytes as one flat ``uint8`` tensor on the tensors' device.

    A bucket holding one contiguous tensor is that tensor's own bytes (no copy): the sender
    only reads it.
    """
    specs = plan.in_bucket(index)
    first = state[specs[0].name]
    if len(specs) == 1 and first.is_contiguous():
        return _as_bytes(first)
    flat = torch.empty(plan.bucket_nbytes[index], dtype=torch.uint8, device=first.device)
    for spec in specs:
        flat[spec.offset:spec.offset + spec.nbytes].copy_(_as_bytes(state[spec.name]))
    return flat


def unpack_bucket(plan: BucketPlan, index: int, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Named tensors viewing ``flat`` (no copy): the caller must not reuse ``flat`` after."""
    out: dict[str, torch.Tensor] = {}
    for spec in plan.in_bucket(index):
        raw = flat[spec.offset:spec.offset + spec.nbytes]
        out[spec.name] = raw.view(parse_dtype(spec.dtype)).view(spec.shape)
    return out
