"""Step-wise advantages for multi-step (agent) trajectories.

A trajectory has steps (model turns) with step-level rewards ``r_k`` and a trajectory-level
(outcome) reward ``R``. Two modes (``learner.loss.step_advantage``):

- ``broadcast``: the trajectory's return ``R + Σ_k r_k`` goes through the group estimator
  (GRPO, RLOO, ...) once, and that one advantage is given to every step's tokens. It is what a
  single-turn trajectory gets, and :func:`learners.batching.collate` does it by default.
- ``per_step``: each step ``k`` gets its own return-to-go ``G_k = Σ_{j≥k} γ^{j−k} r'_j``
  (``r'`` is ``r`` with ``R`` added to the last step), and the returns of step ``k`` across
  the group's trajectories (those that have a step ``k``) are normalised together by the
  estimator. A turn is then credited with what followed it, compared to the same turn of the
  other attempts at the same prompt; an early mistake no longer shares the credit of a good
  ending, nor the reverse.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from learners.losses.advantages import grpo_advantages, rloo_advantages

STEP_ADVANTAGES = ("broadcast", "per_step")
PER_STEP_ESTIMATORS = ("grpo", "dr_grpo", "rloo")


def step_returns(step_rewards: Sequence[float], outcome: float, gamma: float = 1.0
                 ) -> list[float]:
    """``G_k = Σ_{j≥k} γ^{j−k} r'_j`` with the outcome reward added to the last step."""
    rewards = list(step_rewards)
    if not rewards:
        return []
    rewards[-1] += outcome
    returns, running = [0.0] * len(rewards), 0.0
    for k in range(len(rewards) - 1, -1, -1):
        running = rewards[k] + gamma * running
        returns[k] = running
    return returns


def per_step_advantages(step_rewards: Sequence[Sequence[float]], outcomes: Sequence[float],
                        kind: str = "grpo", std_norm: bool = True, gamma: float = 1.0
                        ) -> list[list[float]]:
    """Advantages per step of each trajectory of ONE group (``[trajectory][step]``)."""
    if kind not in PER_STEP_ESTIMATORS:
        raise ValueError(f"step_advantage 'per_step' needs an advantage in "
                         f"{PER_STEP_ESTIMATORS}, got {kind!r}")
    returns = [step_returns(r, o, gamma) for r, o in zip(step_rewards, outcomes)]
    out = [[0.0] * len(r) for r in returns]
    for k in range(max((len(r) for r in returns), default=0)):
        members = [i for i, r in enumerate(returns) if len(r) > k]
        values = torch.tensor([returns[i][k] for i in members], dtype=torch.float64)
        if kind == "rloo":
            adv = rloo_advantages(values)
        else:
            adv = grpo_advantages(values, std_norm=std_norm and kind == "grpo")
        for i, a in zip(members, adv.tolist()):
            out[i][k] = a
    return out


def token_advantages(length: int, spans: Sequence[Sequence[int]], step_advantages: Sequence[float]
                     ) -> list[float]:
    """Per-token advantages of one sample: each step's value on its ``[start, end)`` span."""
    out = [0.0] * length
    for (start, end), value in zip(spans, step_advantages):
        out[start:end] = [value] * (end - start)
    return out
