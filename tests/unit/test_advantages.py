"""Advantage estimators against numbers worked out by hand."""

from __future__ import annotations

import pytest
import torch

from asyncrl.wire import TrajectoryGroup
from learners.batching import collate
from learners.losses import (
    batch_advantages,
    gae_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from learners.losses.advantages import outcome_token_rewards

torch.set_num_threads(1)


def test_rloo_literal() -> None:
    # r = [0, 1, 2, 5]: A_i = r_i − mean of the others, e.g. 0 − (1+2+5)/3 = −2.6667,
    # = 4/3 · (r − 2) = [−2.6667, −1.3333, 0, 4].
    torch.testing.assert_close(rloo_advantages(torch.tensor([0.0, 1.0, 2.0, 5.0])),
                               torch.tensor([-8 / 3, -4 / 3, 0.0, 4.0]))


@pytest.mark.parametrize("rewards", [[3.0], [1.0, 1.0, 1.0]])
def test_rloo_without_signal_is_zero(rewards: list[float]) -> None:
    assert torch.equal(rloo_advantages(torch.tensor(rewards)), torch.zeros(len(rewards)))


def test_reinforce_pp_literal() -> None:
    # Groups [1, 0] and [3, 3, 0] minus their means: x = [0.5, −0.5, 1, 1, −2] (batch mean 0);
    # population var = (0.25 + 0.25 + 1 + 1 + 4) / 5 = 1.3, std = 1.1401754; A = x / std.
    advantages = reinforce_pp_advantages([torch.tensor([1.0, 0.0]),
                                          torch.tensor([3.0, 3.0, 0.0])])
    expected = torch.tensor([0.4385290, -0.4385290, 0.8770580, 0.8770580, -1.7541160])
    torch.testing.assert_close(advantages, expected, atol=1e-5, rtol=0)   # + eps 1e-6 in std


def test_batch_advantages_dispatch_literal() -> None:
    groups = [torch.tensor([1.0, 0.0]), torch.tensor([2.0, 2.0, 5.0])]
    # grpo: [1, 0] → ±1 (pop. std 0.5); [2, 2, 5] → mean 3, std √2 → [−0.7071, −0.7071, 1.4142]
    torch.testing.assert_close(batch_advantages(groups, "grpo"),
                               torch.tensor([1.0, -1.0, -0.7071065, -0.7071065, 1.4142131]),
                               atol=1e-5, rtol=0)
    dr = torch.tensor([0.5, -0.5, -1.0, -1.0, 2.0])
    torch.testing.assert_close(batch_advantages(groups, "dr_grpo"), dr)
    torch.testing.assert_close(batch_advantages(groups, "grpo", std_norm=False), dr)
    # rloo: [1, 0] → 2·(±0.5) = ±1; [2, 2, 5] → 3/2 · [−1, −1, 2] = [−1.5, −1.5, 3]
    torch.testing.assert_close(batch_advantages(groups, "rloo"),
                               torch.tensor([1.0, -1.0, -1.5, -1.5, 3.0]))
    with pytest.raises(ValueError, match="unknown advantage"):
        batch_advantages(groups, "ppo")


def test_gae_literal() -> None:
    # Row 0: prompt position masked, outcome reward 1 on the last token, γ = 1, λ = 0.5,
    #   V = [·, 0.5, 0.6, 0.7]: δ3 = 1 − 0.7 = 0.3, δ2 = 0.7 − 0.6 = 0.1, δ1 = 0.6 − 0.5 = 0.1
    #   A3 = 0.3, A2 = 0.1 + 0.5·0.3 = 0.25, A1 = 0.1 + 0.5·0.25 = 0.225; returns A + V.
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[9.0, 0.5, 0.6, 0.7]])
    mask = torch.tensor([[0, 1, 1, 1]])
    advantages, returns = gae_advantages(rewards, values, mask, gamma=1.0, lam=0.5)
    torch.testing.assert_close(advantages, torch.tensor([[0.0, 0.225, 0.25, 0.3]]))
    torch.testing.assert_close(returns, torch.tensor([[0.0, 0.725, 0.85, 1.0]]))
    # λ = 1: Monte-Carlo, every return is the outcome 1.
    _, returns = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(returns, torch.tensor([[0.0, 1.0, 1.0, 1.0]]))


def test_gae_skips_unmasked_positions() -> None:
    # Middle position masked out (its reward 5 and value 9 ignored), γ = 0.9, λ = 1:
    # A2 = 1 − 0.4 = 0.6; A0 = (0 + 0.9·0.4 − 0.2) + 0.9·0.6 = 0.16 + 0.54 = 0.7.
    advantages, returns = gae_advantages(torch.tensor([[0.0, 5.0, 1.0]]),
                                         torch.tensor([[0.2, 9.0, 0.4]]),
                                         torch.tensor([[1, 0, 1]]), gamma=0.9, lam=1.0)
    torch.testing.assert_close(advantages, torch.tensor([[0.7, 0.0, 0.6]]))
    torch.testing.assert_close(returns, torch.tensor([[0.9, 0.0, 1.0]]))


def test_outcome_token_rewards_on_last_generated_position() -> None:
    # Rows: last masked position 3, 1, none.
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]])
    rewards = outcome_token_rewards(torch.tensor([2.0, -1.0, 7.0]), mask)
    assert rewards.tolist() == [[0, 0, 0, 2.0, 0], [0, -1.0, 0, 0, 0], [0] * 5]


def test_gae_advantages_are_zeros_in_collate_for_the_critic() -> None:
    assert batch_advantages([torch.tensor([1.0, 0.0])], "gae").tolist() == [0.0, 0.0]


def _group(group_id: str, rewards: list[float]) -> TrajectoryGroup:
    samples = [{"tokens": [1, 2, 3], "reward": r, "finish_reason": "stop",
                "logprobs": [0.0, -0.5, -0.5], "loss_mask": [0, 1, 1], "versions": [-1, 0, 0]}
               for r in rewards]
    return TrajectoryGroup.from_samples(group_id, group_id, samples)


def test_collate_uses_the_configured_estimator() -> None:
    # rloo on [1, 0] → ±1 and on [2, 2, 5] → [−1.5, −1.5, 3], on each sample's 2 positions.
    batch = collate([_group("a", [1.0, 0.0]), _group("b", [2.0, 2.0, 5.0])], std_norm=True,
                    pad_id=0, advantage="rloo")
    assert batch.advantages[:, :2].tolist() == [[1.0, 1.0], [-1.0, -1.0], [-1.5, -1.5],
                                                [-1.5, -1.5], [3.0, 3.0]]
    assert batch.advantages[:, 2].tolist() == [0.0] * 5
    assert batch.group_index.tolist() == [0, 0, 1, 1, 1]
