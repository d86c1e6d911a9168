"""The bounds every config value is held to, in one place, and the types that carry them.

Every section is strict (:class:`asyncrl.config.schema.Section`): ``true`` is not an integer,
``2.5`` is not a count and ``inf`` or ``nan`` is no number at all. The ceilings below are not
what a machine can do but what no run means: a value past one is a typo (an extra zero, a
unit mistaken) that would otherwise exhaust memory, processes or file descriptors, or wait
forever, before anything named the key. The error names the key and the bound.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, Field

WEEK_S = 7 * 24 * 3600.0
"""The longest duration (timeout, period, wait) a key may hold. ``threading.Event.wait`` and
ZMQ's millisecond timeouts overflow long before ``1e300``; a week is far past any real wait."""
MAX_SEED = 2**31 - 1
"""Seeds feed ``torch.manual_seed(seed + rank)`` and numpy: kept where every one of them fits."""
MAX_PROCESSES = 1024
"""Rollout workers, learner ranks per node, nodes: each is a process (or a thread) with its
own engine or model; past this the machine's process table and memory give out first."""
MAX_THREADS = 1024
"""torch threads per process."""
MAX_GROUP = 4096
"""Samples per prompt and groups per engine call."""
MAX_GROUPS = 1 << 20
"""Groups a buffer holds, or a step consumes."""
MAX_STEPS = 10**9
"""Optimizer steps, periods counted in steps."""
MAX_TOKENS = 1 << 20
"""Tokens of one response or position table: a million."""
MAX_MB = 1 << 20
"""Megabytes of one memory area (a KV cache, a sandbox's address space): a terabyte."""
MAX_BUCKET_MB = 8192.0
"""Megabytes of one weight-broadcast bucket: two such staging buffers are allocated."""

Seconds = Annotated[float, Field(le=WEEK_S)]
"""A duration in seconds: finite (as every float), at most :data:`WEEK_S`."""


def _host(value: str) -> str:
    if not value or "/" in value or any(c.isspace() or not c.isprintable() for c in value):
        raise ValueError("must be a host name or address: not empty, no spaces, no scheme or "
                         "'/' (e.g. 127.0.0.1, 0.0.0.0, node-3)")
    return value


Host = Annotated[str, AfterValidator(_host)]
"""A host name or address to bind or dial."""


def _printable(value: str) -> str:
    if not str(value).isprintable():
        raise ValueError("must not hold control characters (a NUL, a newline, an escape)")
    return value


Name = Annotated[str, AfterValidator(_printable)]
"""A path, a file, a field or module name, an import path: one printable line (a NUL in a
path is a ``ValueError`` of the OS call that meets it, far from the key)."""
PathName = Annotated[Path, AfterValidator(_printable)]
"""A directory path, held to :data:`Name`'s rule."""
MODULE_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"
"""A Python module name, dotted: what ``python -m`` runs."""
