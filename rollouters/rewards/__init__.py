"""Rewards: exact match, math equivalence, sandboxed code execution, user functions by path.

:func:`make_reward` turns ``[reward]`` into a :class:`RewardScorer`; every reward is awaited
through it, so none can raise into, or stall, a rollout worker. ``custom``, ``verl`` and
``math`` rewards run in a pool of processes (``reward.isolation = "process"``), killed when a
call hangs: user code can hang, and math-verify (sympy) on a model's answer can compute for as long as it likes
while holding the interpreter lock, which no thread timeout interrupts. ``exact`` (a regex and
a string compare) cannot hang and ``code`` kills its own sandboxed program: both run in the
worker.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollouters.rewards.base import RewardError, RewardFn, RewardScorer
from rollouters.rewards.match import exact_match, extract_answer, math_equal

if TYPE_CHECKING:
    from asyncrl.config.schema import RewardConfig

__all__ = ["RewardError", "RewardFn", "RewardScorer", "exact_match", "extract_answer",
           "make_reward", "math_equal", "user_path"]


MATH_PATH = "rollouters.rewards.match:math_equal"
MATH_PRELOAD = ("math_verify",)  # imported before a process takes calls: not a call's time
VERL_DEFAULT_PATH = "rollouters.rewards.verl:default_compute_score"
VERL_WRAP = "rollouters.rewards.verl:verl_reward"


def user_path(cfg: RewardConfig) -> str:
    """``reward.path`` when this reward type runs user code by it (``custom``, ``verl``), else
    empty: what the start checks import, and what :func:`make_reward` loads."""
    return cfg.path if cfg.type in ("custom", "verl") else ""


def make_reward(cfg: RewardConfig) -> RewardScorer:
    """The scorer ``cfg.type`` names (a custom one is loaded from ``reward.path``, here to
    check the path, and again in each pool process)."""
    from asyncrl.plugins import load_callable
    from rollouters.rewards.base import is_coroutine_fn
    from rollouters.rewards.pool import ProcessPool

    fn: RewardFn
    path = user_path(cfg) or {"math": MATH_PATH, "verl": VERL_DEFAULT_PATH}.get(cfg.type)
    wrap = VERL_WRAP if cfg.type == "verl" else ""  # verl's signature, adapted to ours
    if path is not None:
        fn = load_callable(path, "reward.path")
        if wrap:
            fn = load_callable(wrap, "reward.type")(fn)
        if cfg.isolation == "process":
            pool = ProcessPool(path, cfg.workers, is_coroutine_fn(fn), cfg.type,
                               preload=MATH_PRELOAD if cfg.type == "math" else (), wrap=wrap)
            return RewardScorer(fn, cfg.timeout_s, name=cfg.type, runner=pool)
    elif cfg.type == "exact":
        fn = exact_match
    else:
        from rollouters.rewards.code import CodeReward
        from rollouters.rewards.sandbox import SandboxLimits

        fn = CodeReward(SandboxLimits(wall_s=cfg.code_wall_s, cpu_s=cfg.code_cpu_s,
                                      memory_mb=cfg.code_memory_mb,
                                      max_processes=cfg.code_max_processes), cfg.tests_field)
    return RewardScorer(fn, cfg.timeout_s, name=cfg.type, workers=cfg.workers)
