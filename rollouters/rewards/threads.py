"""Reward calls inside the rollout worker (``reward.isolation = "thread"``; always for the
``exact`` and ``code`` rewards).

Async functions are awaited on the worker's event loop and cancelled at the timeout. Sync ones
run on :class:`DaemonThreads`: a thread cannot be killed, so one whose call passed the timeout
is abandoned and another takes its place; the pool never starves while fewer than
:data:`MAX_ABANDONED` threads are stuck, and, daemon, a stuck thread never holds up the
worker's exit. Only a process can be killed: hanging user code belongs in
:mod:`rollouters.rewards.pool`.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any

from rollouters.rewards.base import RewardFn, is_coroutine_fn
from rollouters.tasks.sample import Sample

logger = logging.getLogger(__name__)

MAX_ABANDONED = 64  # stuck threads kept before no more are replaced (each holds a stack)


class InWorker:
    """:class:`~rollouters.rewards.base.RewardRunner` on the worker's loop and threads."""

    def __init__(self, fn: RewardFn, threads: int, name: str) -> None:
        self.fn = fn
        self.is_async = is_coroutine_fn(fn)
        self._threads = None if self.is_async else DaemonThreads(threads, f"reward-{name}")

    async def run(self, response: str, sample: Sample, timeout_s: float) -> float:
        if self._threads is None:
            call = self.fn(response, sample)
            return await asyncio.wait_for(call, timeout_s)  # type: ignore[arg-type]
        return await self._threads.run(self.fn, (response, sample), timeout_s)

    def metrics(self) -> dict[str, int]:
        return {"replaced": self._threads.replaced} if self._threads and \
            self._threads.replaced else {}

    def close(self) -> None:
        if self._threads is not None:
            self._threads.close()


@dataclass
class _Call:
    fn: Any
    args: tuple
    loop: asyncio.AbstractEventLoop
    started: asyncio.Future
    done: asyncio.Future
    state: str = "queued"  # queued → running → finished; or cancelled / abandoned
    replaced: bool = False  # abandoned, and another thread took its thread's place


class DaemonThreads:
    """``size`` daemon threads taking calls from a queue; a call's timeout counts from when a
    thread takes it up."""

    def __init__(self, size: int, name: str) -> None:
        self.name, self.replaced, self.abandoned = name, 0, 0
        self._queue: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._started, self._said_full = 0, False
        for _ in range(size):
            self._start_thread()

    async def run(self, fn: Any, args: tuple, timeout_s: float) -> Any:
        loop = asyncio.get_running_loop()
        call = _Call(fn, args, loop, loop.create_future(), loop.create_future())
        self._queue.put(call)
        try:
            await call.started
            kind, value = await asyncio.wait_for(call.done, timeout_s)
        except BaseException:  # a timeout or a cancel: its thread is not waited for
            self._abandon(call)
            raise
        if kind == "error":
            raise value
        return value

    def close(self) -> None:
        """Stop the idle threads; a stuck one stays, but being a daemon it does not keep the
        process alive."""
        with self._lock:
            started, self._started = self._started, 0
        for _ in range(started):  # one each (a departed thread's is never read)
            self._queue.put(None)

    def _start_thread(self) -> None:
        self._started += 1
        threading.Thread(target=self._serve, name=f"{self.name}-{self._started}",
                         daemon=True).start()

    def _abandon(self, call: _Call) -> None:
        with self._lock:
            if call.state == "queued":
                call.state = "cancelled"
            elif call.state == "running":
                call.state = "abandoned"
                call.replaced = self.abandoned < MAX_ABANDONED
                if call.replaced:
                    self.abandoned += 1
                    self.replaced += 1
                    self._start_thread()
                elif not self._said_full:
                    self._said_full = True
                    logger.warning("%s: %d reward threads are stuck; no more are replaced, so "
                                   "later calls wait (reward.isolation = \"process\" kills a "
                                   "stuck call instead)", self.name, MAX_ABANDONED)

    def _serve(self) -> None:
        while (call := self._queue.get()) is not None:
            with self._lock:
                if call.state == "cancelled":
                    continue
                call.state = "running"
            _settle(call.loop, call.started, None)
            try:
                result: tuple = ("ok", call.fn(*call.args))
            except BaseException as exc:  # the caller raises it
                result = ("error", exc)
            with self._lock:
                leave, call.state = call.replaced, "finished"
                if leave:
                    self.abandoned -= 1
            if leave:
                return  # a replacement took this thread's place
            _settle(call.loop, call.done, result)


def _settle(loop: asyncio.AbstractEventLoop, future: asyncio.Future, value: Any) -> None:
    def set_result() -> None:
        if not future.done():
            future.set_result(value)

    try:
        loop.call_soon_threadsafe(set_result)
    except RuntimeError:  # the loop was closed meanwhile: nobody waits any more
        pass
