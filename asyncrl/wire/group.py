"""TrajectoryGroup: all samples of one prompt, the unit that flows from rollouters to learners.

Frames (ZMQ multipart, or the fields of one Redis stream entry), all little-endian:

====  ==============  ============================================================
 0    header          orjson: schema, run/group/prompt ids, per-sample rewards,
                      finish reasons and lengths, metadata
 1    tokens          int32, every sample's prompt + completion, concatenated
 2    logprobs        float32, behaviour logprob of each token (0 where not generated)
 3    loss_mask       uint8, 1 on tokens the policy generated and is trained on
 4    versions        int32, policy version that produced each token (-1 if none)
====  ==============  ============================================================

No pickle: a receiver never executes what it decodes. Bad input raises :class:`WireError`
with a short ``reason`` that receivers count (:class:`Rejections`); it never crashes them.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from asyncrl.staleness import staleness

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
_ARRAYS: tuple[tuple[str, np.dtype], ...] = (
    ("tokens", np.dtype("<i4")),
    ("logprobs", np.dtype("<f4")),
    ("loss_mask", np.dtype("u1")),
    ("versions", np.dtype("<i4")),
)


class WireError(ValueError):
    """A message that cannot be decoded; ``reason`` is a short, countable label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass
class TrajectoryGroup:
    """G samples of one prompt, with everything the learner needs to train on them."""

    group_id: str
    prompt_id: str
    rewards: list[float]
    finish_reasons: list[str]
    lengths: list[int]
    tokens: np.ndarray
    logprobs: np.ndarray
    loss_mask: np.ndarray
    versions: np.ndarray
    run_id: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_generated(self) -> int:
        return int(self.loss_mask.sum())

    def sample_slices(self) -> list[slice]:
        ends = np.cumsum(self.lengths)
        return [slice(int(end - n), int(end)) for end, n in zip(ends, self.lengths)]

    def min_version(self) -> int:
        """Oldest policy version among generated tokens (-1 if none was generated).

        One unmasked ``min`` over the versions seen as uint32, where every negative int32
        is above every non-negative one: no masked copy (10x faster on 8k-token groups,
        and it runs for every group a buffer accepts or serves)."""
        versions = np.asarray(self.versions, dtype="<i4")
        if versions.size == 0:
            return -1
        oldest = int(versions.view(np.uint32).min())
        return oldest if oldest < 2**31 else -1

    def staleness(self, learner_version: int) -> int:
        """``V − min(token versions)``: how many steps behind its oldest token is (0 with no
        generated token; :func:`asyncrl.staleness.staleness`)."""
        return staleness(learner_version, self.min_version())

    @classmethod
    def from_samples(cls, group_id: str, prompt_id: str, samples: Sequence[dict[str, Any]],
                     run_id: str = "", metadata: dict[str, Any] | None = None
                     ) -> TrajectoryGroup:
        """Build from per-sample dicts with keys tokens, logprobs, loss_mask, versions,
        reward, finish_reason (arrays of one sample's full sequence)."""
        arrays = {name: np.concatenate([np.asarray(s[name], dtype=dt) for s in samples])
                  for name, dt in _ARRAYS}
        return cls(group_id=group_id, prompt_id=prompt_id, run_id=run_id,
                   rewards=[float(s["reward"]) for s in samples],
                   finish_reasons=[str(s["finish_reason"]) for s in samples],
                   lengths=[len(s["tokens"]) for s in samples],
                   metadata=dict(metadata or {}), **arrays)


def encode_group(group: TrajectoryGroup) -> list[bytes]:
    """The group's frames as bytes (see :func:`encode_group_views` to avoid the copies)."""
    return [bytes(frame) for frame in encode_group_views(group)]


def encode_group_views(group: TrajectoryGroup) -> list[bytes | memoryview]:
    """The group's frames: the header, then zero-copy views of its arrays (a copy only
    where an array is not already contiguous little-endian of the wire dtype). Senders
    copy once, into the socket or a packed frame, instead of once more here."""
    header = {
        "schema": SCHEMA_VERSION,
        "run_id": group.run_id,
        "group_id": group.group_id,
        "prompt_id": group.prompt_id,
        "rewards": [float(r) for r in group.rewards],
        "finish_reasons": list(group.finish_reasons),
        "lengths": [int(n) for n in group.lengths],
        "metadata": group.metadata,
    }
    frames: list[bytes | memoryview] = [orjson.dumps(header, option=orjson.OPT_SERIALIZE_NUMPY)]
    for name, dtype in _ARRAYS:
        array = np.ascontiguousarray(getattr(group, name), dtype=dtype)
        frames.append(memoryview(array).cast("B"))
    return frames


@dataclass(frozen=True)
class GroupHeader:
    """Frame 0 of a group, validated: what a buffer needs without touching the arrays."""

    run_id: str
    group_id: str
    prompt_id: str
    rewards: list[float]
    finish_reasons: list[str]
    lengths: list[int]
    metadata: dict[str, Any]

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


def decode_header(frame: bytes | memoryview) -> GroupHeader:
    """Parse and validate a group's header frame; raises :class:`WireError`. The broker's
    compiled check (``buffers/_groupscan.c``) applies these rules itself, in this order and
    with the same Python operations on the parsed values; ``tests/buffers/test_group_check.py``
    holds the two to the same reason and message, so a change here needs one there."""
    try:
        header = orjson.loads(frame if isinstance(frame, bytes) else bytes(frame))
    except orjson.JSONDecodeError as exc:
        raise WireError("header", f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise WireError("header", "header is not an object")
    if header.get("schema") != SCHEMA_VERSION:
        raise WireError("schema", f"unknown schema version {header.get('schema')!r}")
    try:
        # orjson writes NaN/inf as null: a null reward is a non-finite one.
        rewards = [math.nan if r is None else float(r) for r in header["rewards"]]
        lengths = list(map(int, header["lengths"]))
        reasons = list(map(str, header["finish_reasons"]))
        ids = {k: str(header[k]) for k in ("group_id", "prompt_id")}
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError("header", f"missing or bad header field: {exc}") from None
    if not lengths or len(rewards) != len(lengths) or len(reasons) != len(lengths):
        raise WireError("length", f"{len(lengths)} lengths, {len(rewards)} rewards, "
                                  f"{len(reasons)} finish reasons")
    if min(lengths) <= 0:
        raise WireError("length", "sample lengths must be positive")
    if not all(map(math.isfinite, rewards)):
        raise WireError("reward", "non-finite reward")
    metadata = header.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise WireError("header", "metadata is not an object")
    return GroupHeader(run_id=str(header.get("run_id", "")), rewards=rewards,
                       finish_reasons=reasons, lengths=lengths, metadata=metadata, **ids)


def check_frame_count(count: int) -> None:
    if count != 1 + len(_ARRAYS):
        raise WireError("frames", f"expected {1 + len(_ARRAYS)} frames, got {count}")


def check_array_sizes(sizes: Sequence[int], num_tokens: int) -> None:
    """The four arrays' sizes in bytes (frames 1-4) against the header's token count."""
    for (name, dtype), nbytes in zip(_ARRAYS, sizes):
        if nbytes != num_tokens * dtype.itemsize:
            raise WireError("length", f"{name}: {nbytes} bytes for {num_tokens} tokens")


def decode_group(frames: Sequence[bytes | memoryview], check_values: bool = True
                 ) -> TrajectoryGroup:
    """Decode and validate; raises :class:`WireError` for anything malformed.

    ``check_values=False`` keeps every structural check (frame count, header fields, array
    sizes against the lengths: what a reader needs to index safely) and skips the scans of
    the arrays' values (finite logprobs, versions on trained tokens). A consumer of a broker
    that ran the full check on accept uses it: over half of the decode time of an 8k-token
    group is not paid twice on the learner's fetch path."""
    check_frame_count(len(frames))
    header = decode_header(frames[0])
    check_array_sizes([len(memoryview(f)) for f in frames[1:]], header.num_tokens)
    arrays = {name: np.frombuffer(frame, dtype=dtype)
              for (name, dtype), frame in zip(_ARRAYS, frames[1:])}
    if check_values:
        check_array_values(**arrays)
    return TrajectoryGroup(run_id=header.run_id, rewards=header.rewards,
                           finish_reasons=header.finish_reasons, lengths=header.lengths,
                           metadata=header.metadata, group_id=header.group_id,
                           prompt_id=header.prompt_id, **arrays)


def check_array_values(tokens: np.ndarray, logprobs: np.ndarray, loss_mask: np.ndarray,
                       versions: np.ndarray) -> None:
    """The value checks, whole-array first (no masked copies). (Prompt tokens carry version
    -1, so a ``versions.min()`` shortcut would never apply to real groups.) The broker runs
    the same checks in C (``buffers/_groupscan.c``); :data:`VALUE_ERRORS` words both."""
    mask = loss_mask != 0
    if not np.isfinite(logprobs).all() and not np.isfinite(logprobs[mask]).all():
        raise value_error("logprob")
    if np.logical_and(versions < 0, mask).any():
        raise value_error("version")


VALUE_ERRORS = {"logprob": "non-finite behaviour logprob on a trained token",
                "version": "a trained token has no policy version"}


def value_error(reason: str) -> WireError:
    return WireError(reason, VALUE_ERRORS[reason])


def oversized(nbytes: int, max_bytes: int) -> WireError:
    """The rejection of a message over ``buffer.max_message_bytes`` (every buffer path, and
    ``buffers/_groupscan.c``, words it so)."""
    return WireError("oversized", f"{nbytes} bytes > max_message_bytes {max_bytes}")


class Rejections:
    """Counts rejected messages by reason and logs each, rate-limited to the first few."""

    def __init__(self, log_first: int = 5) -> None:
        self.counts: Counter[str] = Counter()
        self._log_first = log_first

    def add(self, error: WireError, source: str = "") -> None:
        self.counts[error.reason] += 1
        if self.counts[error.reason] <= self._log_first:
            logger.warning("rejected trajectory group from %s: %s", source or "?", error)

    @property
    def total(self) -> int:
        return sum(self.counts.values())
