"""Run a workflow's episodes for a rollout worker: G concurrent episodes per sample, one group.

Long episodes under staleness: an episode goes on across weight updates (its turns record
their own versions), but before each engine call it is checked; once its oldest token is more
than ``buffer.max_staleness`` versions behind the engine's current weights (which the learner
publishes right after loading them; :func:`asyncrl.staleness.is_fresh` says no), the learner
would drop the whole trajectory, so it is stopped now and, by ``workflow.stale_policy``,
dropped or restarted from its first turn (at most ``workflow.max_requeues`` times). Both are
counted. A workflow that raises or runs past ``workflow.episode_timeout_s`` loses that episode
(counted, logged with the sample id); the worker goes on.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import Counter

from asyncrl.staleness import NO_VERSION, is_fresh
from asyncrl.wire.group import TrajectoryGroup
from rollouters.engines.base import Completion
from rollouters.tasks.sample import Sample
from rollouters.workflows.api import (
    EpisodeEngine,
    PromptTooLong,
    Trajectory,
    Workflow,
    group_from_trajectories,
)

logger = logging.getLogger(__name__)


class StaleEpisode(Exception):
    pass


class _StalenessGuard:
    """The episode's view of the engine: refuses to extend a trajectory that is already stale."""

    def __init__(self, engine: EpisodeEngine, max_staleness: int | None) -> None:
        self.engine, self.max_staleness = engine, max_staleness
        self.oldest = NO_VERSION

    @property
    def version(self) -> int:
        return self.engine.version

    def check(self) -> None:
        if self.max_staleness is not None and \
                not is_fresh(self.engine.version, self.oldest, self.max_staleness):
            raise StaleEpisode(f"oldest token v{self.oldest}, engine v{self.engine.version}")

    async def generate(self, tokens: list[int], max_new_tokens: int | None = None,
                       images: list[bytes] | None = None) -> Completion:
        self.check()
        completion = await (self.engine.generate(tokens, max_new_tokens, images=images)
                            if images else self.engine.generate(tokens, max_new_tokens))
        if completion.versions:
            low = min(completion.versions)
            self.oldest = low if self.oldest < 0 else min(self.oldest, low)
        return completion


class EpisodeRunner:
    def __init__(self, workflow: Workflow, engine: EpisodeEngine, max_staleness: int | None,
                 stale_policy: str = "requeue", max_requeues: int = 2,
                 episode_timeout_s: float = 600.0) -> None:
        self.workflow, self.engine = workflow, engine
        self.max_staleness, self.stale_policy = max_staleness, stale_policy
        self.max_requeues, self.episode_timeout_s = max_requeues, episode_timeout_s
        self.counts: Counter[str] = Counter()

    async def groups(self, samples: list[Sample], group_size: int, run_id: str = ""
                     ) -> list[TrajectoryGroup]:
        groups = await asyncio.gather(*(self.group(s, group_size, run_id) for s in samples))
        return [g for g in groups if g is not None]

    async def group(self, sample: Sample, group_size: int, run_id: str = ""
                    ) -> TrajectoryGroup | None:
        results = await asyncio.gather(*(self.episode(sample) for _ in range(group_size)))
        trajectories = [t for t in results if t is not None]
        if not trajectories:
            self.counts["groups_empty"] += 1
            return None
        return group_from_trajectories(uuid.uuid4().hex, sample.sample_id, trajectories, run_id)

    async def episode(self, sample: Sample) -> Trajectory | None:
        attempts = 1 + (self.max_requeues if self.stale_policy == "requeue" else 0)
        for attempt in range(attempts):
            guard = _StalenessGuard(self.engine, self.max_staleness)
            try:
                trajectory = await asyncio.wait_for(
                    self.workflow.run_episode(guard, sample), self.episode_timeout_s)
                if trajectory is not None:
                    guard.oldest = trajectory.min_version()
                    guard.check()
                    self.counts["episodes"] += 1
                else:
                    self.counts["episodes_skipped"] += 1
                return trajectory
            except StaleEpisode as exc:
                requeue = attempt + 1 < attempts
                self.counts["episodes_requeued_stale" if requeue else
                            "episodes_dropped_stale"] += 1
                logger.info("episode of sample %s is stale (%s): %s", sample.sample_id, exc,
                            "restarting" if requeue else "dropped")
            except PromptTooLong as exc:
                if self.counts["episodes_prompt_too_long"] == 0:
                    logger.warning("%s: skipped (rollout/episodes_prompt_too_long)", exc)
                self.counts["episodes_prompt_too_long"] += 1
                return None
            except asyncio.TimeoutError:
                self.counts["episodes_timed_out"] += 1
                logger.warning("episode of sample %s ran past %.0f s: dropped",
                               sample.sample_id, self.episode_timeout_s)
                return None
            except Exception:  # user workflow/env code: lose the episode, not the worker
                self.counts["episodes_failed"] += 1
                if self.counts["episodes_failed"] <= 20:
                    logger.exception("episode of sample %s failed: dropped", sample.sample_id)
                return None
        return None

    def metrics(self) -> dict[str, int]:
        return {f"rollout/{k}": v for k, v in self.counts.items()}
