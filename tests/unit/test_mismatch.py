"""Train-vs-rollout mismatch metrics against numbers worked out by hand."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from learners.mismatch import mismatch_metrics, mismatch_sums, warn_if_mismatched

torch.set_num_threads(1)

# δ = logp_train − logp_rollout on 4 trained tokens, plus a 5th untrained with δ = 5.
DELTA = [[0.0, 0.1, -0.2, 0.5, 5.0]]
MASK = [[1, 1, 1, 1, 0]]
ROLLOUT = [[-1.0, -2.0, -0.5, -3.0, -1.0]]


def _sums(mask: list[list[int]] = MASK) -> torch.Tensor:
    rollout = torch.tensor(ROLLOUT)
    return mismatch_sums(rollout + torch.tensor(DELTA), rollout, torch.tensor(mask), 0.2, 0.2)


def test_mismatch_literal() -> None:
    metrics = mismatch_metrics(_sums())
    assert metrics["mismatch/tokens"] == 4
    assert metrics["mismatch/abs_logp"] == pytest.approx((0.0 + 0.1 + 0.2 + 0.5) / 4, abs=1e-6)
    assert metrics["mismatch/kl_k1"] == pytest.approx(-(0.0 + 0.1 - 0.2 + 0.5) / 4, abs=1e-6)
    # w − 1 − δ: 0, e^0.1 − 1.1 = 0.0051709, e^−0.2 − 0.8 = 0.0187308, e^0.5 − 1.5 = 0.1487213
    assert metrics["mismatch/kl_k3"] == pytest.approx(
        (0.0051709 + 0.0187308 + 0.1487213) / 4, abs=1e-6)
    # w = [1, 1.105, 0.819, 1.649]: only 1.649 is outside [0.8, 1.2]
    assert metrics["mismatch/clipped_frac"] == pytest.approx(0.25)
    # sorted w = [e^−0.2, 1, e^0.1, e^0.5]; q01, q10 → 1st; q50 → 2nd; q90, q99 → 4th
    assert metrics["mismatch/is_q01"] == pytest.approx(math.exp(-0.2), abs=1e-5)
    assert metrics["mismatch/is_q10"] == pytest.approx(math.exp(-0.2), abs=1e-5)
    assert metrics["mismatch/is_q50"] == 1.0
    assert metrics["mismatch/is_q90"] == pytest.approx(math.exp(0.5), abs=1e-5)
    assert metrics["mismatch/is_q99"] == pytest.approx(math.exp(0.5), abs=1e-5)
    assert metrics["mismatch/is_max"] == pytest.approx(math.exp(0.5), abs=1e-5)


def test_sums_of_two_shards_equal_the_whole() -> None:
    """What ``reduce_mismatch`` does across ranks: SUM everything, MAX the max (index 5)."""
    left, right = _sums([[1, 1, 0, 0, 0]]), _sums([[0, 0, 1, 1, 0]])
    combined = left + right
    combined[5] = torch.maximum(left[5], right[5])
    assert mismatch_metrics(combined) == pytest.approx(mismatch_metrics(_sums()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_metrics_of_sums_on_cuda() -> None:
    """The learner's sums live on its device: the metrics must not mix CUDA and host tensors."""
    assert mismatch_metrics(_sums().cuda()) == pytest.approx(mismatch_metrics(_sums()))


def test_no_tokens() -> None:
    metrics = mismatch_metrics(_sums([[0, 0, 0, 0, 0]]))
    assert metrics["mismatch/tokens"] == 0 and metrics["mismatch/abs_logp"] == 0.0
    assert metrics["mismatch/is_q50"] == 1.0 and metrics["mismatch/is_max"] == 1.0


def test_warns_past_threshold(caplog: pytest.LogCaptureFixture) -> None:
    metrics = mismatch_metrics(_sums())     # abs_logp = 0.2
    with caplog.at_level(logging.WARNING, logger="learners.mismatch"):
        assert not warn_if_mismatched(metrics, 0.3)
        assert not caplog.records
        assert warn_if_mismatched(metrics, 0.1)
    assert "mismatch" in caplog.records[0].getMessage()
