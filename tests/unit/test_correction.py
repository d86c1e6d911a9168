"""Rollout correction (IS weights, rejection masks, IcePop) against numbers worked out by hand."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from pydantic import ValidationError

from asyncrl.config.schema import CorrectionConfig, LearnerConfig, LossConfig
from learners.losses.correction import rollout_correction
from learners.losses.objective import objective
from learners.mismatch import mismatch_metrics, mismatch_sums, warn_if_all_rejected

torch.set_num_threads(1)

# Two samples × 3 tokens; ρ = exp(logp_old − logp_rollout) chosen as round numbers. The last
# token of sample 1 is off the mask: its absurd ratio must count nowhere.
RATIOS = [[1.5, 1.1, 0.5],
          [3.0, 0.25, 100.0]]
MASK = [[1, 1, 1],
        [1, 1, 0]]
BEHAVIOUR = [[-1.0, -2.0, -0.5],
             [-0.7, -1.2, -3.0]]


def _logprobs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    behaviour = torch.tensor(BEHAVIOUR, dtype=torch.float64)
    old = behaviour + torch.log(torch.tensor(RATIOS, dtype=torch.float64))
    return old, behaviour, torch.tensor(MASK)


def _correct(policy_loss: str = "reinforce", **fields: object) -> tuple[list, list]:
    old, behaviour, mask = _logprobs()
    result = rollout_correction(CorrectionConfig(**fields), policy_loss, old, behaviour, mask)
    return result.factor().tolist(), result.keep.tolist()


def _close(got: list[list[float]], want: list[list[float]]) -> None:
    for row, expected in zip(got, want, strict=True):
        assert row == pytest.approx(expected, abs=1e-12)


def test_token_tis_truncates_each_token() -> None:
    factor, keep = _correct(is_level="token", is_cap=2.0)
    _close(factor, [[1.5, 1.1, 0.5], [2.0, 0.25, 0.0]])   # 3.0 capped at 2; off-mask 0
    assert keep == [[1, 1, 1], [1, 1, 0]]


def test_sequence_tis_is_the_truncated_product() -> None:
    # s0: 1.5 · 1.1 · 0.5 = 0.825; s1: 3 · 0.25 = 0.75 (the masked 100 is not in it).
    factor, _ = _correct(is_level="sequence", is_cap=2.0)
    _close(factor, [[0.825] * 3, [0.75, 0.75, 0.0]])
    factor, _ = _correct(is_level="sequence", is_cap=0.8)
    _close(factor, [[0.8] * 3, [0.75, 0.75, 0.0]])


def test_token_mask_rejects_outside_the_band_inclusive() -> None:
    # [0.45, 2]: 0.5 is kept, 3.0 and 0.25 are not.
    factor, keep = _correct(mask="token", mask_low=0.45, mask_high=2.0)
    assert keep == [[1, 1, 1], [0, 0, 0]]
    _close(factor, [[1, 1, 1], [0, 0, 0]])   # a mask without weights
    # The band is closed: [1, 1] keeps exactly the on-policy tokens.
    old = torch.tensor([[-1.0, -2.0]])
    on_policy = rollout_correction(CorrectionConfig(mask="token", mask_low=1.0, mask_high=1.0),
                                   "ppo_clip", old, old + torch.tensor([[0.0, 0.1]]),
                                   torch.ones(1, 2))
    assert on_policy.keep.tolist() == [[1.0, 0.0]]


def test_sequence_mask_uses_the_geometric_mean() -> None:
    # geometric means: s0 0.825^(1/3) = 0.9379, s1 0.75^(1/2) = 0.8660.
    _, keep = _correct(mask="sequence", mask_low=0.9, mask_high=1.1)
    assert keep == [[1, 1, 1], [0, 0, 0]]
    _, keep = _correct(mask="sequence", mask_low=0.8, mask_high=1.1)
    assert keep == [[1, 1, 1], [1, 1, 0]]
    # The product would reject s1 (0.75 < 0.8); the mean over its 2 tokens does not.
    assert 0.75 ** 0.5 > 0.8 > 0.75


def test_icepop_weights_kept_tokens_by_the_ratio() -> None:
    # M(ρ) = ρ inside [0.5, 2], 0 outside (IcePop), on a loss without ρ in it (reinforce).
    factor, keep = _correct("reinforce", mask="icepop", mask_low=0.45, mask_high=2.0)
    _close(factor, [[1.5, 1.1, 0.5], [0, 0, 0]])
    # ppo_clip's ratio π_θ/π_rollout already holds ρ: IcePop is then its mask alone.
    factor, keep2 = _correct("ppo_clip", mask="icepop", mask_low=0.45, mask_high=2.0)
    _close(factor, [[1, 1, 1], [0, 0, 0]])
    assert keep == keep2


def test_extreme_ratios_stay_finite() -> None:
    behaviour = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    old = torch.tensor([[-1.0 + 500.0, -1.0 - 500.0]], dtype=torch.float64)
    cfg = CorrectionConfig(is_level="sequence", is_cap=1e4)
    result = rollout_correction(cfg, "reinforce", old, behaviour, torch.ones(1, 2))
    assert torch.isfinite(result.weight).all()


def _batch_cfg(policy_loss: str, **correction: object) -> LearnerConfig:
    return LearnerConfig(loss=LossConfig(policy_loss=policy_loss,
                                         correction=CorrectionConfig(**correction)))


class _Batch:
    """The fields :func:`objective` reads: two samples, one group, token aggregation."""

    def __init__(self, advantages: list[float]) -> None:
        _, self.behaviour_logprobs, self.loss_mask = _logprobs()
        self.advantages = torch.tensor(advantages, dtype=torch.float64).unsqueeze(-1).expand(2, 3)
        self.group_index = torch.tensor([0, 0])
        self.group_tokens = None


def test_reinforce_with_token_tis_gradient_by_hand() -> None:
    # ℓ = −c·A·logp: d/dlogp = −c·A with c = min(ρ, 2) on masked tokens, 0 elsewhere.
    old, _, _ = _logprobs()
    logprobs = old.clone().requires_grad_(True)
    cfg = _batch_cfg("reinforce", is_level="token", is_cap=2.0)
    loss, units, stats = objective(cfg, _Batch([2.0, -1.0]), logprobs)
    loss.backward()
    _close(logprobs.grad.tolist(), [[-3.0, -2.2, -1.0], [2.0, 0.25, 0.0]])
    assert float(units) == 5
    assert float(stats["correction_masked_frac"]) == 0.0


def test_decoupled_ppo_takes_the_sequence_weight_instead_of_its_own() -> None:
    # Proximal = old: PPO's ratio is 1 (inside the clip), so d/dlogp = −w·A with w the
    # sequence weight (0.825, 0.75), not decoupled PPO's own min(ρ_t, tis_cap).
    old, _, _ = _logprobs()
    logprobs = old.clone().requires_grad_(True)
    cfg = _batch_cfg("decoupled_ppo", is_level="sequence", is_cap=2.0)
    loss, _, _ = objective(cfg, _Batch([1.0, 1.0]), logprobs, proximal_logprobs=old)
    loss.backward()
    _close(logprobs.grad.tolist(), [[-0.825] * 3, [-0.75, -0.75, 0.0]])


def test_a_mask_composes_with_every_policy_loss() -> None:
    old, _, _ = _logprobs()
    for kind in ("ppo_clip", "decoupled_ppo", "tis", "gspo", "reinforce"):
        logprobs = old.clone().requires_grad_(True)
        cfg = _batch_cfg(kind, mask="token", mask_low=0.45, mask_high=2.0)
        loss, _, stats = objective(cfg, _Batch([1.0, 1.0]), logprobs, proximal_logprobs=old)
        loss.backward()
        assert logprobs.grad[1].abs().sum() == 0, kind       # sample 1 rejected entirely
        assert logprobs.grad[0].abs().sum() > 0, kind
        assert float(stats["correction_masked_frac"]) == pytest.approx(2 / 5), kind


def test_all_tokens_rejected_trains_nothing_and_says_so(caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    old, behaviour, mask = _logprobs()
    logprobs = old.clone().requires_grad_(True)
    correction = CorrectionConfig(mask="token", mask_low=0.95, mask_high=1.05)
    cfg = LearnerConfig(loss=LossConfig(correction=correction))
    loss, _, stats = objective(cfg, _Batch([1.0, -1.0]), logprobs)
    loss.backward()
    assert float(loss.detach()) == 0.0 and logprobs.grad.abs().sum() == 0
    assert float(stats["correction_masked_frac"]) == 1.0
    metrics = mismatch_metrics(mismatch_sums(old, behaviour, mask, 0.2, 0.2, correction))
    assert metrics["mismatch/masked_fraction"] == 1.0
    assert metrics["mismatch/kept_tokens"] == 0.0
    with caplog.at_level(logging.WARNING, logger="learners.mismatch"):
        assert warn_if_all_rejected(metrics)
    assert "trains nothing" in caplog.text
    # A step with no token at all is not "all rejected": nothing to say.
    empty = mismatch_metrics(mismatch_sums(old, behaviour, torch.zeros_like(mask), 0.2, 0.2,
                                           correction))
    assert not warn_if_all_rejected(empty)


def test_mismatch_reports_the_masked_fraction_and_weights() -> None:
    old, behaviour, mask = _logprobs()
    correction = CorrectionConfig(mask="icepop", mask_low=0.45, mask_high=2.0)
    metrics = mismatch_metrics(mismatch_sums(old, behaviour, mask, 0.2, 0.2, correction,
                                             "reinforce"))
    assert metrics["mismatch/masked_fraction"] == pytest.approx(2 / 5)
    assert metrics["mismatch/kept_tokens"] == 3.0
    assert metrics["mismatch/correction_weight_mean"] == pytest.approx((1.5 + 1.1 + 0.5) / 3)
    # The quantiles of ρ over the 5 masked tokens: 0.25 .. 3.0, to half a 1 % bin.
    assert metrics["mismatch/is_q01"] == pytest.approx(0.25, rel=0.01)
    assert metrics["mismatch/is_max"] == pytest.approx(3.0)
    plain = mismatch_metrics(mismatch_sums(old, behaviour, mask, 0.2, 0.2))
    assert plain["mismatch/masked_fraction"] == 0.0 and plain["mismatch/kept_tokens"] == 5.0


@pytest.mark.parametrize("loss", ["ppo_clip", "tis", "gspo"])
def test_weights_on_a_loss_that_holds_the_ratio_are_refused(loss: str) -> None:
    with pytest.raises(ValidationError, match="correction.is_level"):
        LossConfig(policy_loss=loss, correction=CorrectionConfig(is_level="token"))


def test_icepop_with_weights_is_refused() -> None:
    with pytest.raises(ValidationError, match="correction.is_level"):
        CorrectionConfig(mask="icepop", is_level="token")
    assert math.isclose(CorrectionConfig().mask_high, 2.0)
