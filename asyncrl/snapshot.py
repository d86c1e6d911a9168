"""Reading the buffer's ``status()`` snapshot: the learner's last metrics record, the rollout
engines, idle ratios, and the :class:`History` of learner steps that a single snapshot lacks.

Pure functions of what they are given; :mod:`asyncrl.dashboard` draws them and
:mod:`asyncrl.plot` reads the same metric names from ``metrics.jsonl``.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The learner's metric names (``asyncrl.metrics`` lists them all).
REWARD = "critic/score/mean"
MISMATCH = "mismatch/abs_logp"
STALENESS_MEAN, STALENESS_MAX = "staleness/mean", "staleness/max"
TRAINED_TOKENS_PER_S = "perf/trained_tokens_per_s"
MFU = "perf/mfu"
STEP_TIME, WAIT_DATA = "timing/step", "timing/wait_data"
# In the learner's heartbeat, not its metrics: {engine: why} for the engines the weight sync
# evicted, until each is heard from again (asyncrl.weights.membership).
EVICTIONS = "weights/evictions"


@dataclass
class History:
    """The last ``size`` learner steps of the series the sparklines draw (reward, mismatch,
    learner idle ratio), in step order; a step seen twice is kept once. Also each engine's
    (gate-held, generating) seconds between its last two changed heartbeats, so its idle
    ratio on screen is recent rather than averaged over its whole life."""

    size: int = 120
    steps: deque[int] = field(default_factory=deque)
    series: dict[str, deque[float]] = field(default_factory=dict)
    engine_totals: dict[str, tuple[float, float]] = field(default_factory=dict)
    engine_window: dict[str, tuple[float, float]] = field(default_factory=dict)
    # The run's metrics.jsonl when this machine can read it, and how far it has been read: the
    # learner steps faster than a monitor refreshes, and heartbeats carry only the last step.
    metrics_path: Path | None = None
    metrics_offset: int = 0
    metrics_inode: int = 0  # a new file (a learner set records aside) is read again, whole

    def add(self, record: Mapping[str, Any]) -> None:
        """Append one learner metrics record (a heartbeat or a ``metrics.jsonl`` line)."""
        step = record.get("step")
        if not isinstance(step, int) or (self.steps and step <= self.steps[-1]):
            return
        self.steps.append(step)
        values = {"reward": record.get(REWARD), "mismatch": record.get(MISMATCH),
                  "learner_idle": learner_idle(record)}
        for name, value in values.items():
            self.series.setdefault(name, deque()).append(
                float("nan") if value is None else float(value))
        if len(self.steps) > self.size:
            self.steps.popleft()
            for values_ in self.series.values():
                values_.popleft()

    def observe(self, status: Mapping[str, Any]) -> None:
        """Take the steps written since the last call (when the metrics file is readable), the
        learner's latest step and the engines' time split from a snapshot."""
        self.follow()
        self.add(learner_info(status))
        for name, member in rollouts(status).items():
            totals = engine_times(member.get("info", {}))
            previous = self.engine_totals.get(name)
            if totals is None or totals == previous:
                continue
            if previous is not None:
                self.engine_window[name] = (totals[0] - previous[0], totals[1] - previous[1])
            self.engine_totals[name] = totals

    def extend(self, records: Iterable[Mapping[str, Any]]) -> None:
        for record in records:
            self.add(record)

    def get(self, name: str) -> list[float]:
        return list(self.series.get(name, ()))

    def follow(self) -> None:
        """Add the complete lines appended to ``metrics_path`` since the last call (a torn
        last line waits for the next call). A file that shrank, or was replaced (a learner
        that went on from an earlier step set the later records aside,
        :func:`asyncrl.metrics.set_aside_after`), is read again from its start, and the steps
        seen before are forgotten: kept, they hid the new records of the same steps."""
        import orjson

        if self.metrics_path is None:
            return
        try:
            with self.metrics_path.open("rb") as f:
                inode = os.fstat(f.fileno()).st_ino
                if inode != self.metrics_inode or f.seek(0, 2) < self.metrics_offset:
                    if self.metrics_offset:
                        self.steps.clear()
                        self.series.clear()
                    self.metrics_offset, self.metrics_inode = 0, inode
                f.seek(self.metrics_offset)
                data = f.read()
        except OSError:
            return
        complete = data[:data.rfind(b"\n") + 1]
        self.metrics_offset += len(complete)
        for line in complete.splitlines():
            try:
                self.add(orjson.loads(line))
            except orjson.JSONDecodeError:
                continue

    @classmethod
    def from_metrics(cls, path: Path, size: int = 120) -> History:
        """Backfill from a run's ``metrics.jsonl`` (a monitor that attaches mid-run), and keep
        following it."""
        history = cls(size, metrics_path=path)
        history.follow()
        return history


def learner_info(status: Mapping[str, Any]) -> dict[str, Any]:
    """The learner's last metrics record, from rank 0's heartbeat (empty before step 1)."""
    for member in status.get("members", {}).values():
        if member.get("role") == "learner" and "step" in member.get("info", {}):
            return member["info"]
    return {}


def evictions(status: Mapping[str, Any]) -> dict[str, str]:
    """The engines the weight sync evicted and has not taken back, each with the reason."""
    for member in status.get("members", {}).values():
        if member.get("role") == "learner" and EVICTIONS in member.get("info", {}):
            return dict(member["info"][EVICTIONS])
    return {}


def rollouts(status: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: m for name, m in sorted(status.get("members", {}).items())
            if m.get("role") == "rollout"}


def learner_idle(record: Mapping[str, Any]) -> float | None:
    """Fraction of the learner's last step spent waiting for data."""
    step, wait = record.get(STEP_TIME), record.get(WAIT_DATA)
    if not step or wait is None:
        return None
    return min(1.0, wait / step)


def engine_times(info: Mapping[str, Any]) -> tuple[float, float] | None:
    """A rollout worker's (held by the closed gate, generating) seconds since it started."""
    wait, busy = info.get("gate_wait_s"), info.get("generate_s")
    return None if wait is None or busy is None else (float(wait), float(busy))


def _ratio(times: Iterable[tuple[float, float] | None]) -> float | None:
    wait = busy = 0.0
    for pair in times:
        if pair is not None:
            wait, busy = wait + pair[0], busy + pair[1]
    return wait / (wait + busy) if wait + busy > 0 else None


def engine_idle(info: Mapping[str, Any],
                window: tuple[float, float] | None = None) -> float | None:
    """Fraction of a rollout worker's working time spent held by the closed gate: over
    ``window`` (recent seconds from :class:`History`) when given, else over its life."""
    return _ratio([window or engine_times(info)])


def fleet_idle(status: Mapping[str, Any], history: History | None = None) -> float | None:
    """The same over every live engine: gate-held time over gate-held plus generating."""
    window = history.engine_window if history is not None else {}
    return _ratio(window.get(name) or engine_times(m.get("info", {}))
                  for name, m in rollouts(status).items() if m.get("alive"))
