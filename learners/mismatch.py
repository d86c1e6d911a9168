"""Train-vs-rollout logprob mismatch: what the engine thought it sampled vs what the learner
computes for the same tokens.

Per masked token, ``δ = logp_train − logp_rollout`` and the importance weight ``w = exp(δ)``.
Reported (namespaced ``mismatch/``):

- ``abs_logp``: ``mean |δ|``; ``kl_k1``: ``mean(−δ)`` and ``kl_k3``: ``mean(w − 1 − δ)``, both
  estimates of KL(rollout ‖ train) from rollout samples (k3 ≥ 0 per token, low variance);
- ``is_q01 … is_q99``, ``is_max``: quantiles of ``w``; ``clipped_frac``: fraction of tokens with
  ``w`` outside ``[1 − ε_low, 1 + ε_high]`` (where PPO's clip may zero the gradient);
  ``tokens``;
- with a rollout correction (``learner.loss.correction``, :mod:`learners.losses.correction`):
  ``masked_fraction``, the share of tokens its masks rejected, ``kept_tokens``, and
  ``correction_weight_mean``, the mean factor the kept tokens' loss was multiplied by. A step
  whose every token was rejected trains nothing: :func:`warn_if_all_rejected` says so.

On the first update after a weight sync ``δ`` is pure engine/trainer numerics (kernels,
dtypes); later it includes staleness. A large ``abs_logp`` means the off-policy correction is
doing real work, or that the engine and the trainer disagree on the model.

Across ranks: :func:`mismatch_sums` returns ONE float64 vector of sums and histogram counts;
all-reduce it (SUM) and :func:`mismatch_metrics` gives the global values, so W ranks report
what one rank would. Quantiles come from a histogram of ``δ`` rounded to a multiple of
``BIN_WIDTH`` (bins centred on 0, so on-policy tokens report exactly 1), exact to half a bin.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from learners.losses.correction import rollout_correction

if TYPE_CHECKING:
    from asyncrl.config.schema import CorrectionConfig

logger = logging.getLogger(__name__)

LOG_RANGE = 4.0            # histogram covers δ in [−4, 4]; beyond lands in the end bins
BIN_WIDTH = 0.01           # in log space: ~1% resolution on the weight
QUANTILES = (0.01, 0.1, 0.5, 0.9, 0.99)
_SCALARS = ("tokens", "abs_logp", "kl_k1", "kl_k3", "clipped_frac")
_HEAD = 8  # the scalars, the max δ, then the correction's rejected count and factor sum
_HALF_BINS = round(LOG_RANGE / BIN_WIDTH)
_NUM_BINS = 2 * _HALF_BINS + 1


def mismatch_sums(logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, clip_low: float,
                  clip_high: float, correction: CorrectionConfig | None = None,
                  policy_loss: str = "ppo_clip") -> Tensor:
    """``[tokens, Σ|δ|, Σ−δ, Σ(w−1−δ), Σclipped, max δ, Σrejected, Σfactor, histogram…]`` as
    float64 (no grad); the last two are 0 without a ``correction`` (the loss's, applied to a
    ``policy_loss``: the factor depends on it).

    Combine ranks with :func:`reduce_mismatch` (a SUM, except the max).
    """
    with torch.no_grad():
        rejected, factor = _correction_sums(logprobs, rollout_logprobs, mask, correction,
                                            policy_loss)
        on = mask.bool()
        delta = (logprobs - rollout_logprobs)[on].to(torch.float64)
        weight = torch.exp(delta)
        clipped = (weight < 1.0 - clip_low) | (weight > 1.0 + clip_high)
        bins = (torch.round(delta / BIN_WIDTH) + _HALF_BINS).clamp(0, _NUM_BINS - 1).long()
        hist = torch.bincount(bins, minlength=_NUM_BINS).to(torch.float64)
        top = delta.max() if delta.numel() else delta.new_tensor(-math.inf)
        head = torch.stack([delta.new_tensor(float(delta.numel())), delta.abs().sum(),
                            (-delta).sum(), (weight - 1.0 - delta).sum(),
                            clipped.to(torch.float64).sum(), top,
                            rejected, factor])
        return torch.cat([head, hist])


def _correction_sums(logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor,
                     correction: CorrectionConfig | None, policy_loss: str
                     ) -> tuple[Tensor, Tensor]:
    """Rejected tokens and the kept tokens' summed loss factor under ``correction`` (float64,
    on the device: no host sync per micro-batch)."""
    on = mask.to(torch.float64)
    if correction is None or (correction.is_level == "none" and correction.mask == "none"):
        return on.sum() * 0.0, on.sum()
    result = rollout_correction(correction, policy_loss, logprobs, rollout_logprobs, mask)
    keep, factor = result.keep.to(torch.float64), result.factor().to(torch.float64)
    return on.sum() - keep.sum(), (factor * on).sum()


def merge_mismatch_sums(total: Tensor | None, sums: Tensor) -> Tensor:
    """Combine two :func:`mismatch_sums` of one rank (micro-batches): add, except the max.
    ``total=None`` starts a sum."""
    if total is None:
        return sums
    merged = total + sums
    merged[5] = torch.maximum(total[5], sums[5])
    return merged


def reduce_mismatch(sums: Tensor) -> Tensor:
    """All-reduce :func:`mismatch_sums` over the default group: SUM, except the max. COLLECTIVE."""
    import torch.distributed as dist

    top = sums[5:6].clone()
    dist.all_reduce(sums)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    sums[5] = top[0]
    return sums


def mismatch_metrics(sums: Tensor) -> dict[str, float]:
    """Global ``mismatch/…`` metrics from (reduced) sums: means over tokens, weight quantiles.

    With no tokens every metric is 0 (and the weights' quantiles 1: no mismatch).
    """
    values = sums.tolist()
    tokens = values[0]
    denom = max(tokens, 1.0)
    metrics = {"mismatch/tokens": tokens}
    for i, name in enumerate(_SCALARS[1:], start=1):
        metrics[f"mismatch/{name}"] = values[i] / denom
    metrics["mismatch/is_max"] = math.exp(values[5]) if tokens else 1.0
    kept = tokens - values[6]
    metrics["mismatch/masked_fraction"] = values[6] / denom
    metrics["mismatch/kept_tokens"] = kept
    metrics["mismatch/correction_weight_mean"] = values[7] / kept if kept > 0 else 0.0
    # On the host: the histogram is a few hundred numbers (``tolist`` above already waited for
    # the device), and the quantiles' searchsorted takes a host scalar, which a CUDA
    # histogram refuses (every learner step on a GPU raised here).
    cumulative = torch.cumsum(sums[_HEAD:].cpu(), 0)
    for q in QUANTILES:
        metrics[f"mismatch/is_q{round(q * 100):02d}"] = _quantile(cumulative, q, tokens)
    return metrics


def _quantile(cumulative: Tensor, q: float, tokens: float) -> float:
    """Centre of the first bin whose cumulative count reaches ``q·tokens``, as a weight."""
    if tokens <= 0:
        return 1.0
    index = int(torch.searchsorted(cumulative, torch.tensor(q * tokens, dtype=torch.float64)))
    return math.exp((index - _HALF_BINS) * BIN_WIDTH)


def warn_if_all_rejected(metrics: dict[str, float]) -> bool:
    """Log a warning (and return True) when the rollout correction rejected every token of a
    step that had some: its gradient is zero and the step trains nothing."""
    if metrics.get("mismatch/tokens", 0.0) <= 0 or metrics.get("mismatch/kept_tokens", 1.0) > 0:
        return False
    logger.warning("learner.loss.correction rejected all %d tokens of this step (IS weight "
                   "p01 %.3f, p99 %.3f): it trains nothing; widen correction.mask_low/mask_high "
                   "or check the engine against the trainer",
                   int(metrics["mismatch/tokens"]), metrics.get("mismatch/is_q01", 1.0),
                   metrics.get("mismatch/is_q99", 1.0))
    return True


def warn_if_mismatched(metrics: dict[str, float], max_abs_logp: float) -> bool:
    """Log a warning (and return True) when ``mismatch/abs_logp`` exceeds ``max_abs_logp``."""
    value = metrics.get("mismatch/abs_logp", 0.0)
    if value <= max_abs_logp:
        return False
    logger.warning("train-vs-rollout mismatch: mean |Δlogp| %.4f > %.4f (k3 KL %.4f, IS weight "
                   "p99 %.3f, clipped %.1f%%): check engine/trainer dtypes and staleness",
                   value, max_abs_logp, metrics.get("mismatch/kl_k3", 0.0),
                   metrics.get("mismatch/is_q99", 1.0),
                   100 * metrics.get("mismatch/clipped_frac", 0.0))
    return True
