"""Single-turn workflows: one engine call per prompt.

:func:`generate_groups` is the digit tasks' fast path (one batched call for a window of
prompts). :class:`SingleTurnWorkflow` is the general one behind the workflow API: the sample's
prompt through the chat template (or raw), one response, scored by the configured reward.

Engine-agnostic on purpose (only the :class:`Engine` protocol is used), so the same code feeds
the buffer whether the torch engine or vLLM produced the samples.
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Any

from asyncrl.moe_routing import ROUTING
from asyncrl.vlm import IMAGE_MARK, PromptImages
from asyncrl.wire.group import TrajectoryGroup
from asyncrl.wire.images import image_extras
from rollouters.engines.base import Completion, Engine
from rollouters.rewards.base import RewardScorer
from rollouters.tasks.digits import Prompt, Task
from rollouters.tasks.sample import Sample
from rollouters.workflows.api import EpisodeEngine, PromptTooLong, Trajectory
from rollouters.workflows.chat import ChatFormat


def generate_groups(engine: Engine, task: Task, prompts: list[Prompt], group_size: int,
                    temperature: float, max_new_tokens: int, run_id: str = ""
                    ) -> list[TrajectoryGroup]:
    """``group_size`` scored samples for each prompt, as one :class:`TrajectoryGroup` each."""
    if not prompts:
        return []
    images = [list(p.images) for p in prompts]
    completions = engine.generate([p.tokens for p in prompts], n=group_size,
                                  temperature=temperature, max_new_tokens=max_new_tokens,
                                  **({"images": images} if any(images) else {}))
    groups = []
    for prompt, group in zip(prompts, completions):
        groups.append(TrajectoryGroup.from_samples(
            group_id=uuid.uuid4().hex, prompt_id=prompt.prompt_id, run_id=run_id,
            samples=[_sample(task, prompt, c) for c in group]))
        groups[-1].extras.update(image_extras(prompt.images))  # once a group: one prompt
    return groups


def _sample(task: Task, prompt: Prompt, completion: Completion) -> dict[str, Any]:
    """One sample's arrays over prompt + completion; only completion tokens are trained on."""
    n_prompt, n_new = len(prompt.tokens), len(completion.tokens)
    sample = {
        "tokens": [*prompt.tokens, *completion.tokens],
        "logprobs": [0.0] * n_prompt + list(completion.logprobs),
        "loss_mask": [0] * n_prompt + [1] * n_new,
        "versions": [-1] * n_prompt + list(completion.versions),
        "reward": task.reward(prompt, completion.tokens),
        "finish_reason": completion.finish_reason,
    }
    if completion.routing is not None:  # routing replay: prompt and completion, as the tokens
        sample["extras"] = {ROUTING: completion.routing}
    return sample


class SingleTurnWorkflow:
    """Prompt → one response → reward. ``chat=None`` encodes the prompt text as is."""

    def __init__(self, tokenizer: Any, reward: RewardScorer, chat: ChatFormat | None,
                 system_prompt: str = "", max_prompt_tokens: int | None = None,
                 images: PromptImages | None = None) -> None:
        self.tokenizer, self.reward, self.chat = tokenizer, reward, chat
        self.system_prompt = system_prompt
        self.max_prompt_tokens = max_prompt_tokens
        self.images = images   # a vision-language model's (data.image_field)

    def prompt_tokens(self, sample: Sample) -> list[int]:
        """The prompt's ids: chat messages (verl's layout) through the chat template, with
        ``workflow.system_prompt`` first unless they bring their own system message; a text
        prompt as a user message, or as it is with ``workflow.chat_template = false``. A
        prompt the tokenizer cannot encode is refused naming the sample (its row). Images
        (``data.image_field``) go where the text marks them, expanded as the model's processor
        expands them (:class:`asyncrl.vlm.PromptImages`)."""
        try:
            if not sample.images:
                return self._prompt_tokens(sample)
            if self.images is None:
                raise ValueError("data.image_field gave it images, and the model is not a "
                                 "vision-language model")
            return self.images.expand(self._prompt_tokens(self._marked(sample)), sample.images)
        except ValueError as exc:
            if str(exc).startswith("sample "):
                raise
            raise ValueError(f"sample {sample.sample_id} (data row id): {exc}") from None

    def _prompt_tokens(self, sample: Sample) -> list[int]:
        if sample.messages is not None:
            if self.chat is None:
                raise ValueError(f"sample {sample.sample_id}: its prompt is a list of chat "
                                 "messages, which workflow.chat_template = false cannot render")
            messages = sample.messages
            if self.system_prompt and not any(m["role"] == "system" for m in messages):
                messages = [{"role": "system", "content": self.system_prompt}, *messages]
            return self.chat.prompt_tokens(messages)
        if self.chat is None:
            from asyncrl.tokens import encode_strict

            return encode_strict(self.tokenizer, sample.prompt, add_special_tokens=True)
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt \
            else []
        return self.chat.prompt_tokens([*messages, {"role": "user", "content": sample.prompt}])

    def _marked(self, sample: Sample) -> Sample:
        """``sample`` with image placeholders where its text marks the images (else before
        the text of its first user message)."""
        count = len(sample.images)
        if sample.messages is None:
            return replace(sample, prompt=self.images.mark(sample.prompt, count))
        marked = any(IMAGE_MARK in m["content"] for m in sample.messages)
        first = next(i for i, m in enumerate(sample.messages) if m["role"] == "user")
        return replace(sample, messages=[
            {**m, "content": self.images.mark(m["content"], count, not marked and i == first)}
            for i, m in enumerate(sample.messages)])

    async def run_episode(self, engine: EpisodeEngine, sample: Sample) -> Trajectory | None:
        trajectory = Trajectory(metadata={"sample_id": sample.sample_id},
                                images=sample.images)
        prompt = self.prompt_tokens(sample)
        if self.max_prompt_tokens is not None and len(prompt) > self.max_prompt_tokens:
            raise PromptTooLong(f"sample {sample.sample_id}: {len(prompt)} prompt tokens > "
                                f"data.max_prompt_tokens = {self.max_prompt_tokens}")
        trajectory.add_context(prompt)
        completion = await (engine.generate(trajectory.tokens, images=list(sample.images))
                            if sample.images else engine.generate(trajectory.tokens))
        trajectory.add_turn(completion)
        text = self.tokenizer.decode(completion.tokens, skip_special_tokens=True)
        trajectory.reward = await self.reward.score(text, sample)
        return trajectory
