"""Greedy validation on held-out prompts, reported as ``val/test_score/<task>``.

Digit tasks: exact-match accuracy of one batched call. Workflows (single-turn, multi-turn
agents, custom): the SAME workflow as training, one greedy episode per held-out sample, scored
by its return (the mean is the test score). :func:`make_evaluator` picks one from the config;
:class:`EngineEvaluator` is the learner's evaluator (``asyncrl eval`` on a checkpoint:
:mod:`asyncrl.eval_checkpoint`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.metrics import val_score_key
from rollouters.engines.base import Engine
from rollouters.tasks.digits import Task

if TYPE_CHECKING:
    from asyncrl.config import Config

logger = logging.getLogger(__name__)


def evaluate(engine: Engine, task: Task, max_new_tokens: int, batch_size: int = 256
             ) -> dict[str, float | int]:
    """Exact-match accuracy (``val/test_score/<task>``), position accuracy
    (``val/position_score/<task>``) and prompt count of greedy completions on
    ``task.eval_prompts()``, a set the training prompts never include.

    Greedy, so the numbers depend only on the weights, not on sampling noise.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    prompts = task.eval_prompts()
    exact = 0
    position = 0.0
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        images = [list(p.images) for p in chunk]
        outputs = engine.generate([p.tokens for p in chunk], n=1, temperature=1.0,
                                  max_new_tokens=max_new_tokens, greedy=True,
                                  **({"images": images} if any(images) else {}))
        for prompt, (completion,) in zip(chunk, outputs):
            exact += task.exact(prompt, completion.tokens)
            position += task.reward(prompt, completion.tokens)
    count = len(prompts)
    metrics = {val_score_key(task.name): exact / count if count else 0.0,
               f"val/position_score/{task.name}": position / count if count else 0.0,
               f"val/num_prompts/{task.name}": count}
    logger.info("eval at version %d: %s", engine.version, metrics)
    return metrics


def evaluate_workflow(engine: Engine, cfg: Config, tokenizer, seed: int = 0
                      ) -> dict[str, float | int]:
    """One greedy episode of the configured workflow per held-out sample (``[data]`` eval set,
    or the env's own). ``val/test_score/<task>`` is the mean return."""
    import asyncio

    from rollouters.workflows.batching import BatchingEngine
    from rollouters.workflows.factory import eval_samples, make_workflow
    from rollouters.workflows.runner import EpisodeRunner

    name, samples = eval_samples(cfg)
    workflow = make_workflow(cfg, tokenizer, seed)
    batching = BatchingEngine(engine, temperature=1.0, max_new_tokens=cfg.rollout.max_new_tokens,
                              greedy=True)
    runner = EpisodeRunner(workflow, batching, max_staleness=None,
                           episode_timeout_s=cfg.workflow.episode_timeout_s)

    async def run_all() -> list:
        return await asyncio.gather(*(runner.episode(s) for s in samples))

    loop = asyncio.new_event_loop()
    try:
        trajectories = loop.run_until_complete(run_all())
    finally:
        loop.close()
        reward = getattr(workflow, "reward", None)
        if reward is not None:
            reward.close()
    returns = [t.total_reward if t is not None else 0.0 for t in trajectories]
    count = len(samples)
    metrics = {val_score_key(name): sum(returns) / count if count else 0.0,
               f"val/success/{name}": sum(r >= 1.0 - 1e-6 for r in returns) / count
               if count else 0.0,
               f"val/num_prompts/{name}": count,
               f"val/failed_episodes/{name}": sum(t is None for t in trajectories)}
    logger.info("eval at version %d: %s", engine.version, metrics)
    return metrics


def make_evaluator(cfg: Config, model_dir: str | Path) -> Callable[[Engine], dict]:
    """``evaluator(engine) -> metrics`` for the configured task or workflow."""
    if cfg.workflow.type == "digits":
        from rollouters.tasks import make_task

        task = make_task(cfg.task, cfg.run.seed, cfg.model.tiny)
        return lambda engine: evaluate(engine, task, cfg.rollout.max_new_tokens)
    from asyncrl.models import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    return lambda engine: evaluate_workflow(engine, cfg, tokenizer, cfg.run.seed)


class EngineEvaluator:
    """The learner's periodic and final eval (:class:`asyncrl.evaluation.Evaluator`): each
    version's weights loaded into one CPU torch engine, scored by :func:`make_evaluator`."""

    def __init__(self, cfg: Config, model_dir: Path) -> None:
        from asyncrl.devices import resolve_device
        from asyncrl.models import load_causal_lm
        from asyncrl.tokens import special_tokens
        from asyncrl.vlm import image_processor_for
        from rollouters.engines.torch_engine import TorchEngine

        self._score = make_evaluator(cfg, model_dir)
        special = special_tokens(model_dir)
        device = resolve_device(cfg.eval.device, 0, "eval.device")
        self._engine = TorchEngine(load_causal_lm(model_dir, cfg.model.dtype, str(device)),
                                   eos_ids=special.eos_ids, pad_id=special.pad_id,
                                   device=device, image_processor=image_processor_for(model_dir))

    def evaluate(self, state: Mapping[str, Any], version: int) -> dict[str, float]:
        self._engine.load_weights(state.items(), version=version)
        return self._score(self._engine)
