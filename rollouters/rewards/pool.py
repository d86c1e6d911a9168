"""Reward calls in a pool of processes (``reward.isolation = "process"``, the default for the
``custom`` and ``math`` rewards).

Why processes: a thread cannot be killed. A reward that never returns used to keep one of the
worker's reward threads for good; once all were stuck every later call timed out, every
reward was 0 and learning stopped. Here a call that runs past ``reward.timeout_s`` is
abandoned with its process, which is killed (SIGKILL to its process group: what it started
dies too); the next call starts a fresh one. A process that dies during a call (a segfault,
``os._exit``) is replaced the same way. Up to ``reward.workers`` processes run calls at once,
one call each; they start when first needed, import the function by its ``reward.path`` (the
worker's ``sys.path`` is theirs), and are killed when the pool closes or the worker dies.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import signal
import subprocess
import sys
from collections import deque
from multiprocessing.connection import Connection

from rollouters.rewards._pool_child import BOOT
from rollouters.rewards.base import RewardError
from rollouters.tasks.sample import Sample

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0  # a process whose import of the reward takes longer is killed


class ProcessPool:
    """:class:`~rollouters.rewards.base.RewardRunner` over up to ``size`` processes."""

    def __init__(self, path: str, size: int, is_async: bool, name: str,
                 preload: tuple[str, ...] = (), start_timeout_s: float = START_TIMEOUT_S,
                 wrap: str = "") -> None:
        self.path, self.size, self.is_async, self.name = path, size, is_async, name
        self.preload = preload
        self.wrap = wrap  # import path of an adapter each process applies to the function
        self.start_timeout_s = start_timeout_s
        self.replaced = 0
        self._procs: set[_Process] = set()  # idle and busy
        self._idle: list[_Process] = []
        self._starting = 0
        self._waiters: deque[asyncio.Future] = deque()
        self._killed: list[_Process] = []  # not reaped yet
        self._closed = False

    async def run(self, response: str, sample: Sample, timeout_s: float) -> float:
        request = pickle.dumps((response, sample))  # a sample that cannot be sent costs no process
        proc = await self._acquire()
        try:
            outcome = await proc.call(request, timeout_s)
        except BaseException:  # timed out, cancelled or died: never reused
            self._discard(proc, replaced=True)
            raise
        self._release(proc)
        return _value(outcome)

    def metrics(self) -> dict[str, int]:
        return {"replaced": self.replaced} if self.replaced else {}

    def pids(self) -> list[int]:
        """The pool's processes now, idle and busy."""
        return [p.popen.pid for p in self._procs]

    def close(self) -> None:
        """Kill every process (a busy one too: its call is given up) and reap them."""
        self._closed = True
        for proc in self._procs:
            proc.kill()
        self._killed += self._procs
        self._procs.clear()
        self._idle.clear()
        for proc in self._killed:
            proc.reap()
        self._killed.clear()

    async def _acquire(self) -> _Process:
        while True:
            if self._closed:
                raise RewardError("closed", "the reward pool is closed")
            if self._idle:
                return self._idle.pop()
            if len(self._procs) + self._starting < self.size:
                self._starting += 1
                try:
                    proc = await _Process.start(self.path, self.preload, self.start_timeout_s,
                                                self.wrap)
                except BaseException:
                    self._wake()  # the room it took is free again
                    raise
                finally:
                    self._starting -= 1
                self._procs.add(proc)
                if self._closed:  # closed while it started
                    self._discard(proc, replaced=False)
                    continue
                return proc
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                else:  # woken, then cancelled: pass the turn on
                    self._wake()
                raise

    def _release(self, proc: _Process) -> None:
        if self._closed:
            self._discard(proc, replaced=False)
            return
        self._idle.append(proc)
        self._wake()

    def _discard(self, proc: _Process, replaced: bool) -> None:
        proc.kill()
        self._procs.discard(proc)
        self._killed = [p for p in self._killed if not p.reaped()] + [proc]
        self.replaced += replaced
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return


def _value(outcome: tuple) -> float:
    kind = outcome[0]
    if kind == "ok":
        return outcome[1]
    if kind == "reward_error":
        raise RewardError(outcome[1], outcome[2])
    raise RewardError(f"error:{outcome[1]}", outcome[2])  # the function raised


class _Process:
    """One pool process and its two pipes (requests in, outcomes out)."""

    def __init__(self, popen: subprocess.Popen, requests: Connection, results: Connection
                 ) -> None:
        self.popen, self.requests, self.results = popen, requests, results

    @classmethod
    async def start(cls, path: str, preload: tuple[str, ...], timeout_s: float,
                    wrap: str = "") -> _Process:
        request_r, request_w = os.pipe()
        result_r, result_w = os.pipe()
        try:
            # its own session: a Ctrl-C to the worker's group does not reach user code, and
            # killing the group kills what the call started
            popen = subprocess.Popen(
                [sys.executable, "-c", BOOT, "\n".join(sys.path), path, ",".join(preload),
                 str(request_r), str(result_w), str(os.getpid()), wrap],
                stdin=subprocess.DEVNULL,
                pass_fds=(request_r, result_w), start_new_session=True)
        except BaseException:
            for fd in (request_w, result_r):
                os.close(fd)
            raise
        finally:
            os.close(request_r)
            os.close(result_w)
        proc = cls(popen, Connection(request_w, readable=False),
                   Connection(result_r, writable=False))
        try:
            hello = await proc._receive(timeout_s)
        except BaseException:
            proc.kill()
            proc.reap()
            raise
        if hello[0] != "ready":
            proc.kill()
            proc.reap()
            raise RewardError("start_failed", hello[1])
        return proc

    async def call(self, request: bytes, timeout_s: float) -> tuple:
        try:
            self.requests.send_bytes(request)  # an idle process is reading: no wait
        except OSError as exc:
            raise RewardError("worker_died", f"the reward process is gone: {exc}") from None
        return await self._receive(timeout_s)

    async def _receive(self, timeout_s: float) -> tuple:
        loop = asyncio.get_running_loop()
        readable = loop.create_future()
        fd = self.results.fileno()
        loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
        try:
            await asyncio.wait_for(readable, timeout_s)
        finally:
            loop.remove_reader(fd)
        try:
            return self.results.recv()
        except (EOFError, OSError):
            raise RewardError("worker_died", "the reward process exited (status "
                              f"{self.popen.poll()})") from None

    def kill(self) -> None:
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.requests.close()
        self.results.close()

    def reaped(self) -> bool:
        return self.popen.poll() is not None

    def reap(self) -> None:
        try:
            self.popen.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            logger.warning("reward process %d did not die within 5 s of SIGKILL",
                           self.popen.pid)
