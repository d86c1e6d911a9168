"""Policy losses, aggregation, the objective and batching against numbers worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from asyncrl.wire import TrajectoryGroup
from learners.batching import collate
from learners.losses import (
    aggregation_weights,
    decoupled_ppo_token_loss,
    grpo_advantages,
    gspo_token_loss,
    ppo_clip_loss,
    reinforce_token_loss,
    tis_token_loss,
)

torch.set_num_threads(1)

CLIP_EPS = 0.2
# Two samples × 3 tokens. Ratios r = exp(logp − logp_behaviour) chosen as round numbers.
RATIOS = [[1.5, 1.1, 0.5],
          [1.5, 0.5, math.exp(5.0)]]     # last token is masked out: its huge ratio must not count
MASK = [[1, 1, 1],
        [1, 1, 0]]
ADVANTAGES = [2.0, -1.0]                 # sample 0 positive, sample 1 negative
# Per-token loss −min(r·A, clip(r, 0.8, 1.2)·A), by hand:
#   s0 (A=+2): r=1.5: min(3.0, 2.4) = 2.4 → −2.4  CLIPPED (clip wins, no gradient)
#              r=1.1: min(2.2, 2.2) = 2.2 → −2.2  inside the range
#              r=0.5: min(1.0, 1.6) = 1.0 → −1.0  unclipped branch is the pessimistic one
#   s1 (A=−1): r=1.5: min(−1.5, −1.2) = −1.5 → +1.5  unclipped
#              r=0.5: min(−0.5, −0.8) = −0.8 → +0.8  CLIPPED
EXPECTED_LOSS_SUM = -2.4 - 2.2 - 1.0 + 1.5 + 0.8   # = −3.3
EXPECTED_CLIP_FRAC = 2 / 5
# d(loss)/d(logp) = −r·A where unclipped, 0 where clipped or masked.
EXPECTED_GRAD = [[0.0, -1.1 * 2.0, -0.5 * 2.0],
                 [1.5, 0.0, 0.0]]
# mean |log r| = (ln1.5 + ln1.1 + ln2 + ln1.5 + ln2) / 5 = 2.292535 / 5
EXPECTED_MISMATCH = 0.4585070
# k3 = mean(r − 1 − ln r) = (0.094535 + 0.004690 + 0.193147 + 0.094535 + 0.193147) / 5
EXPECTED_KL_K3 = 0.1160108
EXPECTED_RATIO_MEAN = (1.5 + 1.1 + 0.5 + 1.5 + 0.5) / 5   # = 1.02


def test_ppo_clip_loss_matches_hand_computation() -> None:
    behaviour = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.5, -2.0]])
    logprobs = (behaviour + torch.log(torch.tensor(RATIOS))).requires_grad_(True)
    advantages = torch.tensor(ADVANTAGES).unsqueeze(1).expand(2, 3)
    loss, stats = ppo_clip_loss(logprobs, behaviour, advantages, torch.tensor(MASK).bool(),
                                CLIP_EPS)
    loss.backward()
    assert loss.item() == pytest.approx(EXPECTED_LOSS_SUM, abs=1e-5)
    torch.testing.assert_close(logprobs.grad, torch.tensor(EXPECTED_GRAD), atol=1e-5, rtol=0)
    assert stats["clip_frac"].item() == pytest.approx(EXPECTED_CLIP_FRAC)
    assert stats["mismatch_abs_logp"].item() == pytest.approx(EXPECTED_MISMATCH, abs=1e-6)
    assert stats["kl_k3"].item() == pytest.approx(EXPECTED_KL_K3, abs=1e-6)
    assert stats["ratio_mean"].item() == pytest.approx(EXPECTED_RATIO_MEAN, abs=1e-6)
    assert stats["tokens"].item() == 5
    assert all(not s.requires_grad for s in stats.values())


def test_ppo_clip_loss_on_policy_is_minus_advantage_sum() -> None:
    logprobs = torch.tensor([[-0.7, -1.2], [-2.0, -0.1]])
    advantages = torch.tensor([[0.5, 0.5], [-1.5, -1.5]])
    mask = torch.tensor([[1, 1], [0, 1]])
    loss, stats = ppo_clip_loss(logprobs, logprobs.clone(), advantages, mask, CLIP_EPS)
    assert loss.item() == pytest.approx(-(0.5 + 0.5 - 1.5))   # r = 1 everywhere
    assert stats["clip_frac"].item() == 0.0
    assert stats["mismatch_abs_logp"].item() == 0.0
    assert stats["kl_k3"].item() == 0.0
    assert stats["ratio_mean"].item() == pytest.approx(1.0)


def test_ppo_clip_loss_with_no_tokens_is_zero() -> None:
    logprobs = torch.zeros(1, 3)
    loss, stats = ppo_clip_loss(logprobs, logprobs - 1.0, torch.ones(1, 3), torch.zeros(1, 3),
                                CLIP_EPS)
    assert loss.item() == 0.0
    assert stats["tokens"].item() == 0.0 and stats["ratio_mean"].item() == 0.0


def test_grpo_advantages_literal() -> None:
    # mean 2, deviations [−2, −1, 0, 3], population var (4+1+0+9)/4 = 3.5, std 1.8708287
    rewards = torch.tensor([0.0, 1.0, 2.0, 5.0])
    expected = torch.tensor([-1.0690450, -0.5345225, 0.0, 1.6035675])
    torch.testing.assert_close(grpo_advantages(rewards), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(grpo_advantages(rewards, std_norm=False),
                               torch.tensor([-2.0, -1.0, 0.0, 3.0]))


@pytest.mark.parametrize("rewards", [[0.1, 0.1, 0.1], [1.0, 1.0], [3.0], [0.0] * 16])
@pytest.mark.parametrize("std_norm", [True, False])
def test_grpo_advantages_equal_rewards_are_exact_zeros(rewards: list[float],
                                                       std_norm: bool) -> None:
    advantages = grpo_advantages(torch.tensor(rewards), std_norm=std_norm)
    assert advantages.dtype == torch.float32
    assert torch.equal(advantages, torch.zeros(len(rewards)))


def _sample(tokens: list[int], prompt_len: int, logprobs: list[float], versions: list[int],
            reward: float) -> dict:
    """One sample: a prompt of ``prompt_len`` tokens, then generated tokens with their
    behaviour logprobs and versions."""
    gen = len(tokens) - prompt_len
    return {"tokens": tokens, "reward": reward, "finish_reason": "stop",
            "logprobs": [0.0] * prompt_len + logprobs,
            "loss_mask": [0] * prompt_len + [1] * gen,
            "versions": [-1] * prompt_len + versions}


def _groups() -> list[TrajectoryGroup]:
    first = TrajectoryGroup.from_samples("g0", "p0", [
        _sample([10, 11, 12, 13, 14], 2, [-0.1, -0.2, -0.3], [5, 6, 6], reward=1.0),
        _sample([20, 21, 22], 1, [-0.4, -0.5], [7, 7], reward=0.0)])
    second = TrajectoryGroup.from_samples("g1", "p1", [
        _sample([30, 31, 32, 33], 3, [-0.6], [8], reward=3.0),
        _sample([40, 41], 1, [-0.7], [9], reward=3.0)])
    return [first, second]


PAD = 99


def test_collate_layout_literal() -> None:
    batch = collate(_groups(), std_norm=True, pad_id=PAD)
    P = PAD
    assert batch.input_ids.tolist() == [[10, 11, 12, 13, 14], [20, 21, 22, P, P],
                                        [30, 31, 32, 33, P], [40, 41, P, P, P]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0],
                                             [1, 1, 1, 1, 0], [1, 1, 0, 0, 0]]
    # Position t predicts token t+1: everything per-token is shifted left by one.
    assert batch.targets.tolist() == [[11, 12, 13, 14, P], [21, 22, P, P, P],
                                      [31, 32, 33, P, P], [41, P, P, P, P]]
    assert batch.loss_mask.int().tolist() == [[0, 1, 1, 1, 0], [1, 1, 0, 0, 0],
                                              [0, 0, 1, 0, 0], [1, 0, 0, 0, 0]]
    torch.testing.assert_close(batch.behaviour_logprobs, torch.tensor(
        [[0.0, -0.1, -0.2, -0.3, 0.0], [-0.4, -0.5, 0.0, 0.0, 0.0],
         [0.0, 0.0, -0.6, 0.0, 0.0], [-0.7, 0.0, 0.0, 0.0, 0.0]]))
    assert batch.versions.tolist() == [[-1, 5, 6, 6, -1], [7, 7, -1, -1, -1],
                                       [-1, -1, 8, -1, -1], [9, -1, -1, -1, -1]]
    assert batch.min_versions.tolist() == [5, 7, 8, 9]
    assert batch.rewards.tolist() == [1.0, 0.0, 3.0, 3.0]
    # Group 0 rewards [1, 0] → ±1 (pop. std 0.5); group 1 all equal → 0. Only on positions
    # that predict something.
    torch.testing.assert_close(batch.advantages, torch.tensor(
        [[1.0, 1.0, 1.0, 1.0, 0.0], [-1.0, -1.0, 0.0, 0.0, 0.0],
         [0.0] * 5, [0.0] * 5]), atol=1e-5, rtol=0)
    assert batch.num_tokens == 7 and batch.num_samples == 4
    assert batch.group_index.tolist() == [0, 0, 1, 1]


def test_collate_behaviour_logprob_sits_where_its_token_is_predicted() -> None:
    groups = _groups()
    batch = collate(groups, std_norm=False, pad_id=PAD)
    rows = [(g, s) for g in groups for s in g.sample_slices()]
    for b, (group, sample) in enumerate(rows):
        tokens, logprobs = group.tokens[sample], group.logprobs[sample]
        for j in np.flatnonzero(group.loss_mask[sample]):
            # the logits at j−1 predict token j: its target, logprob and mask all live at j−1
            assert batch.input_ids[b, j - 1] == tokens[j - 1]
            assert batch.targets[b, j - 1] == tokens[j]
            assert batch.behaviour_logprobs[b, j - 1].item() == pytest.approx(logprobs[j])
            assert batch.loss_mask[b, j - 1]


def _logprobs_with_ratios(behaviour: list[list[float]], ratios: list[list[float]]
                          ) -> torch.Tensor:
    """Leaf logprobs ``behaviour + log(ratio)``, so that ``exp(logp − behaviour) = ratio``."""
    return (torch.tensor(behaviour) + torch.log(torch.tensor(ratios))).requires_grad_(True)


def test_ppo_clip_higher_literal() -> None:
    # Same batch as above with ε_high = 0.28 (DAPO): only the upper bound moves, to 1.28.
    #   s0 (A=+2): r=1.5 → min(3.0, 2.56) → −2.56 CLIPPED; r=1.1 → −2.2; r=0.5 → −1.0
    #   s1 (A=−1): r=1.5 → +1.5; r=0.5 → min(−0.5, −0.8) → +0.8 CLIPPED (lower bound unchanged)
    behaviour = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.5, -2.0]])
    logprobs = behaviour + torch.log(torch.tensor(RATIOS))
    advantages = torch.tensor(ADVANTAGES).unsqueeze(1).expand(2, 3)
    loss, stats = ppo_clip_loss(logprobs, behaviour, advantages, torch.tensor(MASK).bool(),
                                CLIP_EPS, clip_eps_high=0.28)
    assert loss.item() == pytest.approx(-2.56 - 2.2 - 1.0 + 1.5 + 0.8, abs=1e-5)   # −3.46
    assert stats["clip_frac"].item() == pytest.approx(2 / 5)


def test_decoupled_ppo_literal() -> None:
    # w = min(π_prox/μ, C=3) = [2, 0.5, 3 (capped from 4)]; r = π/π_prox = [1.0, 1.5, 0.9];
    # A = [1, 1, −2], ε = 0.2. ℓ = −w·min(r·A, clip(r)·A):
    #   t0: −2·min(1.0, 1.0) = −2.0          grad −w·r·A = −2.0
    #   t1: −0.5·min(1.5, 1.2) = −0.6 CLIPPED grad 0
    #   t2: −3·min(−1.8, −1.6) = +5.4         grad −3·0.9·(−2) = +5.4
    behaviour = torch.tensor([[-1.0, -2.0, -0.5]])
    proximal = behaviour + torch.log(torch.tensor([[2.0, 0.5, 4.0]]))
    logprobs = _logprobs_with_ratios(proximal.tolist(), [[1.0, 1.5, 0.9]])
    per_token, stats = decoupled_ppo_token_loss(
        logprobs, proximal, behaviour, torch.tensor([[1.0, 1.0, -2.0]]), torch.ones(1, 3),
        clip_low=0.2, clip_high=0.2, weight_cap=3.0)
    per_token.sum().backward()
    torch.testing.assert_close(per_token, torch.tensor([[-2.0, -0.6, 5.4]]).detach(),
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-2.0, 0.0, 5.4]]), atol=1e-5,
                               rtol=0)
    assert stats["clip_frac"].item() == pytest.approx(1 / 3)
    assert stats["is_capped_frac"].item() == pytest.approx(1 / 3)


def test_tis_literal() -> None:
    # r = [0.5, 1.0, 4.0], cap C = 2 → weight [0.5, 1.0, 2.0]; A = [2, −1, 1];
    # logp = [−1, −2, −0.25]: ℓ = −w·A·logp = [1.0, −2.0, 0.5]; grad −w·A = [−1, 1, −2].
    logprobs = torch.tensor([[-1.0, -2.0, -0.25]], requires_grad=True)
    behaviour = logprobs.detach() - torch.log(torch.tensor([[0.5, 1.0, 4.0]]))
    per_token, stats = tis_token_loss(logprobs, behaviour, torch.tensor([[2.0, -1.0, 1.0]]),
                                      torch.ones(1, 3), cap=2.0)
    per_token.sum().backward()
    torch.testing.assert_close(per_token.detach(), torch.tensor([[1.0, -2.0, 0.5]]),
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.0, 1.0, -2.0]]), atol=1e-5,
                               rtol=0)
    assert stats["clip_frac"].item() == pytest.approx(1 / 3)


def test_gspo_literal() -> None:
    # Row 0: δ = [0.0, 0.2] → s = exp(0.1) = 1.105171 ∈ [0.8, 1.2], A = +1: ℓ = −1.105171 per
    #        token; gradient per token −s·A = −1.105171 (token sum) or −s·A/2 (sequence mean).
    # Row 1: δ = [−0.3, masked 5.0] → s = exp(−0.3) = 0.740818 < 0.8, A = −1:
    #        min(−0.740818, −0.8) = −0.8 → ℓ = +0.8, CLIPPED (no gradient).
    behaviour = [[-1.0, -2.0], [-0.5, -3.0]]
    mask = torch.tensor([[1, 1], [1, 0]])
    logprobs = _logprobs_with_ratios(behaviour, [[1.0, math.exp(0.2)],
                                                 [math.exp(-0.3), math.exp(5.0)]])
    advantages = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    per_token, stats = gspo_token_loss(logprobs, torch.tensor(behaviour), advantages, mask,
                                       0.2, 0.2)
    weights, _ = aggregation_weights(mask, torch.tensor([0, 1]), "sequence")
    (per_token * weights).sum().backward()
    assert (per_token * mask).sum().item() == pytest.approx(-2 * 1.105171 + 0.8, abs=1e-5)
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.5525855, -0.5525855],
                                                            [0.0, 0.0]]), atol=1e-5, rtol=0)
    assert stats["clip_frac"].item() == pytest.approx(1 / 3)


def test_reinforce_literal() -> None:
    # ℓ = −A·logp: logp [−1, −2], A [3, −1] → [3, −2]; gradient −A = [−3, 1].
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    per_token, stats = reinforce_token_loss(logprobs, torch.tensor([[3.0, -1.0]]),
                                            torch.ones(1, 2))
    per_token.sum().backward()
    assert per_token.tolist() == [[3.0, -2.0]]
    assert logprobs.grad.tolist() == [[-3.0, 1.0]]
    assert stats["clip_frac"].item() == 0.0


def test_entropy_bonus_moves_the_gradient_towards_higher_entropy() -> None:
    """``−η·H`` in the loss: its gradient is the plain loss's minus ``η·∇H``, and a descent
    step on it raises the entropy where the plain loss alone would lower it."""
    from asyncrl.config.schema import LearnerConfig, LossConfig
    from learners.losses.objective import objective
    from learners.fused_logprobs import plain_logprobs_entropy

    def _entropy(logits: torch.Tensor, grad: bool = False) -> torch.Tensor:
        return plain_logprobs_entropy(logits, logits.argmax(-1), entropy_grad=grad)[1]

    torch.manual_seed(0)
    logits0 = torch.randn(1, 3, 5, dtype=torch.float64) * 2.0
    targets = logits0.argmax(-1)          # reinforce the likeliest tokens: entropy falls

    class Batch:
        behaviour_logprobs = torch.log_softmax(logits0, -1).gather(-1, targets[..., None])[..., 0]
        advantages = torch.ones(1, 3, dtype=torch.float64)
        loss_mask = torch.ones(1, 3)
        group_index = torch.tensor([0])
        group_tokens = None

    def step(coeff: float) -> tuple[torch.Tensor, float]:
        logits = logits0.clone().requires_grad_(True)
        logprobs = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
        entropy = _entropy(logits, grad=True)
        cfg = LearnerConfig(loss=LossConfig(policy_loss="reinforce", entropy_coeff=coeff))
        loss, _, _ = objective(cfg, Batch(), logprobs, entropy=entropy)
        loss.backward()
        after = _entropy(logits.detach() - 0.5 * logits.grad).sum().item()
        return logits.grad, after

    entropy_grad_logits = logits0.clone().requires_grad_(True)
    _entropy(entropy_grad_logits, grad=True).sum().backward()
    plain, plain_after = step(0.0)
    bonus, bonus_after = step(2.0)
    assert torch.allclose(bonus - plain, -2.0 * entropy_grad_logits.grad)
    before = _entropy(logits0).sum().item()
    assert plain_after < before < bonus_after
