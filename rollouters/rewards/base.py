"""The reward protocol and :class:`RewardScorer`, which makes any reward function safe to await.

A reward function is ``fn(response: str, sample: Sample) -> float`` (or a coroutine function
returning one). Rewards are user code and model-written code runs inside some of them: the
scorer guarantees that one that raises, returns something that is not a finite number, or runs
past ``timeout_s`` scores 0, is counted by reason and logged with the sample id, and never
stalls the caller. Where the function runs is a :class:`RewardRunner`'s business: in the
worker (:mod:`rollouters.rewards.threads`) or in a pool of processes that are killed when a
call hangs (:mod:`rollouters.rewards.pool`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from typing import Protocol

from rollouters.tasks.sample import Sample

logger = logging.getLogger(__name__)

LOG_FIRST = 20  # per reason; later failures are only counted
# The failure-rate warning: more than FAILURE_RATE of the last FAILURE_WINDOW calls failed
# (once FAILURE_MIN_CALLS were made), said at most once per FAILURE_WARN_EVERY_S.
FAILURE_WINDOW, FAILURE_MIN_CALLS, FAILURE_RATE, FAILURE_WARN_EVERY_S = 100, 20, 0.10, 60.0


class RewardFn(Protocol):
    def __call__(self, response: str, sample: Sample) -> float | Awaitable[float]: ...


class RewardError(Exception):
    """A reward that could not be computed for a known reason (``reason`` is counted)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class RewardRunner(Protocol):
    """Where reward calls run. ``run`` raises :class:`asyncio.TimeoutError` for a call that ran
    past ``timeout_s`` (counted from when a thread or process took it up, not while it waited
    for one); that call is abandoned and what ran it replaced, so it holds up no later call."""

    is_async: bool

    async def run(self, response: str, sample: Sample, timeout_s: float) -> float: ...

    def metrics(self) -> dict[str, int]: ...

    def close(self) -> None: ...


def is_coroutine_fn(fn: object) -> bool:
    return inspect.iscoroutinefunction(fn) or \
        inspect.iscoroutinefunction(getattr(fn, "__call__", None))


class FailureRate:
    """Whether the failures of the last ``window`` calls passed ``rate``, at most once per
    ``every_s``: one line that says a reward is broken, which the per-reason logs (the first
    :data:`LOG_FIRST` of each) stop saying once a run is long."""

    def __init__(self, window: int = FAILURE_WINDOW, min_calls: int = FAILURE_MIN_CALLS,
                 rate: float = FAILURE_RATE, every_s: float = FAILURE_WARN_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.recent: deque[bool] = deque(maxlen=window)
        self.min_calls, self.rate, self.every_s, self.clock = min_calls, rate, every_s, clock
        self.next_warning = float("-inf")

    def add(self, failed: bool) -> int | None:
        """Record a call; the failures in the window when a warning is due, else None."""
        self.recent.append(failed)
        failures = sum(self.recent)
        if len(self.recent) < self.min_calls or failures <= self.rate * len(self.recent) \
                or self.clock() < self.next_warning:
            return None
        self.next_warning = self.clock() + self.every_s
        return failures


class RewardScorer:
    """Awaitable wrapper around a reward runner with a timeout and failure accounting.

    ``counts``: ``ok``, ``failed`` and one entry per failure reason (``timeout``,
    ``non_finite``, ``error:<exception type>``, ``worker_died``, ``start_failed``, or a
    :class:`RewardError`'s reason); the rollout worker's heartbeat carries them as
    ``reward/<name>`` and the learner sums them into each step's record.
    """

    def __init__(self, fn: RewardFn, timeout_s: float, name: str = "reward",
                 runner: RewardRunner | None = None, workers: int = 4) -> None:
        from rollouters.rewards.threads import InWorker

        self.timeout_s, self.name = timeout_s, name
        self.runner = runner if runner is not None else InWorker(fn, workers, name)
        self.is_async = self.runner.is_async
        self.counts: Counter[str] = Counter()
        self.failure_rate = FailureRate()

    async def score(self, response: str, sample: Sample) -> float:
        try:
            value = float(await self.runner.run(response, sample, self.timeout_s))
            if not math.isfinite(value):
                raise RewardError("non_finite", repr(value))
        except asyncio.TimeoutError:
            return self._failed("timeout", sample, f"no result after {self.timeout_s} s")
        except RewardError as exc:
            return self._failed(exc.reason, sample, str(exc))
        except Exception as exc:  # user code: any failure scores 0, counted by type
            return self._failed(f"error:{type(exc).__name__}", sample, repr(exc))
        self.counts["ok"] += 1
        self.failure_rate.add(False)
        return value

    def metrics(self, prefix: str = "reward/") -> dict[str, int]:
        counts = {**self.counts, **self.runner.metrics()}
        return {f"{prefix}{reason}": n for reason, n in counts.items()}

    def close(self) -> None:
        self.runner.close()

    def _failed(self, reason: str, sample: Sample, detail: str) -> float:
        self.counts[reason] += 1
        self.counts["failed"] += 1
        if self.counts[reason] <= LOG_FIRST:
            logger.warning("reward %s failed for sample %s (%s, scored 0): %s", self.name,
                           sample.sample_id, reason, detail[:500])
        failures = self.failure_rate.add(True)
        if failures is not None:
            reasons = ", ".join(f"{r} {n}" for r, n in self.counts.most_common()
                                if r not in ("ok", "failed"))
            logger.warning("reward %s: %d of the last %d calls failed and scored 0 (in all: "
                           "%d ok, %s); learning from these rewards is impaired (reward/* in "
                           "metrics.jsonl)", self.name, failures, len(self.failure_rate.recent),
                           self.counts["ok"], reasons)
        return 0.0
