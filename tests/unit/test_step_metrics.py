"""verl-named step metrics (``learners.step_metrics``) on a hand-computed batch, 1-rank gloo.

Cross-rank reduction of the same figures is covered by the 1-vs-2-rank equality in
``test_fsdp2.py`` (every metric but the timing must match).
"""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.config.schema import LearnerConfig, LossConfig
from asyncrl.net import free_port
from learners.batching import TrainBatch
from learners.dist import init_learner_group, shutdown_learner_group
from learners.losses.objective import objective
from learners.step_metrics import step_metrics, token_entropy

RATIOS = [[1.5, 1.1, 0.5], [1.5, 0.5, math.exp(5.0)]]
MASK = [[1, 1, 1], [1, 1, 0]]
ADVANTAGES = [[2.0] * 3, [-1.0] * 3]


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    init_learner_group(0, 1, master_port=free_port())
    yield
    shutdown_learner_group()


def _batch() -> TrainBatch:
    behaviour = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.5, -2.0]])
    ids = torch.zeros(2, 3, dtype=torch.int64)
    return TrainBatch(input_ids=ids, attention_mask=ids + 1, targets=ids,
                      loss_mask=torch.tensor(MASK).bool(), behaviour_logprobs=behaviour,
                      versions=ids, advantages=torch.tensor(ADVANTAGES),
                      rewards=torch.tensor([1.0, 0.0]), min_versions=ids[:, 0],
                      group_index=ids[:, 0],
                      group_tokens=torch.full((2,), float(sum(map(sum, MASK)))),
                      sample_mask=torch.ones(2, dtype=torch.bool))


def test_verl_names_literal() -> None:
    batch = _batch()
    logprobs = batch.behaviour_logprobs + torch.log(torch.tensor(RATIOS))
    loss_sum, units, stats = objective(LearnerConfig(clip_eps=0.2), batch, logprobs)
    stats["entropy"] = torch.tensor(0.7)
    metrics = step_metrics(loss_sum, units, stats, batch)
    assert metrics["actor/loss"] == pytest.approx((-2.4 - 2.2 - 1.0 + 1.5 + 0.8) / 5, abs=1e-6)
    # Ratio mean over the 5 trained tokens (the masked e^5 does not count).
    assert metrics["actor/ppo_ratio_mean"] == pytest.approx((1.5 + 1.1 + 0.5 + 1.5 + 0.5) / 5)
    assert metrics["actor/clipfrac"] == pytest.approx(2 / 5)  # 1.5·2 and 0.5·(−1) are clipped
    assert metrics["actor/entropy"] == pytest.approx(0.7)
    assert metrics["critic/score/mean"] == metrics["critic/rewards/mean"] == 0.5
    assert metrics["critic/advantages/mean"] == pytest.approx((3 * 2.0 - 2 * 1.0) / 5)
    assert (metrics["critic/advantages/max"], metrics["critic/advantages/min"]) == (2.0, -1.0)
    assert metrics["response_length/mean"] == 2.5
    assert (metrics["response_length/max"], metrics["response_length/min"]) == (3.0, 2.0)
    assert metrics["perf/trained_tokens"] == 5


def test_rewards_after_kl_penalty() -> None:
    # k1 = log(π/π_ref) = 0.5 on every trained token, β = 0.1: penalties 0.15 and 0.1 per
    # sample, mean 0.125 taken off the score.
    cfg = LearnerConfig(loss=LossConfig(kl_coef=0.1, kl_estimator="k1", kl_in_reward=True))
    batch = _batch()
    logprobs = batch.behaviour_logprobs.clone()
    loss_sum, units, stats = objective(cfg, batch, logprobs, ref_logprobs=logprobs - 0.5)
    metrics = step_metrics(loss_sum, units, stats, batch)
    assert metrics["critic/score/mean"] == 0.5
    assert metrics["critic/rewards/mean"] == pytest.approx(0.5 - 0.125)
    assert metrics["actor/kl_loss"] == pytest.approx(0.5)


def test_nothing_trained_reports_zero_extremes() -> None:
    batch = TrainBatch(**{**_batch().__dict__, "loss_mask": torch.zeros(2, 3, dtype=torch.bool)})
    loss_sum, units, stats = objective(LearnerConfig(), batch, batch.behaviour_logprobs.clone())
    metrics = step_metrics(loss_sum, units, stats, batch)
    assert metrics["critic/advantages/max"] == metrics["critic/advantages/min"] == 0.0
    assert metrics["response_length/max"] == metrics["response_length/mean"] == 0.0


def test_a_masked_out_sample_has_no_length_and_keeps_its_score() -> None:
    """The second sample's loss mask zeroed, as ``drop_finish_reasons`` does to a truncated
    answer: it used to count as length 0 (min 0, the mean halved); its reward still counts."""
    batch = _batch()
    batch = TrainBatch(**{**batch.__dict__,
                          "loss_mask": torch.tensor([[1, 1, 1], [0, 0, 0]]).bool()})
    loss_sum, units, stats = objective(LearnerConfig(), batch, batch.behaviour_logprobs.clone())
    metrics = step_metrics(loss_sum, units, stats, batch)
    assert metrics["response_length/mean"] == metrics["response_length/min"] == 3.0
    assert metrics["response_length/max"] == 3.0
    assert metrics["critic/score/mean"] == 0.5


def test_token_entropy() -> None:
    uniform = torch.log_softmax(torch.zeros(1, 2, 8), dim=-1)
    torch.testing.assert_close(token_entropy(uniform), torch.full((1, 2), math.log(8)))
    certain = torch.log_softmax(torch.tensor([[[0.0, -1e4]]]), dim=-1)
    assert token_entropy(certain).item() == pytest.approx(0.0, abs=1e-6)
