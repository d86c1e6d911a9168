"""Step-wise advantages: broadcast and per_step modes with trajectory- and step-level rewards,
checked against hand-computed values, and their placement on the tokens of each step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncrl.config import ConfigError, load_config
from asyncrl.wire import TrajectoryGroup
from learners.batching import collate
from learners.losses.stepwise import (
    per_step_advantages,
    step_returns,
)


def test_step_returns_add_the_outcome_to_the_last_step() -> None:
    assert step_returns([0.5, 0.25], outcome=1.0) == [1.75, 1.25]
    assert step_returns([1.0, 0.0, 2.0], outcome=0.0, gamma=0.5) == [1.5, 1.0, 2.0]
    assert step_returns([], outcome=1.0) == []


def test_per_step_normalises_each_step_index_within_the_group() -> None:
    # two trajectories, two steps each; step rewards only (outcome 0)
    adv = per_step_advantages([[1.0, 0.0], [0.0, 1.0]], [0.0, 0.0], kind="dr_grpo")
    # returns: [1, 0] and [1, 1] -> step 0: both 1 -> 0, 0; step 1: 0 vs 1 -> -0.5, +0.5
    assert adv == [[0.0, -0.5], [0.0, 0.5]]
    grpo = per_step_advantages([[1.0, 0.0], [0.0, 1.0]], [0.0, 0.0], kind="grpo")
    assert grpo[0][1] == pytest.approx(-1.0, abs=1e-5) and grpo[1][1] == pytest.approx(1.0,
                                                                                       abs=1e-5)


def test_per_step_with_unequal_lengths_and_trajectory_rewards() -> None:
    # traj A: one step, outcome 1; traj B: two steps (0.5, 0), outcome 0; traj C: two steps
    adv = per_step_advantages([[0.0], [0.5, 0.0], [0.0, 0.0]], [1.0, 0.0, 0.0], kind="rloo")
    # step 0 returns: 1, 0.5, 0 -> rloo G/(G-1)(r - mean) = 1.5 * (r - 0.5)
    assert [a[0] for a in adv] == pytest.approx([0.75, 0.0, -0.75])
    # step 1 only B and C: returns 0, 0 -> 0
    assert adv[1][1] == 0.0 and adv[2][1] == 0.0


def _group() -> TrajectoryGroup:
    """Two 2-step samples: tokens [p p a a t a] and [p p a t a a] (p prompt, t tool)."""
    masks = [[0, 0, 1, 1, 0, 1], [0, 0, 1, 0, 1, 1]]
    samples = [{"tokens": list(range(6)), "logprobs": [-0.1] * 6, "loss_mask": m,
                "versions": [0 if x else -1 for x in m], "reward": r,
                "finish_reason": "stop"} for m, r in zip(masks, [1.0, 0.0])]
    return TrajectoryGroup.from_samples("g", "p", samples, metadata={
        "steps": [[[2, 4], [5, 6]], [[2, 3], [4, 6]]],
        "step_rewards": [[0.0, 1.0], [0.0, 0.0]], "outcome_rewards": [0.0, 0.0]})


def test_collate_places_step_advantages_on_each_steps_tokens() -> None:
    group = _group()
    per_step = collate([group], std_norm=False, pad_id=0, advantage="dr_grpo",
                       step_advantage="per_step")
    # returns: A [1, 1], B [0, 0] -> per step: A +0.5, B -0.5 on both steps; targets are shifted
    expected_a = np.array([0, 0.5, 0.5, 0, 0.5, 0], dtype=np.float32)  # token t+1's advantage
    expected_b = np.array([0, -0.5, 0, -0.5, -0.5, 0], dtype=np.float32)
    np.testing.assert_allclose(per_step.advantages[0].numpy(), expected_a)
    np.testing.assert_allclose(per_step.advantages[1].numpy(), expected_b)
    broadcast = collate([group], std_norm=False, pad_id=0, advantage="dr_grpo")
    # broadcast: one value per sample on every position (masked later by loss_mask)
    assert torch.all(broadcast.advantages[0][:5] == 0.5)
    on = per_step.loss_mask
    assert torch.equal(per_step.advantages[on], broadcast.advantages[on])  # same here: 1 step


def test_per_step_differs_from_broadcast_when_steps_differ() -> None:
    masks = [[0, 1, 0, 1], [0, 1, 0, 1]]
    samples = [{"tokens": [1, 2, 3, 4], "logprobs": [0.0] * 4, "loss_mask": m,
                "versions": [-1, 0, -1, 0], "reward": r, "finish_reason": "stop"}
               for m, r in zip(masks, [1.0, 1.0])]
    group = TrajectoryGroup.from_samples("g", "p", samples, metadata={
        "steps": [[[1, 2], [3, 4]]] * 2, "step_rewards": [[1.0, 0.0], [0.0, 1.0]],
        "outcome_rewards": [0.0, 0.0]})
    broadcast = collate([group], std_norm=False, pad_id=0, advantage="dr_grpo")
    assert float(broadcast.advantages.abs().sum()) == 0.0  # equal returns: no signal
    per_step = collate([group], std_norm=False, pad_id=0, advantage="dr_grpo",
                       step_advantage="per_step")
    # step 1 (second turn): 0 vs 1 -> -0.5 / +0.5 on the token at index 3 (target position 2)
    assert per_step.advantages[0, 2].item() == -0.5 and per_step.advantages[1, 2].item() == 0.5


def test_per_step_needs_a_group_estimator() -> None:
    with pytest.raises(ConfigError, match="step_advantage"):
        load_config(None, ["learner.loss.step_advantage=per_step",
                           "learner.loss.advantage=gae"])
