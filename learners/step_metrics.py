"""A training step's global metrics under verl's names (see ``asyncrl.metrics`` for the list).

Every rank holds only its shard of the batch, so every figure is reduced across ranks: sums
(then divided: token means over the GLOBAL trained tokens, sample means over the global
samples) and extremes (max), from ONE all-gather of both (``learners.dist.gather_rows``).
COLLECTIVE; the result is identical on every rank.
"""

from __future__ import annotations

import torch
from torch import Tensor

from learners.batching import TrainBatch
from learners.dist import gather_rows

# Objective / trainer stats that are means over trained tokens, and their reported names.
TOKEN_MEANS = {"clip_frac": "actor/clipfrac", "is_capped_frac": "actor/is_capped_frac",
               "kl_ref": "actor/kl_loss", "ratio_mean": "actor/ppo_ratio_mean",
               "entropy": "actor/entropy", "advantage_mean": "critic/advantages/mean"}


def step_metrics(loss_sum: Tensor, global_units: Tensor, stats: dict[str, Tensor],
                 batch: TrainBatch) -> dict[str, float]:
    """``actor/loss``, token means, ``critic/score|rewards/mean``, ``response_length/*``,
    ``critic/advantages/max|min`` and ``perf/trained_tokens`` of the global batch."""
    return reduce_metric_rows(gather_rows(metric_row(loss_sum, stats, batch)), global_units,
                              stats)


N_EXTREMES = 4  # the row ends with advantage max, -advantage min, length max, -length min


def metric_row(loss_sum: Tensor, stats: dict[str, Tensor], batch: TrainBatch) -> Tensor:
    """This rank's part of :func:`step_metrics`: its sums, then its extremes, as one row to
    gather. Separate so a backend that gathers something else in the same step can carry the
    row in that one collective (``learners.backends.sim``)."""
    tokens = stats["tokens"]
    zero = torch.zeros((), device=tokens.device)
    real = batch.sample_mask   # zero-weight pad rows are no samples
    lengths = batch.loss_mask[real].sum(-1).float()
    # Lengths of trained samples only: one masked out (drop_finish_reasons, a group that
    # trains no token) counted as length 0, and the truncated answers, the longest, pulled
    # the mean down and the min to 0. Scores stay over every sample.
    lengths = lengths[lengths > 0]
    sums = torch.stack([loss_sum.float(), tokens, *(stats[k] * tokens for k in _present(stats)),
                        batch.rewards[real].sum().float(), stats.get("kl_penalty_sum", zero),
                        lengths.sum(), torch.tensor(float(lengths.numel()), device=tokens.device),
                        real.sum().float()])
    inf = torch.tensor(float("inf"), device=tokens.device)
    extremes = torch.stack([stats.get("advantage_max", -inf), -stats.get("advantage_min", inf),
                            lengths.max() if lengths.numel() else -inf,
                            -lengths.min() if lengths.numel() else -inf])
    return torch.cat([sums.float(), extremes.float()])


def reduce_metric_rows(rows: Tensor, global_units: Tensor, stats: dict[str, Tensor]
                       ) -> dict[str, float]:
    """Every rank's :func:`metric_row` (``[world, n]``, same ``stats`` keys on every rank)
    reduced to the global metrics; the same on every rank."""
    sums, extremes = rows[:, :-N_EXTREMES].sum(0), rows[:, -N_EXTREMES:].max(0).values
    values, (adv_max, neg_adv_min, len_max, neg_len_min) = sums.tolist(), extremes.tolist()
    total_tokens, samples = max(values[1], 1.0), max(values[-1], 1.0)
    trained = max(values[-2], 1.0)  # samples with a trained token
    score = values[-5] / samples
    metrics = {"actor/loss": values[0] / max(float(global_units), 1.0),
               "perf/trained_tokens": values[1],
               **{TOKEN_MEANS[k]: values[2 + i] / total_tokens
                  for i, k in enumerate(_present(stats))},
               "critic/score/mean": score,
               "critic/rewards/mean": score - values[-4] / samples,
               "critic/advantages/max": _finite(adv_max),
               "critic/advantages/min": _finite(-neg_adv_min),
               "response_length/mean": values[-3] / trained,
               "response_length/max": _finite(len_max),
               "response_length/min": _finite(-neg_len_min)}
    return metrics


def _present(stats: dict[str, Tensor]) -> list[str]:
    """The token-mean stats this step has, in :data:`TOKEN_MEANS` order (the row's layout)."""
    return [k for k in TOKEN_MEANS if k in stats]


def _finite(value: float) -> float:
    """An extreme over nothing (±inf) reads as 0: no trained token, nothing to report."""
    return value if abs(value) != float("inf") else 0.0


@torch.no_grad()
def token_entropy(logprobs: Tensor) -> Tensor:
    """``H[b, t] = −Σ_v p·log p`` from full ``[B, T, V]`` log-probabilities (float32)."""
    return -(logprobs.exp() * logprobs).sum(-1)


__all__ = ["TOKEN_MEANS", "metric_row", "reduce_metric_rows", "step_metrics",
           "token_entropy"]
