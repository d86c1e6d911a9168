"""Rank 0 splits one global batch across the learner ranks by tokens, and sends each its share.

Why rank 0 and not every rank reading the buffer: advantages are per group and group-level
aggregation needs whole groups, so the batch must be collated in one place; and ranks that read
``groups_per_step / W`` groups each get whatever token counts the buffer hands them, so the
slowest rank (the longest answers) sets the step time. Balancing SEQUENCES (not groups) by
their tokens evens the ranks' compute; the loss stays exact because every weight that depends on
other rows (advantages, ``group_tokens``) is computed before the split
(``learners.batching``, ``learners.losses.aggregation``).

The transfer is one ``scatter`` of byte buffers (every field padded to the largest share), no
pickle. Splitting and packing those buffers (:func:`pack_shares`) needs nothing but the batch,
so the learner does it on its prefetch thread, during the step before (``learners.prefetch``):
only the two collectives stay between steps.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from learners.batching import ROW_FIELDS, TrainBatch


def partition_by_tokens(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Split item indices into ``parts`` lists of near-equal total length (greedy LPT).

    Longest first, each to the currently lightest part (ties: the lower part index). LPT's
    largest part is at most 4/3 of the optimum; with many short sequences it is near-perfect.
    Each part's indices are in ascending order. A part may be EMPTY when there are fewer items
    than parts (the caller pads it: :meth:`TrainBatch.as_pad`).
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    heap = [(0, p) for p in range(parts)]
    out: list[list[int]] = [[] for _ in range(parts)]
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, part = heapq.heappop(heap)
        out[part].append(index)
        heapq.heappush(heap, (load + int(lengths[index]), part))
    return [sorted(part) for part in out]


def split_batch(batch: TrainBatch, parts: int) -> list[TrainBatch]:
    """``batch`` as ``parts`` token-balanced shares; an empty share is a zero-weight pad."""
    shares = partition_by_tokens(batch.lengths.tolist(), parts)
    return [batch.select(rows) if rows else batch.as_pad() for rows in shares]


HEADER_COLUMNS = 6
"""A share's header: ``[rows, width, routing columns, patches, images, pixel width]``: the
``layers × top_k`` of its ``routing`` (0 without: ``learner.routing_replay``), and a VLM's
``pixel_values [rows, patches, pixel width]`` and ``image_grid_thw [rows, images, 3]`` (0s
without images, :mod:`learners.vision`)."""


@dataclass(frozen=True)
class PackedShares:
    """A global batch split for ``world`` ranks and packed, ready for :func:`scatter_batch`:
    ``header[r]`` (:data:`HEADER_COLUMNS`) of rank r's share, ``buffers[r]`` its bytes."""

    world: int
    header: torch.Tensor
    buffers: list[torch.Tensor]


def pack_shares(batch: TrainBatch, world: int) -> PackedShares:
    """Rank 0's half of :func:`scatter_batch` that involves no other rank: the token-balanced
    split, and each share's fields padded to the largest share and laid end to end."""
    shares = split_batch(batch, world)
    header = torch.tensor([[s.num_samples, s.input_ids.shape[1], _routing_columns(s),
                            *_image_columns(s)] for s in shares])
    layout = _layout(*(int(v) for v in header.max(dim=0).values))
    return PackedShares(world, header, [_pack(share, layout) for share in shares])


def scatter_batch(batch: TrainBatch | PackedShares | None, rank: int, world: int,
                  header: torch.Tensor | None = None) -> TrainBatch:
    """Rank 0 passes the global batch, or it already packed (:func:`pack_shares`); the
    others ``None``. Every rank returns its balanced share. ``header``: the packed shares'
    ``header``, when every rank already has it (the learner agrees on it at the end of the
    step before: then the scatter is the only collective here).

    COLLECTIVE over the default group, and only two collectives: a broadcast of every share's
    ``[rows, width]``, then ONE ``dist.scatter`` of byte buffers, each share's fields padded
    to the largest share's shape and laid end to end (widest dtype first, so every field's
    offset is aligned for its dtype). A collective per field would make 8 ranks meet 13 times
    per step: bench/pipeline.py measured those meetings at several % of a step on a loaded
    machine.
    """
    if world == 1:
        if not isinstance(batch, TrainBatch):
            raise ValueError("rank 0 of a world of 1 must pass the batch itself")
        return batch
    packed = None
    if rank == 0:
        if batch is None:
            raise ValueError("rank 0 must pass the batch")
        packed = batch if isinstance(batch, PackedShares) else pack_shares(batch, world)
        if packed.world != world:
            raise ValueError(f"shares packed for {packed.world} ranks, the world is {world}")
    if header is None:
        header = (packed.header if packed is not None
                  else torch.zeros(world, HEADER_COLUMNS, dtype=torch.int64))
        dist.broadcast(header, src=0)
    elif packed is not None and not torch.equal(header, packed.header):
        raise ValueError(f"agreed header {header.tolist()} is not the packed shares' "
                         f"{packed.header.tolist()}")
    layout = _layout(*(int(v) for v in header.max(dim=0).values))
    out = torch.zeros(sum(nbytes for _, _, _, nbytes in layout), dtype=torch.uint8)
    _scatter(out, packed.buffers if packed is not None else None)
    rows, width = (int(v) for v in header[rank][:2])
    received, offset = {}, 0
    for name, dtype, shape, nbytes in layout:
        value = out[offset:offset + nbytes].view(dtype).reshape(shape)
        value = value[:rows, :width] if len(shape) >= 2 and name not in ROW_FIELDS \
            else value[:rows]
        received[name] = value.bool() if name in _BOOL else value
        offset += nbytes
    return TrainBatch(**received)


# Wire dtype per field (bools travel as uint8) and whether it is per token ([B, T]) or per row.
_WIRE = {"input_ids": (torch.int64, True), "attention_mask": (torch.int64, True),
         "targets": (torch.int64, True), "loss_mask": (torch.uint8, True),
         "behaviour_logprobs": (torch.float32, True), "versions": (torch.int64, True),
         "advantages": (torch.float32, True), "rewards": (torch.float32, False),
         "min_versions": (torch.int64, False), "group_index": (torch.int64, False),
         "group_tokens": (torch.float32, False), "sample_mask": (torch.uint8, False)}
_BOOL = ("loss_mask", "sample_mask")
# Every field in that order, widest dtype first: each offset stays a multiple of its itemsize.
_ORDER = sorted(_WIRE, key=lambda name: -_WIRE[name][0].itemsize)


def _layout(rows: int, width: int, routing: int = 0, patches: int = 0, images: int = 0,
            pixel_width: int = 0) -> list[tuple[str, torch.dtype, tuple[int, ...], int]]:
    """(name, wire dtype, padded shape, bytes) of every field, in buffer order: widest dtype
    first (a VLM's image fields, when a share has images, among them), so every offset stays a
    multiple of its itemsize; ``routing`` (columns per token) last, when the batch carries
    it: int16, so it cannot misalign the wider fields before it."""
    out = []
    if images:
        out += [("image_grid_thw", torch.int64, (rows, images, 3)),
                ("pixel_values", torch.float32, (rows, patches, pixel_width))]
    for name in _ORDER:
        dtype, per_token = _WIRE[name]
        out.append((name, dtype, (rows, width) if per_token else (rows,)))
    out.sort(key=lambda field: -field[1].itemsize)   # stable: _ORDER's order otherwise
    out = [(name, dtype, shape, math.prod(shape) * dtype.itemsize)
           for name, dtype, shape in out]
    if routing:
        shape = (rows, width, routing)
        out.append(("routing", torch.int16, shape, math.prod(shape) * 2))
    return out


def _image_columns(share: TrainBatch) -> tuple[int, int, int]:
    """``(patches, images, pixel width)`` of a share's image fields; 0s without."""
    if share.pixel_values is None:
        return 0, 0, 0
    return (share.pixel_values.shape[1], share.image_grid_thw.shape[1],
            share.pixel_values.shape[2])


def _routing_columns(share: TrainBatch) -> int:
    return math.prod(share.routing.shape[2:]) if share.routing is not None else 0


def _pack(share: TrainBatch, layout) -> torch.Tensor:
    """One share as the byte buffer :func:`scatter_batch` sends."""
    return torch.cat([_padded(_field(share, name), shape, dtype).reshape(-1).view(torch.uint8)
                      for name, dtype, shape, _ in layout])


def _field(share: TrainBatch, name: str) -> torch.Tensor:
    """A field as it travels: ``routing`` with its layers and top-k as one axis."""
    value = getattr(share, name)
    return value.flatten(2) if name == "routing" else value


def _padded(value: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    out = torch.zeros(shape, dtype=dtype)
    out[tuple(slice(0, n) for n in value.shape)] = value.to(dtype)
    return out


def _scatter(out: torch.Tensor, inputs: list[torch.Tensor] | None) -> None:
    dist.scatter(out, scatter_list=inputs, src=0)


__all__ = ["PackedShares", "pack_shares", "partition_by_tokens", "scatter_batch", "split_batch"]
