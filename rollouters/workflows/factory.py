"""Build a workflow, its environments and its sample source from the config.

The one place that maps ``[workflow]``, ``[data]`` and ``[reward]`` to objects; user code
is loaded by import path with errors naming the config key.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.config import Config, ConfigError
from asyncrl.plugins import load_callable
from rollouters.tasks.sample import Sample
from rollouters.workflows.api import EpisodeEngine, Trajectory, Workflow


@dataclass
class WorkflowContext:
    """What a custom workflow factory is given."""

    cfg: Config
    tokenizer: Any
    seed: int


class _FunctionWorkflow:
    def __init__(self, fn: Callable) -> None:
        self.fn = fn

    async def run_episode(self, engine: EpisodeEngine, sample: Sample) -> Trajectory | None:
        return await self.fn(engine, sample)


def env_class(cfg: Config) -> Any:
    """The env class or factory ``workflow.env`` names (a built-in name or an import path)."""
    from rollouters.envs import BUILTIN_ENVS

    name = cfg.workflow.env
    if name in BUILTIN_ENVS:
        return BUILTIN_ENVS[name]
    if ":" not in name:
        raise ConfigError(f"workflow.env: {name!r} is neither a built-in env "
                          f"({', '.join(sorted(BUILTIN_ENVS))}) nor an import path "
                          "'pkg.module:Env'")
    return load_callable(name, "workflow.env")


def make_env_factory(cfg: Config, seed: int) -> Callable[[], Any]:
    """A callable making one fresh env per episode; envs taking ``rng`` get a seeded one."""
    cls = env_class(cfg)
    args = dict(cfg.workflow.env_args)
    master = random.Random(seed)
    try:
        wants_rng = "rng" in inspect.signature(cls).parameters
    except (TypeError, ValueError):
        wants_rng = False

    def make() -> Any:
        extra = {"rng": random.Random(master.getrandbits(64))} if wants_rng else {}
        try:
            return cls(**args, **extra)
        except TypeError as exc:
            raise ConfigError(f"workflow.env_args: {cfg.workflow.env!r} rejected {args}: "
                              f"{exc}") from None
    make()  # fail at start, not in the first episode
    return make


def make_workflow(cfg: Config, tokenizer: Any, seed: int) -> Workflow:
    wf = cfg.workflow
    if wf.type == "custom":
        obj = load_callable(wf.path, "workflow.path")
        if inspect.iscoroutinefunction(obj):
            return _FunctionWorkflow(obj)
        workflow = obj(WorkflowContext(cfg, tokenizer, seed))
        if not hasattr(workflow, "run_episode"):
            raise ConfigError(f"workflow.path: {wf.path!r} is neither an async "
                              "run_episode(engine, sample) nor a factory returning an object "
                              "with one")
        return workflow
    from rollouters.workflows.chat import ChatFormat

    def chat() -> ChatFormat:  # turns end at any of the model's EOS ids, as engines stop
        from asyncrl.tokens import special_tokens

        model = getattr(tokenizer, "name_or_path", "")
        return ChatFormat(tokenizer, special_tokens(model, tokenizer).eos_ids if model else None)

    if wf.type == "multi_turn":
        from rollouters.workflows.multi_turn import MultiTurnWorkflow

        return MultiTurnWorkflow(make_env_factory(cfg, seed), chat(),
                                 wf.tool_format, wf.max_turns, wf.system_prompt)
    if wf.type == "single_turn":
        from rollouters.rewards import make_reward
        from rollouters.workflows.single_turn import SingleTurnWorkflow

        images = None
        if cfg.data.image_field:   # a VLM's processor, saved beside the tokenizer
            from asyncrl.vlm import PromptImages

            images = PromptImages.of(getattr(tokenizer, "name_or_path", ""))
        return SingleTurnWorkflow(tokenizer, make_reward(cfg.reward),
                                  chat() if wf.chat_template else None,
                                  wf.system_prompt, cfg.data.max_prompt_tokens, images)
    raise ValueError(f"workflow.type {wf.type!r} has no episode workflow (digits use "
                     "rollouters.workflows.single_turn.generate_groups)")


def make_source(cfg: Config, index: int, workers: int, seed: int):
    """Training samples for rollout worker ``index`` of ``workers``."""
    from asyncrl.config.schema import DATA_POSITION_DIR
    from rollouters.tasks.data import DatasetSource, GeneratedSource, load_rows

    if cfg.data.path:
        if index >= workers:
            # Worker i of K reads the rows j with j % K == i. A worker past K (more started
            # by hand than rollout.workers counts, or a fleet joining with --first-index)
            # read another worker's rows, silently: the same samples over and over.
            raise ConfigError(f"rollout.workers = {workers} must count every rollout worker "
                              f"of the run, which shares data.path among them; this is "
                              f"worker {index}: set it to the whole fleet (e.g. --set "
                              f"rollout.workers={index + 1} or more)")
        rows = load_rows(cfg.data.path, cfg.data.format, cfg.data.split, data=cfg.data)
        return DatasetSource(rows, cfg.data, index, workers,
                             state_path=cfg.run_dir / DATA_POSITION_DIR / f"worker-{index}.json")
    generate = getattr(env_class(cfg), "samples", None) if cfg.workflow.env else None
    if generate is None:
        raise ConfigError("data.path: needed unless workflow.env generates its own samples")
    return GeneratedSource(generate, random.Random(seed), dict(cfg.workflow.env_args))


def eval_samples(cfg: Config) -> tuple[str, list[Sample]]:
    """The held-out set and the task name for ``val/test_score/<name>``."""
    from rollouters.tasks.data import load_rows, row_to_sample

    if cfg.data.eval_path:
        rows = load_rows(cfg.data.eval_path, cfg.data.format, cfg.data.split, "data.eval_path",
                         cfg.data)
        samples = [row_to_sample(r, i, cfg.data) for i, r in enumerate(rows)]
        name = cfg.data.name or Path(cfg.data.eval_path).stem
    else:
        generate = getattr(env_class(cfg), "eval_samples", None) if cfg.workflow.env else None
        if generate is None:
            raise ConfigError("data.eval_path: needed for validation unless workflow.env "
                              "provides eval_samples()")
        samples = generate(**cfg.workflow.env_args)
        name = cfg.data.name or cfg.workflow.env.rsplit(":", 1)[-1]
    if cfg.data.eval_size:
        samples = samples[:cfg.data.eval_size]
    return name, samples
