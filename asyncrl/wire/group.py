"""TrajectoryGroup: all samples of one prompt, the unit that flows from rollouters to learners.

Frames (ZMQ multipart, or the fields of one Redis stream entry), all little-endian:

====  ==============  ============================================================
 0    header          orjson: schema, run/group/prompt ids, per-sample rewards,
                      finish reasons and lengths, metadata
 1    tokens          int32, every sample's prompt + completion, concatenated
 2    logprobs        float32, behaviour logprob of each token (0 where not generated)
 3    loss_mask       uint8, 1 on tokens the policy generated and is trained on
 4    versions        int32, policy version that produced each token (-1 if none)
 5..  extras          optional named arrays, one frame each, in the order the header's
                      ``extras`` declares them (name, dtype, shape)
====  ==============  ============================================================

Extras (:data:`EXTRA_DTYPES`, at most :data:`MAX_EXTRAS`) carry what only some runs need: the
experts an MoE engine routed each token to (``routing``), images. A group without extras has
no ``extras`` key and is byte for byte what it was before extras existed, so the schema version
did not change; a reader from before extras refuses a group with them (``frames``: more than
five), it never misreads one. Each extra's frame must hold exactly ``prod(shape)`` items of its
dtype; what the arrays mean is for their consumer to check.

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
MAX_EXTRAS = 16
MAX_EXTRA_DIMS = 8
EXTRA_DTYPES: tuple[str, ...] = ("u1", "i1", "u2", "i2", "u4", "i4", "f2", "f4")
"""The dtypes an extra may declare: numpy's codes, little-endian on the wire."""
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
    extras: dict[str, np.ndarray] = field(default_factory=dict)
    """Named optional arrays (:data:`EXTRA_DTYPES`), one wire frame each."""

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
        reward, finish_reason (arrays of one sample's full sequence), and optionally
        ``extras``: per-token arrays by name (first axis the sample's tokens), concatenated
        over the samples; every sample must then carry the same names."""
        arrays = {name: np.concatenate([np.asarray(s[name], dtype=dt) for s in samples])
                  for name, dt in _ARRAYS}
        names = {tuple(s.get("extras") or ()) for s in samples}
        if len(names) > 1:
            raise ValueError(f"samples carry different extras: {sorted(names)}")
        extras = {name: np.concatenate([np.asarray(s["extras"][name]) for s in samples])
                  for name in next(iter(names), ())}
        return cls(group_id=group_id, prompt_id=prompt_id, run_id=run_id,
                   rewards=[float(s["reward"]) for s in samples],
                   finish_reasons=[str(s["finish_reason"]) for s in samples],
                   lengths=[len(s["tokens"]) for s in samples],
                   metadata=dict(metadata or {}), extras=extras, **arrays)


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
    arrays = [np.ascontiguousarray(getattr(group, name), dtype=dtype) for name, dtype in _ARRAYS]
    if group.extras:  # absent otherwise: a group without extras is as before they existed
        extras = [_wire_extra(name, array) for name, array in group.extras.items()]
        header["extras"] = [spec for spec, _ in extras]
        arrays += [array for _, array in extras]
    frames: list[bytes | memoryview] = [orjson.dumps(header, option=orjson.OPT_SERIALIZE_NUMPY)]
    frames += [memoryview(array.reshape(-1)).cast("B") for array in arrays]
    return frames


def _wire_extra(name: str, array: np.ndarray) -> tuple[dict[str, Any], np.ndarray]:
    """An extra's header entry and its contiguous little-endian array; ValueError for a
    dtype the wire does not carry (a sender's bug, not a malformed message)."""
    array = np.asarray(array)
    code = f"{array.dtype.kind}{array.dtype.itemsize}"
    if code not in EXTRA_DTYPES:
        raise ValueError(f"extra {name!r}: dtype {array.dtype} is not one of {EXTRA_DTYPES}")
    array = np.ascontiguousarray(array, dtype=np.dtype("<" + code))
    return {"name": name, "dtype": code, "shape": list(array.shape)}, array


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
    extras: tuple[ExtraSpec, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


@dataclass(frozen=True)
class ExtraSpec:
    """One extra as the header declares it, validated."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype("<" + self.dtype).itemsize


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
                       finish_reasons=reasons, lengths=lengths, metadata=metadata,
                       extras=decode_extras(header.get("extras") or []), **ids)


def decode_extras(extras: Any) -> tuple[ExtraSpec, ...]:
    """The header's ``extras`` declarations (already ``or []``), validated in order; raises
    :class:`WireError` ``extras``. ``buffers/_groupscan.c`` words every rule the same."""
    if not isinstance(extras, list):
        raise WireError("extras", "extras is not a list")
    if len(extras) > MAX_EXTRAS:
        raise WireError("extras", f"{len(extras)} extras, at most {MAX_EXTRAS}")
    specs: list[ExtraSpec] = []
    for entry in extras:
        spec = _extra_spec(entry)
        if any(spec.name == seen.name for seen in specs):
            raise WireError("extras", f"extra {spec.name!r} is declared twice")
        specs.append(spec)
    return tuple(specs)


def _extra_spec(entry: Any) -> ExtraSpec:
    if not isinstance(entry, dict):
        raise WireError("extras", "an extra is not an object")
    name, dtype, shape = entry.get("name"), entry.get("dtype"), entry.get("shape")
    if not isinstance(name, str) or not name:
        raise WireError("extras", f"extra name {name!r} is not a non-empty string")
    if not isinstance(dtype, str) or dtype not in EXTRA_DTYPES:
        raise WireError("extras", f"extra {name!r}: dtype {dtype!r} is not one of "
                                  f"{', '.join(EXTRA_DTYPES)}")
    if (not isinstance(shape, list) or len(shape) > MAX_EXTRA_DIMS
            or not all(type(d) is int and d >= 0 for d in shape)):
        raise WireError("extras", f"extra {name!r}: shape {shape!r} is not a list of at most "
                                  f"{MAX_EXTRA_DIMS} non-negative integers")
    return ExtraSpec(name, dtype, tuple(shape))


def check_frame_count(count: int, extras: int | None = None) -> None:
    """Before the header (``extras`` None): at least the five fixed frames; after it: the
    five and one per declared extra."""
    expected = 1 + len(_ARRAYS) + (extras or 0)
    wrong = count < expected if extras is None else count != expected
    if wrong:
        raise WireError("frames", f"expected {expected} frames, got {count}")


def check_array_sizes(sizes: Sequence[int], num_tokens: int) -> None:
    """The four arrays' sizes in bytes (frames 1-4) against the header's token count."""
    for (name, dtype), nbytes in zip(_ARRAYS, sizes):
        if nbytes != num_tokens * dtype.itemsize:
            raise WireError("length", f"{name}: {nbytes} bytes for {num_tokens} tokens")


def check_extra_sizes(sizes: Sequence[int], extras: Sequence[ExtraSpec]) -> None:
    """Each extra's frame size in bytes against its declared shape and dtype."""
    for spec, nbytes in zip(extras, sizes):
        if nbytes != spec.nbytes:
            raise WireError("length", f"extra {spec.name!r}: {nbytes} bytes for shape "
                                      f"{list(spec.shape)!r} of {spec.dtype}")


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
    check_frame_count(len(frames), len(header.extras))
    sizes = [len(memoryview(f)) for f in frames[1:]]
    fixed = len(_ARRAYS)
    check_array_sizes(sizes[:fixed], header.num_tokens)
    check_extra_sizes(sizes[fixed:], header.extras)
    arrays = {name: np.frombuffer(frame, dtype=dtype)
              for (name, dtype), frame in zip(_ARRAYS, frames[1:])}
    if check_values:
        check_array_values(**arrays)
    extras = {spec.name: np.frombuffer(frame, dtype="<" + spec.dtype).reshape(spec.shape)
              for spec, frame in zip(header.extras, frames[1 + fixed:])}
    return TrajectoryGroup(run_id=header.run_id, rewards=header.rewards,
                           finish_reasons=header.finish_reasons, lengths=header.lengths,
                           metadata=header.metadata, group_id=header.group_id,
                           prompt_id=header.prompt_id, extras=extras, **arrays)


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
