"""One trajectory group as one buffer: the 5 wire frames packed, each aligned to 8 bytes.

Both backends move a group as one opaque value: one ZMQ frame (:mod:`buffers.zmq_protocol`),
one Redis string (:mod:`buffers.redis_entries`). One value rather than five because each
frame or field costs a fixed overhead (about 10 µs per ZMQ frame on loopback); aligned so that
the receiver's zero-copy numpy views are aligned (unaligned int32 arrays made the checks up to
8x slower). Layout: ``<u16 count><count × u32 length>`` then the frames, each starting at a
multiple of :data:`ALIGN` (zero padding; the count's top bit says so; earlier unaligned
packing, still found in old spill files, reads too).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

from asyncrl.wire import WireError

_COUNT = struct.Struct("<H")
ALIGN = 8  # packed frames start at multiples of this (the widest wire dtype is 4 bytes)
ALIGNED_FLAG = 0x8000  # in the count: the frames are aligned (earlier packing was not)
_PADDING = bytes(ALIGN)


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def _offsets(start: int, lengths: Sequence[int], aligned: bool) -> list[int]:
    offsets = []
    for length in lengths:
        start = _aligned(start) if aligned else start
        offsets.append(start)
        start += length
    return offsets


def pack_group(frames: Sequence[Any]) -> bytes:
    """The group's frames (bytes or buffers) as one value: one memcpy of each, each frame
    starting at a multiple of :data:`ALIGN` bytes."""
    lengths = [memoryview(f).nbytes for f in frames]
    head = struct.pack(f"<H{len(frames)}I", len(frames) | ALIGNED_FLAG, *lengths)
    parts: list[Any] = [head]
    end = len(head)
    for frame, offset, length in zip(frames, _offsets(len(head), lengths, True), lengths):
        if offset > end:
            parts.append(_PADDING[:offset - end])
        parts.append(frame)
        end = offset + length
    return b"".join(parts)


def packed_size(frames: Sequence[Any]) -> int:
    """The length of :func:`pack_group`'s output for ``frames``, without the copy: what the
    ZMQ broker holds against ``buffer.max_message_bytes``, known before packing."""
    lengths = [memoryview(f).nbytes for f in frames]
    start = _COUNT.size + 4 * len(lengths)
    return _offsets(start, lengths, True)[-1] + lengths[-1] if lengths else start


def refused_oversized(nbytes: int, max_bytes: int, name: str = "") -> WireError:
    """What a producer's client says of a group over ``buffer.max_message_bytes``, which it
    refuses to send (a rejection counted as ``oversized``, as the buffer's own check)."""
    what = f"group {name!r}" if name else "a group"
    return WireError("oversized", f"{what} of {nbytes} bytes is over buffer.max_message_bytes "
                                  f"= {max_bytes}: refused, not sent (raise "
                                  "buffer.max_message_bytes, or make groups smaller: "
                                  "rollout.group_size, rollout.max_new_tokens)")


def unpack_group(packed: Any) -> list[memoryview]:
    """Zero-copy views of the frames of :func:`pack_group` output (bytes or ``zmq.Frame``);
    raises :class:`WireError` ``frames`` when the lengths do not add up. Reads the
    unaligned layout of earlier versions too (spill files written before the change)."""
    view = memoryview(packed)
    if view.nbytes < _COUNT.size:
        raise WireError("frames", "empty group payload")
    (count,) = _COUNT.unpack_from(view)
    aligned, count = bool(count & ALIGNED_FLAG), count & ~ALIGNED_FLAG
    start = _COUNT.size + 4 * count
    if view.nbytes < start:
        raise WireError("frames", f"group payload too short for {count} frame lengths")
    lengths = struct.unpack_from(f"<{count}I", view, _COUNT.size)
    offsets = _offsets(start, lengths, aligned)
    end = offsets[-1] + lengths[-1] if count else start
    if end != view.nbytes:
        raise WireError("frames", "group frame lengths do not add up to the payload")
    return [view[offset:offset + length] for offset, length in zip(offsets, lengths)]
