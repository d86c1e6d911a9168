"""Losses and advantages: pure torch, no distributed code.

- :mod:`.policy`: per-token policy losses (PPO clip, decoupled PPO, TIS, GSPO, REINFORCE).
- :mod:`.advantages`: GRPO / Dr. GRPO, RLOO, REINFORCE++, GAE.
- :mod:`.aggregation`: token / sequence / group weights for reducing per-token losses.
- :mod:`.kl`: k1 / k2 / k3 KL estimators to a reference policy, in the loss or the reward.
- :mod:`.filters`: dynamic sampling and finish-reason filtering of trajectory groups.

Losses are SUMS, never means: the caller divides by a global count (``learners.backends.fsdp2``).
"""

from learners.losses.advantages import (
    batch_advantages,
    gae_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from learners.losses.aggregation import aggregate, aggregation_weights
from learners.losses.filters import filter_groups
from learners.losses.kl import kl_estimate, kl_reward_to_go
from learners.losses.policy import (
    decoupled_ppo_token_loss,
    gspo_token_loss,
    policy_token_loss,
    ppo_clip_loss,
    ppo_clip_token_loss,
    reinforce_token_loss,
    tis_token_loss,
)

__all__ = [
    "aggregate", "aggregation_weights", "batch_advantages", "decoupled_ppo_token_loss",
    "filter_groups",
    "gae_advantages", "grpo_advantages", "gspo_token_loss", "kl_estimate", "kl_reward_to_go",
    "policy_token_loss", "ppo_clip_loss", "ppo_clip_token_loss", "reinforce_pp_advantages",
    "reinforce_token_loss", "rloo_advantages", "tis_token_loss",
]
