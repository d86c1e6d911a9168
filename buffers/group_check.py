"""The broker's check of a packed group: everything :func:`~asyncrl.wire.decode_group` checks,
without building the group.

A broker only needs a group's run id and oldest version, once every rule is checked. The
array half (the packed layout, the value checks, the oldest version) runs in C when
``buffers._groupscan`` was built (``setup.py``): one loop over the tokens instead of five
numpy passes: the broker's Python time per 1k-token group fell from ~69 to ~39 µs
(``bench/results/groupscan/broker_hot.py``, 2-core VM). Where the extension did not build,
the learner's own :func:`~asyncrl.wire.decode_group` checks the group. The compiled path parses
the header with the same :func:`~asyncrl.wire.decode_header` and applies the rules in
``decode_group``'s order, so a malformed group gets the same reason from both paths.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any

from asyncrl.wire import (
    WireError,
    check_array_sizes,
    check_frame_count,
    decode_group,
    decode_header,
    value_error,
)
from buffers.packing import unpack_group

logger = logging.getLogger(__name__)

try:  # the C scan reads little-endian values, as the wire format is
    from buffers import _groupscan
except ImportError:  # not built: no compiler when the package was installed
    _groupscan = None
COMPILED = _groupscan is not None and sys.byteorder == "little"


@dataclass(frozen=True)
class GroupFacts:
    """What the broker keeps of a valid group besides its bytes."""

    run_id: str
    min_version: int


def check_packed(packed: Any, compiled: bool = COMPILED) -> GroupFacts:
    """Validate one packed group (bytes, memoryview or ``zmq.Frame``); raises
    :class:`WireError` with the reason ``decode_group`` would give."""
    if compiled:
        return _check_compiled(packed)
    return _check_numpy(packed)


def _check_compiled(packed: Any) -> GroupFacts:
    try:
        lengths, header_frame, min_version, value_reason = _groupscan.scan(packed)
    except ValueError as exc:
        raise WireError("frames", str(exc)) from None
    check_frame_count(len(lengths))
    header = decode_header(header_frame)
    check_array_sizes(lengths[1:], header.num_tokens)  # sizes agree, so the scan ran
    if value_reason is not None:
        raise value_error(value_reason)
    return GroupFacts(header.run_id, min_version)


def _check_numpy(packed: Any) -> GroupFacts:
    """The learner's own decode: the same rules, five numpy passes over the arrays."""
    group = decode_group(unpack_group(packed))
    return GroupFacts(group.run_id, group.min_version())


def describe() -> str:
    """For the broker's start-up log: which path checks groups."""
    if COMPILED:
        return "compiled (buffers._groupscan)"
    return "numpy (buffers._groupscan not built: no C compiler at install time?)"
