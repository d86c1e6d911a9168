"""Greedy evaluation on the task's fixed held-out prompts."""

from __future__ import annotations

import logging

from rollouters.engines.base import Engine
from rollouters.tasks.digits import Task

logger = logging.getLogger(__name__)


def evaluate(engine: Engine, task: Task, max_new_tokens: int, batch_size: int = 256
             ) -> dict[str, float | int]:
    """Exact-match and position accuracy of greedy completions on ``task.eval_prompts()``.

    Greedy, so the numbers depend only on the weights, not on sampling noise.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    prompts = task.eval_prompts()
    exact = 0
    position = 0.0
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        outputs = engine.generate([p.tokens for p in chunk], n=1, temperature=1.0,
                                  max_new_tokens=max_new_tokens, greedy=True)
        for prompt, (completion,) in zip(chunk, outputs):
            exact += task.exact(prompt, completion.tokens)
            position += task.reward(prompt, completion.tokens)
    count = len(prompts)
    metrics = {"eval/accuracy": exact / count if count else 0.0,
               "eval/position_accuracy": position / count if count else 0.0,
               "eval/n": count}
    logger.info("eval at version %d: %s", engine.version, metrics)
    return metrics
