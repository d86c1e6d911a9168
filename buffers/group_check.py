"""The broker's check of a packed group: everything :func:`~asyncrl.wire.decode_group` checks,
without building the group.

A broker only needs a group's size, run id and oldest version, once every rule is checked. The
whole check runs in C when ``buffers._groupscan`` was built (``setup.py``): the packed layout,
the header's rules on the object orjson parsed, the array sizes, and one loop over the tokens
for the value checks and the oldest version, instead of five numpy passes and the header's
Python. The broker's Python time per 1k-token group fell from ~69 to ~39 µs when the array half
moved there, and by a further quarter (best of three 49.8 -> 37.4 µs on a noisier day) when the
header's rules did (``bench/RESULTS.md``, 2-core VM; those figures
include ~15 µs a group of the harness building ``zmq.Frame`` objects, since taken out: the
broker's own work is ~14 µs a group now, 6.5 of it this check). Where the extension
did not build, the learner's own :func:`~asyncrl.wire.decode_group` checks the group. The
compiled path applies the rules in ``decode_group``'s order with the same Python operations on
the header's values, so a malformed group gets the same reason and message from both paths
(``tests/buffers/test_group_check.py``).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any

import orjson

from asyncrl.wire import SCHEMA_VERSION, WireError, decode_group, oversized, value_error
from asyncrl.wire.group import MAX_EXTRAS
from buffers.packing import unpack_group

logger = logging.getLogger(__name__)

try:  # the C scan reads little-endian values, as the wire format is
    from buffers import _groupscan
except ImportError:  # not built: no compiler when the package was installed
    _groupscan = None
# An extension built from an older _groupscan.c (an install not redone after a pull) has no
# `check`, or no MAX_EXTRAS (built before groups carried extras): it is not used, and
# describe() says so.
STALE = _groupscan is not None and (not hasattr(_groupscan, "check")
                                    or getattr(_groupscan, "MAX_EXTRAS", None) != MAX_EXTRAS)
COMPILED = _groupscan is not None and not STALE and sys.byteorder == "little"


@dataclass(frozen=True)
class GroupFacts:
    """What the broker keeps of a valid group besides its bytes."""

    run_id: str
    min_version: int
    nbytes: int


def check_packed(packed: Any, max_bytes: int | None = None, compiled: bool = COMPILED
                 ) -> GroupFacts:
    """Validate one packed group (bytes, memoryview or ``zmq.Frame``), its size against
    ``max_bytes`` first (None: no bound); raises :class:`WireError` with the reason
    ``decode_group`` would give."""
    if compiled:
        return _check_compiled(packed, -1 if max_bytes is None else max_bytes)
    return _check_numpy(packed, max_bytes)


def _check_compiled(packed: Any, max_bytes: int) -> GroupFacts:
    try:
        nbytes, run_id, min_version, value_reason = _groupscan.check(
            packed, orjson.loads, SCHEMA_VERSION, max_bytes)
    except _groupscan.GroupError as exc:
        raise WireError(*exc.args) from None
    if value_reason is not None:
        raise value_error(value_reason)
    return GroupFacts(run_id, min_version, nbytes)


def _check_numpy(packed: Any, max_bytes: int | None) -> GroupFacts:
    """The learner's own decode: the same rules, five numpy passes over the arrays."""
    nbytes = memoryview(packed).nbytes
    if max_bytes is not None and nbytes > max_bytes:
        raise oversized(nbytes, max_bytes)
    group = decode_group(unpack_group(packed))
    return GroupFacts(group.run_id, group.min_version(), nbytes)


def describe() -> str:
    """For the broker's start-up log: which path checks groups."""
    if COMPILED:
        return "compiled (buffers._groupscan)"
    if STALE:
        return "numpy (buffers._groupscan is from an older source: reinstall, pip install -e .)"
    return "numpy (buffers._groupscan not built: no C compiler at install time?)"
