"""KL estimators to the reference policy, against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from learners.losses import kl_estimate, kl_reward_to_go

torch.set_num_threads(1)

# log(π/π_ref) = δ per token
DELTA = [0.5, -0.5, 0.0, 2.0]


def _estimate(name: str) -> torch.Tensor:
    logprobs = torch.tensor([[-1.0, -2.0, -0.3, -0.1]])
    return kl_estimate(logprobs, logprobs - torch.tensor([DELTA]), name)


def test_k1_is_the_log_ratio() -> None:
    torch.testing.assert_close(_estimate("k1"), torch.tensor([DELTA]))


def test_k2_is_half_squared_log_ratio() -> None:
    # ½δ² = [0.125, 0.125, 0, 2]
    torch.testing.assert_close(_estimate("k2"), torch.tensor([[0.125, 0.125, 0.0, 2.0]]))


def test_k3_literal() -> None:
    # e^−δ − 1 + δ: e^−0.5 − 0.5 = 0.1065307, e^0.5 − 1.5 = 0.1487213, 0, e^−2 + 1 = 1.1353353
    torch.testing.assert_close(_estimate("k3"),
                               torch.tensor([[0.1065307, 0.1487213, 0.0, 1.1353353]]),
                               atol=1e-6, rtol=0)


def test_k3_is_finite_for_an_impossible_reference_token() -> None:
    value = kl_estimate(torch.tensor([-0.1]), torch.tensor([-1e4]), "k3")
    assert math.isfinite(value.item()) and value.item() > 0


def test_unknown_estimator_raises() -> None:
    with pytest.raises(ValueError, match="unknown KL estimator"):
        _estimate("k4")


def test_reward_to_go_literal() -> None:
    # Row 0, mask [0, 1, 1, 1], kl [9, 1, 2, 3]: rtg = [0, 6, 5, 3] (masked 9 never counts).
    # Row 1, mask [1, 1, 0, 0], kl [0.5, −0.25, 7, 7]: rtg = [0.25, −0.25, 0, 0].
    kl = torch.tensor([[9.0, 1.0, 2.0, 3.0], [0.5, -0.25, 7.0, 7.0]], requires_grad=True)
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]])
    rtg = kl_reward_to_go(kl, mask)
    assert rtg.tolist() == [[0.0, 6.0, 5.0, 3.0], [0.25, -0.25, 0.0, 0.0]]
    assert not rtg.requires_grad
