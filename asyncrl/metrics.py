"""Metrics plumbing shared by every role: a crash-safe JSONL writer, timers and rate meters.

Metric names are namespaced by role (``learner/``, ``rollout/``, ``buffer/``, ``weights/``,
``eval/``) so one flat dict per step can carry all of them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson


class MetricsWriter:
    """Appends one JSON object per line and flushes it, so a crash loses at most one line."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("ab")

    def write(self, record: Mapping[str, Any]) -> None:
        self._file.write(orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete line of a metrics file (a torn last line from a crash is skipped)."""
    records = []
    for line in path.read_bytes().splitlines():
        try:
            records.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            continue
    return records


class Timers:
    """Accumulates wall time per phase: ``with timers("wait_data"): ...``; ``pop()`` resets."""

    def __init__(self) -> None:
        self._totals: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._totals[name] = self._totals.get(name, 0.0) + time.perf_counter() - start

    def pop(self, prefix: str = "") -> dict[str, float]:
        totals, self._totals = self._totals, {}
        return {f"{prefix}{name}_s": round(value, 6) for name, value in totals.items()}


class RateMeter:
    """Events per second over a sliding window (tokens/s that reflects now, not the average)."""

    def __init__(self, window_s: float = 10.0) -> None:
        self._window_s = window_s
        self._events: deque[tuple[float, float]] = deque()
        self._start = time.monotonic()
        self.total = 0.0

    def add(self, amount: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._events.append((now, amount))
        self.total += amount
        self._trim(now)

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self._trim(now)
        # Divide by the window (or the time since start, early on): a single burst must not
        # read as an enormous rate.
        span = max(min(self._window_s, now - self._start), 1e-3)
        return sum(amount for _, amount in self._events) / span

    def _trim(self, now: float) -> None:
        while self._events and now - self._events[0][0] > self._window_s:
            self._events.popleft()
