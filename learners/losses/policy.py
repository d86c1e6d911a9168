"""Policy losses: pure torch, PER-TOKEN (unreduced) losses ``[B, T]`` plus detached stats.

Every function returns ``(per_token, stats)``; :mod:`learners.losses.aggregation` turns
``per_token`` into the loss. ``stats["clip_frac"]`` is the fraction of masked tokens whose
gradient the clip (or truncation) zeroes or caps; ``stats["ratio_mean"]`` the token mean of the
ratio the loss uses (1 for REINFORCE, which has none). Notation: ``A`` the advantage, ``logp`` the
current (trained) logprob, ``logp_μ`` the behaviour (engine) logprob, ``logp_prox`` the
proximal logprob recomputed by the learner, ``clip(x) = clamp(x, 1 − ε_low, 1 + ε_high)``
(``ε_high > ε_low`` is DAPO's clip-higher: low-probability tokens may grow further).

The token-sum wrapper :func:`ppo_clip_loss` keeps the original API. Sums, never means: a mean
over a rank's own tokens would weight ranks equally whatever their token counts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from asyncrl.config.schema import LearnerConfig

POLICY_LOSSES = ("ppo_clip", "decoupled_ppo", "tis", "gspo", "reinforce")


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Detached float32 mean of ``values`` over ``mask`` (0 if the mask is empty)."""
    weights = mask.to(values.dtype)
    with torch.no_grad():
        return ((values * weights).sum() / weights.sum().clamp(min=1.0)).float()


def _clipped_surrogate(ratio: Tensor, advantages: Tensor, mask: Tensor, clip_low: float,
                       clip_high: float) -> tuple[Tensor, dict[str, Tensor]]:
    """``−min(ratio·A, clip(ratio)·A)`` per token; stats: the fraction where the clip is
    active and the mean ratio."""
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    return per_token, {"clip_frac": masked_mean((clipped < unclipped).to(ratio.dtype), mask),
                       "ratio_mean": masked_mean(ratio.detach(), mask)}


def ppo_clip_token_loss(logprobs: Tensor, behaviour_logprobs: Tensor, advantages: Tensor,
                        mask: Tensor, clip_low: float, clip_high: float | None = None
                        ) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO/GRPO clip against the behaviour policy: ``r = exp(logp − logp_μ)``,
    ``ℓ = −min(r·A, clip(r)·A)``. ``clip_high=None`` means symmetric (``= clip_low``).

    Follows PPO (Schulman et al. 2017, arXiv:1707.06347) as GRPO uses it (Shao et al. 2024,
    DeepSeekMath, arXiv:2402.03300); a ``clip_high`` above ``clip_low`` is DAPO's clip-higher
    (Yu et al. 2025, arXiv:2503.14476)."""
    ratio = torch.exp(logprobs - behaviour_logprobs)
    high = clip_low if clip_high is None else clip_high
    return _clipped_surrogate(ratio, advantages, mask, clip_low, high)


def decoupled_ppo_token_loss(logprobs: Tensor, proximal_logprobs: Tensor,
                             behaviour_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                             clip_low: float, clip_high: float, weight_cap: float,
                             weight: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Decoupled PPO (AReaL): clip against the PROXIMAL policy, correct for the behaviour one.

    ``w = min(exp(logp_prox − logp_μ), C)`` (detached), ``r = exp(logp − logp_prox)``,
    ``ℓ = −w·min(r·A, clip(r)·A)``. The trust region is centred on recent learner weights,
    not on a possibly several-versions-stale engine policy; ``w`` is the importance weight
    from the stale behaviour to the proximal policy, truncated at ``C`` for bounded variance.
    ``weight``: a behaviour weight to use instead of ``w`` (the rollout correction's,
    :mod:`.correction`); ``is_capped_frac`` still reports where ``w`` would be capped.

    Follows AReaL's decoupled objective (Fu et al. 2025, arXiv:2505.24298), itself from the
    decoupled PPO of Hilton et al. 2022 (arXiv:2110.00641).
    """
    ratio = torch.exp(logprobs - proximal_logprobs)
    raw_weight = torch.exp(proximal_logprobs - behaviour_logprobs).detach()
    if weight is None:
        weight = raw_weight.clamp(max=weight_cap)
    surrogate, stats = _clipped_surrogate(ratio, advantages, mask, clip_low, clip_high)
    stats["is_capped_frac"] = masked_mean((raw_weight > weight_cap).to(ratio.dtype), mask)
    return weight * surrogate, stats


def tis_token_loss(logprobs: Tensor, behaviour_logprobs: Tensor, advantages: Tensor,
                   mask: Tensor, cap: float) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance sampling policy gradient: ``ℓ = −sg(min(r, C))·A·logp``,
    ``r = exp(logp − logp_μ)``.

    Gradient ``−min(r, C)·A·∇logp``: below the cap it is exactly PPO's unclipped gradient
    ``−r·A·∇logp``; above it the weight is truncated, not zeroed (PPO would drop the token).
    The loss VALUE is only a gradient carrier (it is not a surrogate objective).

    The truncated importance weight is IMPALA's (Espeholt et al. 2018, arXiv:1802.01561); the
    stop-gradient form on ``logp`` is MiniMax-M1's CISPO (arXiv:2506.13585) with only the upper
    truncation.
    """
    ratio = torch.exp(logprobs - behaviour_logprobs).detach()
    weight = ratio.clamp(max=cap)
    stats = {"clip_frac": masked_mean((ratio > cap).to(ratio.dtype), mask),
             "ratio_mean": masked_mean(ratio, mask)}
    return -weight * advantages * logprobs, stats


def gspo_token_loss(logprobs: Tensor, behaviour_logprobs: Tensor, advantages: Tensor,
                    mask: Tensor, clip_low: float, clip_high: float
                    ) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: one length-normalised ratio per sequence (row), clipped as a whole.

    ``s_b = exp(Σ_t m·(logp − logp_μ) / n_b)`` (geometric mean of the token ratios), written
    per token as ``s_bt = sg(s_b)·exp(logp_t − sg(logp_t))`` (GSPO-token: value ``s_b``,
    gradient ``s_b·∇logp_t``), then ``ℓ = −min(s_bt·A, clip(s_bt)·A)``. With sequence
    aggregation this is GSPO's ``−(1/n_b)·Σ_t s_b·A·∇logp_t``. Token-level ratios are noisy
    (one token's mismatch can clip it); the sequence ratio averages the noise out, which is why
    GSPO's clip range is ~1e-3, not 0.2.

    Follows GSPO (Zheng et al. 2025, arXiv:2507.18071), its GSPO-token variant.
    """
    m = mask.to(logprobs.dtype)
    log_s = ((logprobs - behaviour_logprobs) * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    ratio = torch.exp(log_s.detach().unsqueeze(-1) + logprobs - logprobs.detach())
    return _clipped_surrogate(ratio, advantages, mask, clip_low, clip_high)


def reinforce_token_loss(logprobs: Tensor, advantages: Tensor, mask: Tensor
                         ) -> tuple[Tensor, dict[str, Tensor]]:
    """REINFORCE: ``ℓ = −A·logp``, no ratio, no clip (correct only on-policy). Williams
    1992, "Simple statistical gradient-following algorithms for connectionist reinforcement
    learning"."""
    return -advantages * logprobs, {"clip_frac": masked_mean(torch.zeros_like(logprobs), mask),
                                    "ratio_mean": masked_mean(torch.ones_like(logprobs), mask)}


def ppo_clip_loss(logprobs: Tensor, behaviour_logprobs: Tensor, advantages: Tensor,
                  mask: Tensor, clip_eps: float, clip_eps_high: float | None = None
                  ) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-level PPO-clip against the behaviour policy, SUMMED over ``mask`` (original API).

    ``ratio = exp(logp − logp_μ)``, ``loss = Σ_masked −min(ratio·A, clip(ratio)·A)``. Stats are
    DETACHED 0-dim float32 tensors, means over the masked tokens (0 if there are none):
    ``clip_frac``; ``mismatch_abs_logp`` = mean ``|logp − logp_μ|``; ``kl_k3`` =
    ``mean(ratio − 1 − log ratio)`` (k3 estimate of KL(μ ‖ π) from behaviour samples);
    ``ratio_mean``; ``tokens`` (the masked count, to turn means back into sums across ranks).
    """
    per_token, stats = ppo_clip_token_loss(logprobs, behaviour_logprobs, advantages, mask,
                                           clip_eps, clip_eps_high)
    weights = mask.to(logprobs.dtype)
    with torch.no_grad():
        log_ratio = logprobs - behaviour_logprobs
        ratio = torch.exp(log_ratio)
        stats.update(mismatch_abs_logp=masked_mean(log_ratio.abs(), mask),
                     kl_k3=masked_mean(ratio - 1.0 - log_ratio, mask),
                     ratio_mean=masked_mean(ratio, mask), tokens=weights.sum().float())
    return (per_token * weights).sum(), stats


def policy_token_loss(cfg: LearnerConfig, logprobs: Tensor, behaviour_logprobs: Tensor,
                      advantages: Tensor, mask: Tensor, proximal_logprobs: Tensor | None = None,
                      behaviour_weight: Tensor | None = None
                      ) -> tuple[Tensor, dict[str, Tensor]]:
    """The per-token loss named by ``cfg.loss.policy_loss`` (``decoupled_ppo`` needs
    ``proximal_logprobs``; ``behaviour_weight`` replaces its truncated weight).
    ``ε_low = cfg.clip_eps``, ``ε_high = cfg.loss.clip_eps_high``."""
    loss = cfg.loss
    low = cfg.clip_eps
    high = low if loss.clip_eps_high is None else loss.clip_eps_high
    kind = loss.policy_loss
    if kind == "ppo_clip":
        return ppo_clip_token_loss(logprobs, behaviour_logprobs, advantages, mask, low, high)
    if kind == "decoupled_ppo":
        if proximal_logprobs is None:
            raise ValueError("decoupled_ppo needs proximal_logprobs")
        return decoupled_ppo_token_loss(logprobs, proximal_logprobs, behaviour_logprobs,
                                        advantages, mask, low, high, loss.tis_cap,
                                        behaviour_weight)
    if kind == "tis":
        return tis_token_loss(logprobs, behaviour_logprobs, advantages, mask, loss.tis_cap)
    if kind == "gspo":
        return gspo_token_loss(logprobs, behaviour_logprobs, advantages, mask, low, high)
    if kind == "reinforce":
        return reinforce_token_loss(logprobs, advantages, mask)
    raise ValueError(f"unknown policy loss {kind!r}; expected one of {POLICY_LOSSES}")
