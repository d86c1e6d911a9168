"""The configured objective on one rank's batch: policy loss + KL to the reference, aggregated.

``loss = Σ_{b,t} w_bt·(c_bt·ℓ_bt + β·kl_bt − η·H_bt) / U`` where ``ℓ`` is the configured
per-token policy loss (:mod:`.policy`), ``c`` the rollout correction's factor (importance weight
times rejection mask, :mod:`.correction`; 1 when off), ``w`` and the unit count ``U`` come from
the aggregation level (:mod:`.aggregation`), the KL term is present only with ``kl_coef > 0``
and not ``kl_in_reward``, and ``H`` is the token entropy of π_θ, with ``η = entropy_coeff``
(verl's entropy bonus: minimising ``−η·H`` raises the entropy; 0 is off). With
``kl_in_reward`` the advantage becomes ``A_t − β·Σ_{s≥t} kl_s`` instead.
This module returns the numerator and the LOCAL ``U``; the trainer divides by the global one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from learners.losses.aggregation import aggregate, aggregation_weights
from learners.losses.correction import (
    correction_stats,
    replaces_loss_weight,
    rollout_correction,
)
from learners.losses.kl import kl_estimate, kl_reward_to_go
from learners.losses.policy import masked_mean, policy_token_loss

if TYPE_CHECKING:
    from asyncrl.config.schema import LearnerConfig
    from learners.batching import TrainBatch


def objective(cfg: LearnerConfig, batch: TrainBatch, logprobs: Tensor,
              proximal_logprobs: Tensor | None = None, ref_logprobs: Tensor | None = None,
              entropy: Tensor | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """``(Σ w·(c·ℓ + β·kl − η·H), local units, stats)``; stats are detached token means,
    ``tokens``, the advantages' extremes, with a correction its masked share and mean factor,
    and with ``kl_in_reward`` ``kl_penalty_sum`` (``β·Σ kl`` over all samples, the reward the KL
    took away). ``ref_logprobs`` is required when ``cfg.loss.kl_coef > 0``; ``entropy`` (per
    token, differentiable) when ``cfg.loss.entropy_coeff > 0``."""
    loss = cfg.loss
    mask = batch.loss_mask
    advantages = batch.advantages
    stats: dict[str, Tensor] = {}
    kl = None
    if loss.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs the reference model's logprobs")
        kl = kl_estimate(logprobs, ref_logprobs, loss.kl_estimator)
        stats["kl_ref"] = masked_mean(kl.detach(), mask)
        if loss.kl_in_reward:
            advantages = advantages - loss.kl_coef * kl_reward_to_go(kl, mask)
            stats["kl_penalty_sum"] = loss.kl_coef * (kl.detach() * mask).sum().float()
    per_token, policy_stats = _corrected_policy_loss(cfg, batch, logprobs, advantages,
                                                     proximal_logprobs)
    stats.update(policy_stats)
    if kl is not None and not loss.kl_in_reward:
        per_token = per_token + loss.kl_coef * kl
    if loss.entropy_coeff > 0:
        if entropy is None:
            raise ValueError("entropy_coeff > 0 needs the per-token entropy")
        per_token = per_token - loss.entropy_coeff * entropy
    weights, units = aggregation_weights(mask, batch.group_index, loss.aggregation,
                                         batch.group_tokens)
    stats["tokens"] = mask.sum().float()
    stats.update(_advantage_stats(advantages.detach(), mask))
    return aggregate(per_token, weights), units, stats


def _corrected_policy_loss(cfg: LearnerConfig, batch: TrainBatch, logprobs: Tensor,
                           advantages: Tensor, proximal_logprobs: Tensor | None
                           ) -> tuple[Tensor, dict[str, Tensor]]:
    """The policy loss times the rollout correction's factor (:mod:`.correction`), if any."""
    correction_cfg, mask = cfg.loss.correction, batch.loss_mask
    if correction_cfg.is_level == "none" and correction_cfg.mask == "none":
        return policy_token_loss(cfg, logprobs, batch.behaviour_logprobs, advantages, mask,
                                 proximal_logprobs)
    old = proximal_logprobs if proximal_logprobs is not None else logprobs.detach()
    correction = rollout_correction(correction_cfg, cfg.loss.policy_loss, old,
                                    batch.behaviour_logprobs, mask)
    own_weight = cfg.loss.policy_loss == "decoupled_ppo" and replaces_loss_weight(correction_cfg)
    per_token, stats = policy_token_loss(cfg, logprobs, batch.behaviour_logprobs, advantages,
                                         mask, proximal_logprobs,
                                         behaviour_weight=correction.weight if own_weight
                                         else None)
    factor = correction.keep if own_weight else correction.factor()
    stats.update(correction_stats(correction, mask))
    return per_token * factor, stats


def _advantage_stats(advantages: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Mean, max and min of the advantages the loss used, on trained tokens (±inf if none)."""
    trained = mask.bool()
    inf = torch.tensor(float("inf"), device=advantages.device)
    return {"advantage_mean": masked_mean(advantages, mask),
            "advantage_max": torch.where(trained, advantages, -inf).max().float(),
            "advantage_min": torch.where(trained, advantages, inf).min().float()}
