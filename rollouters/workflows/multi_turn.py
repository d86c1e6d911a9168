"""Multi-turn agent episodes over an :class:`Env`: the model acts, the environment answers.

One episode is one trajectory: the prompt, then for each turn the model's tokens (trained,
with behaviour logprobs and per-token versions: weights may change between turns) and the
environment's reply rendered through the chat template (in the sequence, masked out of the
loss). A response that parses as a tool call (``workflow.tool_format``) is passed to the
environment with the parsed call and its reply is a ``tool`` message; otherwise a ``user`` one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from rollouters.tasks.sample import Sample
from rollouters.workflows.api import EpisodeEngine, Trajectory, maybe_await
from rollouters.workflows.chat import ChatFormat, ToolCall, ToolFormat, parse_tool_call


@dataclass(frozen=True)
class Action:
    """A model turn as the environment receives it."""

    text: str
    tool_call: ToolCall | None
    finish_reason: str


@dataclass(frozen=True)
class StepResult:
    observation: str
    reward: float
    done: bool
    info: dict[str, Any] | None = None


class Env(Protocol):
    """An environment for one episode (a fresh one per episode). Methods may be async.

    ``reset`` returns the first user message; ``step`` the reply to a model turn, that turn's
    reward (a step-level reward; 0 if the env scores only at the end) and whether it is over.
    """

    def reset(self, sample: Sample) -> str: ...

    def step(self, action: Action) -> StepResult: ...


class MultiTurnWorkflow:
    """The built-in agent loop. ``make_env()`` builds a fresh :class:`Env` per episode."""

    def __init__(self, make_env: Callable[[], Env], chat: ChatFormat, tool_format: ToolFormat,
                 max_turns: int, system_prompt: str = "") -> None:
        self.make_env, self.chat = make_env, chat
        self.tool_format, self.max_turns, self.system_prompt = tool_format, max_turns, system_prompt

    async def run_episode(self, engine: EpisodeEngine, sample: Sample) -> Trajectory | None:
        env = self.make_env()
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt \
            else []
        messages.append({"role": "user", "content": await maybe_await(env.reset(sample))})
        trajectory = Trajectory(metadata={"sample_id": sample.sample_id})
        trajectory.add_context(self.chat.prompt_tokens(messages))
        for _ in range(self.max_turns):
            completion = await engine.generate(trajectory.tokens)
            text = self.chat.decode_response(completion.tokens)
            call = parse_tool_call(text, self.tool_format)
            result: StepResult = await maybe_await(
                env.step(Action(text, call, completion.finish_reason)))
            trajectory.add_turn(completion, reward=float(result.reward))
            messages.append({"role": "assistant", "content": text})
            if result.done:
                break
            reply = {"role": "tool" if call is not None else "user",
                     "content": result.observation}
            trajectory.add_context(self.chat.continuation_tokens(messages, [reply]))
            messages.append(reply)
        else:
            trajectory.finish_reason = "max_turns"
        trajectory.metadata["turns"] = len(trajectory.steps)
        return trajectory
