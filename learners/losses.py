"""Advantages and the policy loss: pure torch, no distributed code.

The loss returns a token SUM, not a mean. A mean over a rank's own tokens would weight each rank
equally whatever its token count, so two ranks would not reproduce one rank on the whole batch;
the caller divides by the global token count instead (see ``learners.backends.fsdp2``).
"""

from __future__ import annotations

import torch
from torch import Tensor


def grpo_advantages(rewards: Tensor, std_norm: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO group-normalised advantages for the ``G`` samples of one prompt.

    ``(r − mean) / (std + eps)`` with the POPULATION std (``unbiased=False``): it is defined for
    ``G = 1`` (0, so the advantage is 0) where the sample std is NaN. With ``std_norm=False`` it is
    just ``r − mean`` (Dr. GRPO: the std rescales easy and hard prompts differently).

    A group whose rewards are all equal gets exact zeros: it carries no signal, and rounding in
    ``mean`` would otherwise leave ~1e-8 residues that ``/ eps`` blows up to ~1e-2.
    Computed in float64, returned in the rewards' floating dtype (float32 for integer input).
    """
    r = rewards.to(torch.float64)
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    if r.numel() == 0 or bool(r.max() == r.min()):
        return torch.zeros_like(r, dtype=out_dtype)
    centered = r - r.mean()
    if std_norm:
        centered = centered / (r.std(unbiased=False) + eps)
    return centered.to(out_dtype)


def ppo_clip_loss(logprobs: Tensor, behaviour_logprobs: Tensor, advantages: Tensor,
                  mask: Tensor, clip_eps: float) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-level PPO-clip against the behaviour (rollout engine) policy.

    Per token: ``ratio = exp(logp − logp_behaviour)`` and
    ``loss = −min(ratio·A, clip(ratio, 1−ε, 1+ε)·A)``. Returns the SUM over tokens where
    ``mask`` is set (all inputs broadcast to ``logprobs``' shape, usually ``[B, T]``).

    Stats are DETACHED 0-dim float32 tensors (not floats, so a trainer can all-reduce them
    without a host sync per stat), each a mean over the masked tokens (0 if there are none):

    - ``clip_frac``: fraction of tokens where the clipped branch is the active minimum
      (the gradient is zero there).
    - ``mismatch_abs_logp``: mean ``|logp − logp_behaviour|``, the train-vs-rollout logprob gap
      (pure engine/trainer mismatch on the first update after a sync, policy drift after).
    - ``kl_k3``: ``mean(ratio − 1 − log ratio)``, Schulman's k3 estimate of
      KL(behaviour ‖ current) from behaviour samples; ≥ 0 per token.
    - ``ratio_mean``: mean importance ratio (≈ 1 when on-policy).
    - ``tokens``: the number of masked tokens, to turn means back into sums across ranks.
    """
    weights = mask.to(logprobs.dtype)
    log_ratio = logprobs - behaviour_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    loss_sum = (per_token * weights).sum()
    with torch.no_grad():
        count = weights.sum()
        denom = count.clamp(min=1.0)

        def masked_mean(values: Tensor) -> Tensor:
            return ((values * weights).sum() / denom).float()

        stats = {
            "clip_frac": masked_mean((clipped < unclipped).to(weights.dtype)),
            "mismatch_abs_logp": masked_mean(log_ratio.abs()),
            "kl_k3": masked_mean(ratio - 1.0 - log_ratio),
            "ratio_mean": masked_mean(ratio),
            "tokens": count.float(),
        }
    return loss_sum, stats
