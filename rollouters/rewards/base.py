"""The reward protocol and :class:`RewardScorer`, which makes any reward function safe to await.

A reward function is ``fn(response: str, sample: Sample) -> float`` (or a coroutine function
returning one). Rewards are user code and model-written code runs inside some of them: the
scorer guarantees that one that raises, returns something that is not a finite number, or runs
past ``timeout_s`` scores 0, is counted by reason and logged with the sample id, and never
stalls the caller.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from collections import Counter
from collections.abc import Awaitable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from rollouters.tasks.sample import Sample

logger = logging.getLogger(__name__)

LOG_FIRST = 20  # per reason; later failures are only counted


class RewardFn(Protocol):
    def __call__(self, response: str, sample: Sample) -> float | Awaitable[float]: ...


class RewardError(Exception):
    """A reward that could not be computed for a known reason (``reason`` is counted)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class RewardScorer:
    """Awaitable wrapper around a reward function with a timeout and failure accounting.

    Synchronous functions run on a private thread pool (``max_threads``): a thread cannot be
    killed, so a sync function that never returns keeps its thread, but the caller stops
    waiting after ``timeout_s`` and scores 0; once every thread is stuck, later calls time out
    too, still without blocking. Untrusted code belongs in :mod:`rollouters.rewards.sandbox`,
    whose subprocesses are killed.
    """

    def __init__(self, fn: RewardFn, timeout_s: float, name: str = "reward",
                 max_threads: int = 4) -> None:
        self.fn, self.timeout_s, self.name = fn, timeout_s, name
        self.is_async = inspect.iscoroutinefunction(fn) or \
            inspect.iscoroutinefunction(getattr(fn, "__call__", None))
        self._pool = None if self.is_async else ThreadPoolExecutor(
            max_threads, thread_name_prefix=f"reward-{name}")
        self.counts: Counter[str] = Counter()

    async def score(self, response: str, sample: Sample) -> float:
        try:
            value = await asyncio.wait_for(self._call(response, sample), self.timeout_s)
            value = float(value)
            if not math.isfinite(value):
                raise RewardError("non_finite", repr(value))
        except asyncio.TimeoutError:
            return self._failed("timeout", sample, f"no result after {self.timeout_s} s")
        except RewardError as exc:
            return self._failed(exc.reason, sample, str(exc))
        except Exception as exc:  # user code: any failure scores 0, counted by type
            return self._failed(f"error:{type(exc).__name__}", sample, repr(exc))
        self.counts["ok"] += 1
        return value

    def metrics(self, prefix: str = "reward/") -> dict[str, int]:
        return {f"{prefix}{reason}": n for reason, n in self.counts.items()}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    async def _call(self, response: str, sample: Sample) -> float:
        if self.is_async:
            return await self.fn(response, sample)  # type: ignore[misc]
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.fn, response, sample)

    def _failed(self, reason: str, sample: Sample, detail: str) -> float:
        self.counts[reason] += 1
        self.counts["failed"] += 1
        if self.counts[reason] <= LOG_FIRST:
            logger.warning("reward %s failed for sample %s (%s, scored 0): %s", self.name,
                           sample.sample_id, reason, detail[:500])
        return 0.0
