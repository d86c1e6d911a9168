"""What a rollout worker generates for each grant of the gate: scored trajectory groups.

Two producers behind one small interface (``produce(n)``, ``handed_over()``, ``exhausted``,
``metrics()``, ``close()``): the digit tasks' batched fast path, and the workflow API's
episodes (single-turn, multi-turn agents, custom workflows) run concurrently on one event loop.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Awaitable

from asyncrl.config import Config

STOP_POLL_S = 0.1  # how soon a stop (a signal) ends the episodes in flight


class DigitProducer:
    """The digit tasks' fast path: one batched engine call per window of prompts."""

    def __init__(self, cfg: Config, engine, index: int) -> None:
        from rollouters.tasks import make_task

        self.cfg, self.engine = cfg, engine
        self.task = make_task(cfg.task, cfg.run.seed, cfg.model.tiny)
        self.rng = random.Random(cfg.run.seed * 7919 + index)
        self.exhausted = False

    def produce(self, n: int) -> list:
        from rollouters.workflows.single_turn import generate_groups

        r = self.cfg.rollout
        return generate_groups(self.engine, self.task, self.task.sample(self.rng, n),
                               r.group_size, r.temperature, r.max_new_tokens,
                               run_id=self.cfg.run.name)

    def handed_over(self) -> None:
        """Nothing to record: prompts are drawn, not read."""

    def metrics(self) -> dict:
        return {}

    def close(self) -> None:
        """Nothing held."""


class EpisodeProducer:
    """Workflows behind the workflow API: G concurrent episodes per sample on one event loop,
    samples from ``[data]`` (or the env), their position saved once the groups are handed over.
    ``stop`` (the worker's): set, it cancels the episodes in flight, whatever they wait for (a
    hung reward's process is killed), and ``produce`` returns no group.
    """

    def __init__(self, cfg: Config, engine, model_dir, index: int,
                 stop: threading.Event | None = None) -> None:
        from asyncrl.models import load_tokenizer
        from rollouters.workflows.batching import BatchingEngine
        from rollouters.workflows.factory import make_source, make_workflow
        from rollouters.workflows.runner import EpisodeRunner

        seed = cfg.run.seed * 7919 + index
        self.cfg, self.loop = cfg, asyncio.new_event_loop()
        self.stop = stop or threading.Event()
        self.workflow = make_workflow(cfg, load_tokenizer(model_dir), seed)
        self.source = make_source(cfg, index, cfg.rollout.workers, seed)
        wf = cfg.workflow
        self.runner = EpisodeRunner(
            self.workflow, BatchingEngine(engine, cfg.rollout.temperature,
                                          cfg.rollout.max_new_tokens),
            cfg.buffer.max_staleness, wf.stale_policy, wf.max_requeues, wf.episode_timeout_s)

    @property
    def exhausted(self) -> bool:
        return self.source.exhausted

    def produce(self, n: int) -> list:
        samples = self.source.next(n)
        return self.loop.run_until_complete(self._unless_stopped(
            self.runner.groups(samples, self.cfg.rollout.group_size, self.cfg.run.name)))

    async def _unless_stopped(self, work: Awaitable[list]) -> list:
        """``work``'s groups; none if the stop came first (the samples are not handed over:
        a resumed worker reads them again)."""
        task = asyncio.ensure_future(work)
        while not self.stop.is_set():
            done, _ = await asyncio.wait({task}, timeout=STOP_POLL_S)
            if done:
                return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return []

    def handed_over(self) -> None:
        self.source.save_state()

    def metrics(self) -> dict:
        reward = getattr(self.workflow, "reward", None)
        return {**self.runner.metrics(), **(reward.metrics() if reward is not None else {})}

    def close(self) -> None:
        reward = getattr(self.workflow, "reward", None)
        if reward is not None:
            reward.close()
        pending = asyncio.all_tasks(self.loop)  # e.g. an engine call of a stopped window
        for task in pending:
            task.cancel()
        if pending:
            self.loop.run_until_complete(asyncio.wait(pending))
        self.loop.close()


def make_producer(cfg: Config, engine, model_dir, index: int,
                  stop: threading.Event | None = None):
    if cfg.workflow.type == "digits":
        return DigitProducer(cfg, engine, index)
    return EpisodeProducer(cfg, engine, model_dir, index, stop)
