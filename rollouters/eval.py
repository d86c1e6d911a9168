"""Greedy validation on held-out prompts, reported as ``val/test_score/<task>``.

Digit tasks: exact-match accuracy of one batched call. Workflows (single-turn, multi-turn
agents, custom): the SAME workflow as training, one greedy episode per held-out sample, scored
by its return (the mean is the test score). :func:`make_evaluator` picks one from the config.
"""

from __future__ import annotations

import logging

from asyncrl.metrics import val_score_key
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

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
        outputs = engine.generate([p.tokens for p in chunk], n=1, temperature=1.0,
                                  max_new_tokens=max_new_tokens, greedy=True)
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

        task = make_task(cfg.task, cfg.run.seed)
        return lambda engine: evaluate(engine, task, cfg.rollout.max_new_tokens)
    from asyncrl.models import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    return lambda engine: evaluate_workflow(engine, cfg, tokenizer, cfg.run.seed)


def load_policy(cfg: Config, checkpoint: str | Path):
    """``(model, version, model_dir)`` from an HF model directory (``final/``, ``hf/step_V``) or
    a learner checkpoint (``checkpoints/step_V``, sharded DCP or DeepSpeed's: loaded into the
    initial model)."""
    import json

    from asyncrl.models import load_causal_lm, prepare_model_dir

    path = Path(checkpoint).expanduser()
    if (path / "config.json").is_file():
        version = int(path.name.rsplit("_", 1)[-1]) if path.name.startswith("step_") else -1
        return load_causal_lm(path, cfg.model.dtype), version, path
    meta_path = path / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    deepspeed = meta.get("format") == "deepspeed"
    if not deepspeed and not (path / ".metadata").is_file():
        from asyncrl.config import ConfigError

        raise ConfigError(f"--checkpoint {path}: neither an HF model directory "
                          "(config.json) nor a learner checkpoint (.metadata)")
    model_dir = prepare_model_dir(cfg.model, cfg.run_dir, cfg.run.seed)
    model = load_causal_lm(model_dir, cfg.model.dtype)
    if deepspeed:   # the optional dependency is needed only for such a checkpoint
        from learners.backends.deepspeed import checkpoint_weights

        model.load_state_dict(checkpoint_weights(path))
    else:
        model = _load_dcp(model, path, cfg.model.lora)
    return model, meta.get("version", -1), model_dir


def _load_dcp(model, path: Path, lora):
    """The actor of a sharded DCP checkpoint, as a plain HF model. A LoRA run
    (``model.lora.rank``) checkpointed the peft-wrapped model: the initial model is wrapped the
    same way, loaded, then merged (peft's ``merge_and_unload``, on local modules)."""
    import torch.distributed.checkpoint as dcp

    if lora.rank:
        from learners.lora import wrap_lora

        model = wrap_lora(model, lora)
    state = {"actor_model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(path))
    model.load_state_dict(state["actor_model"])
    return model.merge_and_unload() if lora.rank else model


def run_eval(cfg: Config, checkpoint: str | Path) -> dict[str, float | int]:
    """`asyncrl eval`: the periodic validation, alone, on the weights at ``checkpoint``."""
    import torch

    from asyncrl.models import EOS_ID, PAD_ID
    from rollouters.engines.torch_engine import TorchEngine

    torch.set_num_threads(cfg.rollout.threads)
    model, version, model_dir = load_policy(cfg, checkpoint)
    engine = TorchEngine(model, eos_id=EOS_ID, pad_id=PAD_ID, version=max(version, 0))
    return {"checkpoint": str(checkpoint), "version": version,
            **make_evaluator(cfg, model_dir)(engine)}
