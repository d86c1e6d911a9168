"""Adapt a synchronous :class:`~rollouters.engines.base.Engine` to concurrent async episodes.

Episodes ask for one continuation at a time; engines are fastest on a batch. Requests made while
the engine is busy (or in the same event-loop turn) are gathered and sent as one
``engine.generate`` call on a worker thread, so reward code and environments keep running on
the loop meanwhile. One call at a time: engines are not required to be re-entrant.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from rollouters.engines.base import Completion, Engine


@dataclass
class _Request:
    tokens: list[int]
    max_new_tokens: int
    future: asyncio.Future
    images: list[bytes]


class BatchingEngine:
    """Implements :class:`~rollouters.workflows.api.EpisodeEngine` over an :class:`Engine`."""

    def __init__(self, engine: Engine, temperature: float, max_new_tokens: int,
                 greedy: bool = False) -> None:
        self.engine, self.temperature, self.greedy = engine, temperature, greedy
        self.max_new_tokens = max_new_tokens
        self._pending: list[_Request] = []
        self._pump: asyncio.Task | None = None
        self.calls = 0

    @property
    def version(self) -> int:
        return self.engine.version

    async def generate(self, tokens: list[int], max_new_tokens: int | None = None,
                       images: list[bytes] | None = None) -> Completion:
        future = asyncio.get_running_loop().create_future()
        self._pending.append(_Request(list(tokens), max_new_tokens or self.max_new_tokens,
                                      future, list(images or ())))
        if self._pump is None or self._pump.done():
            self._pump = asyncio.ensure_future(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._pending:
            await asyncio.sleep(0)  # let every episode scheduled this turn add its request
            batch, self._pending = self._pending, []
            by_limit: dict[int, list[_Request]] = {}
            for request in batch:
                by_limit.setdefault(request.max_new_tokens, []).append(request)
            for limit, requests in by_limit.items():
                await self._generate(limit, requests)

    async def _generate(self, limit: int, requests: list[_Request]) -> None:
        self.calls += 1
        images = [r.images for r in requests]   # only to engines asked with images
        extra = {"images": images} if any(images) else {}
        try:
            outputs = await asyncio.to_thread(
                self.engine.generate, [r.tokens for r in requests], 1, self.temperature,
                limit, self.greedy, **extra)
        except Exception as exc:  # every waiting episode sees the engine's failure
            for r in requests:
                if not r.future.done():
                    r.future.set_exception(exc)
            return
        for r, (completion,) in zip(requests, outputs):
            if not r.future.done():
                r.future.set_result(completion)
