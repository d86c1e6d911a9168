"""A stream entry of the Redis buffer, read back as a trajectory group.

Consumers validate every entry they are served, whatever the producer's client did: a writer
that bypassed :class:`~buffers.redis_buffer.RedisBufferClient` (or a bug in one) must cost a
counted rejection, never a crashed learner or a batch trained on garbage.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from asyncrl.wire import Rejections, TrajectoryGroup, WireError, decode_group
from buffers.protocol import PutResult

FRAME_FIELDS = (b"h", b"t", b"l", b"m", b"v")  # the 5 wire frames, in order


def put_args(frames: Sequence[Any], max_message_bytes: int, rejections: Rejections,
             producer: str) -> list[Any]:
    """The put_many script's 8 arguments for one group: reason, minv, run_id, the 5 frames.
    Oversized or malformed frames are counted in ``rejections`` and sent as a bare reason,
    so that the script counts them too, in order with the producer's other puts."""
    try:  # frames may be memoryviews of the group's arrays: redis-py sends them uncopied
        size = sum(memoryview(f).nbytes for f in frames)
        if size > max_message_bytes:
            raise WireError("oversized", f"{size} bytes > max_message_bytes {max_message_bytes}")
        group = decode_group(frames)
    except WireError as exc:
        rejections.add(exc, producer)
        return [exc.reason, "", "", *[b""] * len(FRAME_FIELDS)]
    return ["", group.min_version(), group.run_id, *frames]


def put_results(answers: Sequence[Sequence[Any]]) -> tuple[list[PutResult], bool]:
    """A put_many script's answers as results, and whether it stopped at a full buffer (the
    group that found it full gets no result: it was not handled)."""
    results = [PutResult(accepted=bool(ok), reason="" if ok else value.decode())
               for ok, value in answers]
    if results and results[-1].reason == "full":
        return results[:-1], True
    return results, False


def decode_entry(fields: Sequence[bytes], max_message_bytes: int) -> TrajectoryGroup:
    """Validate a stream entry as a consumer: producers may have bypassed this client."""
    values = dict(zip(fields[::2], fields[1::2]))
    frames = [values.get(name) for name in FRAME_FIELDS]
    if any(frame is None for frame in frames):
        raise WireError("frames", f"entry has fields {sorted(values)}")
    size = sum(len(frame) for frame in frames)  # type: ignore[arg-type]
    if size > max_message_bytes:
        raise WireError("oversized", f"{size} bytes > max_message_bytes {max_message_bytes}")
    group = decode_group(frames)  # type: ignore[arg-type]
    try:
        minv = int(values.get(b"minv", b""))
    except ValueError:
        raise WireError("version", "minv field is not an integer") from None
    if minv != group.min_version():
        raise WireError("version", f"minv {minv} but oldest token version {group.min_version()}")
    return group


def entry_order(entry_id: str) -> tuple[int, int]:
    """Sort key of a stream entry id ``ms-seq``: the order entries were added in."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq)
