"""A group on its way into and out of Redis: the put script's arguments, and a consumer's
validation of what it read back.

Consumers validate every entry they are served, whatever the producer's client did: a writer
that bypassed :class:`~buffers.redis_buffer.RedisBufferClient` (or a bug in one) must cost a
counted rejection, never a crashed learner or a batch trained on garbage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.wire import Rejections, TrajectoryGroup, WireError, decode_group, oversized
from buffers.group_check import check_packed
from buffers.packing import pack_group, refused_oversized, unpack_group
from buffers.protocol import PutResult

PACKING_SLACK = 4096  # packed length over the frames' own: lengths and alignment padding


@dataclass
class StagedPut:
    """One group of a put: its payload (the packed frames) goes to Redis under ``key`` with a
    plain ``SET``; the put script gets ``reason``, ``min_version`` and ``run_id`` and files the
    key. A group the client rejected has a ``reason`` and no payload."""

    reason: str
    min_version: int
    run_id: str
    payload: bytes | None = None
    key: str = ""
    staged: bool = False  # the payload was sent (it waits in Redis, with an expiry)


def stage_put(frames: Sequence[Any], max_message_bytes: int, rejections: Rejections,
              producer: str, name: str = "") -> StagedPut:
    """Validate a group's frames as the producer's client. Oversized or malformed frames are
    counted in ``rejections`` (logged naming the group ``name`` and, oversized, the size and
    ``buffer.max_message_bytes``) and sent as a bare reason, so that the script counts them
    too, in order with the producer's other puts; an oversized payload is never sent."""
    try:  # frames may be memoryviews of the group's arrays: packed with one copy each
        size = sum(memoryview(f).nbytes for f in frames)
        if size > max_message_bytes:
            raise refused_oversized(size, max_message_bytes, name)
        payload = pack_group(frames)
        group = check_packed(payload)  # decode_group's rules, in one C pass where built
    except WireError as exc:
        rejections.add(exc, producer)
        return StagedPut(exc.reason, -1, "")
    return StagedPut("", group.min_version, group.run_id, payload)


def put_results(answers: Sequence[Sequence[Any]]) -> tuple[list[PutResult], bool]:
    """A put_many script's answers as results, and whether it stopped at a full buffer (the
    group that found it full gets no result: it was not handled)."""
    results = [PutResult(accepted=bool(ok), reason="" if ok else value.decode())
               for ok, value in answers]
    if results and results[-1].reason == "full":
        return results[:-1], True
    return results, False


def entry_fields(fields: Sequence[bytes]) -> dict[bytes, bytes]:
    return dict(zip(fields[::2], fields[1::2]))


def decode_entry(fields: dict[bytes, bytes], payload: bytes | None,
                 max_message_bytes: int) -> TrajectoryGroup:
    """Validate an index entry and the payload it names, as a consumer."""
    if payload is None:
        raise WireError("frames", f"no payload under {fields.get(b'k')!r}")
    if len(payload) > max_message_bytes + PACKING_SLACK:  # before anything is decoded
        raise oversized(len(payload), max_message_bytes)
    frames = unpack_group(payload)
    size = sum(frame.nbytes for frame in frames)  # as the producer's client counted it
    if size > max_message_bytes:
        raise oversized(size, max_message_bytes)
    group = decode_group(frames)
    try:
        minv = int(fields.get(b"minv", b""))
    except ValueError:
        raise WireError("version", "minv field is not an integer") from None
    if minv != group.min_version():
        raise WireError("version", f"minv {minv} but oldest token version {group.min_version()}")
    return group

