"""Rewards: exact match, math equivalence, sandboxed code execution, user functions by path.

:func:`make_reward` turns ``[reward]`` into a :class:`RewardScorer`; every reward is awaited
through it, so none can raise into, or stall, a rollout worker.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollouters.rewards.base import RewardError, RewardFn, RewardScorer
from rollouters.rewards.match import exact_match, extract_answer, math_equal

if TYPE_CHECKING:
    from asyncrl.config.schema import RewardConfig

__all__ = ["RewardError", "RewardFn", "RewardScorer", "exact_match", "extract_answer",
           "make_reward", "math_equal"]


def make_reward(cfg: RewardConfig) -> RewardScorer:
    """The scorer ``cfg.type`` names (a custom one is loaded from ``reward.path``)."""
    from asyncrl.plugins import load_callable

    fn: RewardFn
    if cfg.type == "exact":
        fn = exact_match
    elif cfg.type == "math":
        fn = math_equal
    elif cfg.type == "code":
        from rollouters.rewards.code import CodeReward
        from rollouters.rewards.sandbox import SandboxLimits

        fn = CodeReward(SandboxLimits(wall_s=cfg.code_wall_s, cpu_s=cfg.code_cpu_s,
                                      memory_mb=cfg.code_memory_mb,
                                      max_processes=cfg.code_max_processes), cfg.tests_field)
    elif cfg.type == "verl":
        from rollouters.rewards.verl import VerlReward

        fn = VerlReward(load_callable(cfg.path, "reward.path") if cfg.path else None)
    else:
        fn = load_callable(cfg.path, "reward.path")
    return RewardScorer(fn, cfg.timeout_s, name=cfg.type)
