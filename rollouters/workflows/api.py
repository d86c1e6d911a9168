"""The workflow API: ``async def run_episode(engine, sample) -> Trajectory | None``.

A workflow is algorithm, not system: it sees an :class:`EpisodeEngine` (async, one prompt at a
time; the runner batches concurrent episodes into one engine call) and never imports an engine.
It returns one :class:`Trajectory` — every token of the episode, with the model's turns trained
on and everything else (prompt, environment and tool output) in the sequence but masked out of
the loss — or None to skip the sample.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from asyncrl.moe_routing import ROUTING, merge_routing, pad_routing
from asyncrl.wire.group import TrajectoryGroup
from asyncrl.wire.images import image_extras
from rollouters.engines.base import Completion
from rollouters.tasks.sample import Sample


class PromptTooLong(ValueError):
    """A sample's prompt is longer than ``data.max_prompt_tokens``: the episode is skipped and
    counted (``rollout/episodes_prompt_too_long``), never run on a cut prompt."""


@runtime_checkable
class EpisodeEngine(Protocol):
    """What a workflow may ask of the inference engine."""

    @property
    def version(self) -> int:
        """Policy version of the weights the engine holds now."""

    async def generate(self, tokens: list[int], max_new_tokens: int | None = None,
                       images: list[bytes] | None = None) -> Completion:
        """One sampled continuation of ``tokens`` (token ids in and out, with behaviour
        logprobs and the version of every generated token); ``images``: the prompt's, encoded,
        its ids already expanded (:mod:`asyncrl.vlm`)."""


class Workflow(Protocol):
    async def run_episode(self, engine: EpisodeEngine, sample: Sample) -> Trajectory | None: ...


@dataclass(frozen=True)
class Step:
    """One model turn: generated tokens ``[start, end)`` of the trajectory and its reward."""

    start: int
    end: int
    reward: float = 0.0


@dataclass
class Trajectory:
    """One episode as the learner sees it. ``reward`` is the trajectory-level (outcome) reward;
    step rewards live on :attr:`steps`; the return is their sum (:attr:`total_reward`)."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    reward: float = 0.0
    finish_reason: str = "stop"
    metadata: dict[str, Any] = field(default_factory=dict)
    routing: Any = None  # the experts of a prefix of the tokens (asyncrl.moe_routing), or None
    images: tuple[bytes, ...] = ()  # the prompt's images (encoded): the group carries them

    def add_context(self, tokens: Sequence[int]) -> None:
        """Prompt, environment or tool tokens: in the sequence, not trained on."""
        self.tokens.extend(tokens)
        self.logprobs.extend([0.0] * len(tokens))
        self.loss_mask.extend([0] * len(tokens))
        self.versions.extend([-1] * len(tokens))

    def add_turn(self, completion: Completion, reward: float = 0.0) -> Step:
        """A model turn: trained on, with its behaviour logprobs and per-token versions."""
        start = len(self.tokens)
        self.tokens.extend(completion.tokens)
        self.logprobs.extend(completion.logprobs)
        self.loss_mask.extend([1] * len(completion.tokens))
        self.versions.extend(completion.versions)
        self.steps.append(Step(start, len(self.tokens), reward))
        self.finish_reason = completion.finish_reason
        if completion.routing is not None:
            self.routing = merge_routing(self.routing, completion.routing)
        return self.steps[-1]

    @property
    def total_reward(self) -> float:
        return self.reward + sum(s.reward for s in self.steps)

    def min_version(self) -> int:
        generated = [v for v in self.versions if v >= 0]
        return min(generated) if generated else -1

    def as_sample(self) -> dict[str, Any]:
        """The per-sample dict :meth:`TrajectoryGroup.from_samples` takes."""
        sample = {"tokens": self.tokens, "logprobs": self.logprobs, "loss_mask": self.loss_mask,
                  "versions": self.versions, "reward": self.total_reward,
                  "finish_reason": self.finish_reason}
        if self.routing is not None:  # context added after the last turn: unrecorded
            sample["extras"] = {ROUTING: pad_routing(self.routing, len(self.tokens))}
        return sample


def group_from_trajectories(group_id: str, prompt_id: str, trajectories: list[Trajectory],
                            run_id: str = "") -> TrajectoryGroup:
    """One wire group; the step structure travels in the header's metadata (``steps``: token
    spans per sample, ``step_rewards``, ``outcome_rewards``), so no schema change is needed and
    single-step groups look exactly like the single-turn ones."""
    metadata = {
        "steps": [[[s.start, s.end] for s in t.steps] for t in trajectories],
        "step_rewards": [[s.reward for s in t.steps] for t in trajectories],
        "outcome_rewards": [t.reward for t in trajectories],
    }
    group = TrajectoryGroup.from_samples(group_id=group_id, prompt_id=prompt_id, run_id=run_id,
                                         samples=[t.as_sample() for t in trajectories],
                                         metadata=metadata)
    group.extras.update(image_extras(trajectories[0].images))  # one prompt: once a group
    return group


async def maybe_await(value: Any) -> Any:
    """User environments may be sync or async."""
    return await value if isinstance(value, Awaitable) else value
