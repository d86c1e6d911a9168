"""Single-turn workflow: one engine call for a batch of prompts, one group per prompt.

Engine-agnostic on purpose (only the :class:`Engine` protocol is used), so the same code feeds
the buffer whether the torch engine or vLLM produced the samples.
"""

from __future__ import annotations

import uuid
from typing import Any

from asyncrl.wire.group import TrajectoryGroup
from rollouters.engines.base import Completion, Engine
from rollouters.tasks.digits import Prompt, Task


def generate_groups(engine: Engine, task: Task, prompts: list[Prompt], group_size: int,
                    temperature: float, max_new_tokens: int, run_id: str = ""
                    ) -> list[TrajectoryGroup]:
    """``group_size`` scored samples for each prompt, as one :class:`TrajectoryGroup` each."""
    if not prompts:
        return []
    completions = engine.generate([p.tokens for p in prompts], n=group_size,
                                  temperature=temperature, max_new_tokens=max_new_tokens)
    return [
        TrajectoryGroup.from_samples(
            group_id=uuid.uuid4().hex, prompt_id=prompt.prompt_id, run_id=run_id,
            samples=[_sample(task, prompt, c) for c in group])
        for prompt, group in zip(prompts, completions)
    ]


def _sample(task: Task, prompt: Prompt, completion: Completion) -> dict[str, Any]:
    """One sample's arrays over prompt + completion; only completion tokens are trained on."""
    n_prompt, n_new = len(prompt.tokens), len(completion.tokens)
    return {
        "tokens": [*prompt.tokens, *completion.tokens],
        "logprobs": [0.0] * n_prompt + list(completion.logprobs),
        "loss_mask": [0] * n_prompt + [1] * n_new,
        "versions": [-1] * n_prompt + list(completion.versions),
        "reward": task.reward(prompt, completion.tokens),
        "finish_reason": completion.finish_reason,
    }
