"""Loss aggregation and the configured objective (policy loss + KL), by hand."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.config.schema import LearnerConfig, LossConfig
from learners.batching import TrainBatch
from learners.losses import aggregation_weights
from learners.losses.objective import objective

torch.set_num_threads(1)

# Two samples × 3 tokens, ratios r = exp(logp − logp_behaviour), ε = 0.2; hand-computed
# token-level PPO-clip sum in tests/unit/test_losses.py: −3.3 over 5 tokens.
CLIP_EPS = 0.2
RATIOS = [[1.5, 1.1, 0.5], [1.5, 0.5, math.exp(5.0)]]
MASK = [[1, 1, 1], [1, 1, 0]]
EXPECTED_LOSS_SUM = -2.4 - 2.2 - 1.0 + 1.5 + 0.8


# Aggregation batch: 4 rows in groups [0, 0, 1, 1]; the last row trains on nothing.
AGG_LOSS = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0],
                         [5.0, 6.0, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]])
AGG_MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
AGG_GROUPS = torch.tensor([0, 0, 1, 1])


@pytest.mark.parametrize("level,numerator,units", [
    ("token", 1 + 2 + 3 + 4 + 5 + 6, 6),            # every token counts once: 21 / 6
    ("sequence", 2.0 + 4.0 + 5.5, 3),               # row means 2, 4, 5.5; empty row not a unit
    ("group", (1 + 2 + 3 + 4) / 4 + (5 + 6) / 2, 2),  # group token means 2.5 and 5.5
])
def test_aggregation_literal(level: str, numerator: float, units: int) -> None:
    weights, count = aggregation_weights(AGG_MASK, AGG_GROUPS, level)
    assert (AGG_LOSS * weights).sum().item() == pytest.approx(numerator)
    assert count.item() == units


def _batch(logprobs: list[list[float]], advantages: list[list[float]]) -> TrainBatch:
    """A one-group batch with every position trained (only the objective's fields matter)."""
    b, t = len(logprobs), len(logprobs[0])
    ids = torch.zeros(b, t, dtype=torch.int64)
    return TrainBatch(input_ids=ids, attention_mask=ids + 1, targets=ids,
                      loss_mask=torch.ones(b, t, dtype=torch.bool),
                      behaviour_logprobs=torch.tensor(logprobs), versions=ids,
                      advantages=torch.tensor(advantages), rewards=torch.zeros(b),
                      min_versions=torch.zeros(b, dtype=torch.int64),
                      group_index=torch.zeros(b, dtype=torch.int64),
                      group_tokens=torch.full((b,), float(b * t)),
                      sample_mask=torch.ones(b, dtype=torch.bool))


def test_objective_kl_in_loss_k3_literal() -> None:
    # On-policy PPO (r = 1), A = [1, 1] → policy term −2, gradient −1 per token.
    # log(π/π_ref) = δ = [0.5, −0.5]: k3 = e^−δ − 1 + δ = [0.1065307, 0.1487213], β = 0.1;
    # d k3/d logp = 1 − e^−δ = [0.3934693, −0.6487213].
    cfg = LearnerConfig(loss=LossConfig(kl_coef=0.1, kl_estimator="k3"))
    batch = _batch([[-1.0, -2.0]], [[1.0, 1.0]])
    logprobs = batch.behaviour_logprobs.clone().requires_grad_(True)
    ref = batch.behaviour_logprobs - torch.tensor([[0.5, -0.5]])
    loss, units, stats = objective(cfg, batch, logprobs, ref_logprobs=ref)
    loss.backward()
    assert loss.item() == pytest.approx(-2.0 + 0.1 * (0.1065307 + 0.1487213), abs=1e-6)
    assert units.item() == 2
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.9606531, -1.0648721]]),
                               atol=1e-6, rtol=0)
    assert stats["kl_ref"].item() == pytest.approx((0.1065307 + 0.1487213) / 2, abs=1e-6)


def test_objective_kl_in_reward_k1_literal() -> None:
    # k1 = δ = [0.5, −0.5]; return-to-go [0.0, −0.5]; A ← A − β·rtg = [1.0, 1.05];
    # on-policy PPO: loss = −(1.0 + 1.05) = −2.05, no KL term in the loss.
    cfg = LearnerConfig(loss=LossConfig(kl_coef=0.1, kl_estimator="k1", kl_in_reward=True))
    batch = _batch([[-1.0, -2.0]], [[1.0, 1.0]])
    ref = batch.behaviour_logprobs - torch.tensor([[0.5, -0.5]])
    loss, _, _ = objective(cfg, batch, batch.behaviour_logprobs.clone(), ref_logprobs=ref)
    assert loss.item() == pytest.approx(-2.05, abs=1e-6)


def test_objective_default_is_ppo_clip_token_sum() -> None:
    behaviour = [[-1.0, -2.0, -0.5], [-3.0, -1.5, -2.0]]
    batch = _batch(behaviour, [[2.0] * 3, [-1.0] * 3])
    batch = TrainBatch(**{**batch.__dict__, "loss_mask": torch.tensor(MASK).bool()})
    logprobs = torch.tensor(behaviour) + torch.log(torch.tensor(RATIOS))
    loss, units, stats = objective(LearnerConfig(clip_eps=CLIP_EPS), batch, logprobs)
    assert loss.item() == pytest.approx(EXPECTED_LOSS_SUM, abs=1e-5)
    assert units.item() == 5 and stats["tokens"].item() == 5
    assert "kl_ref" not in stats
