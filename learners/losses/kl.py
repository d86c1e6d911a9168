"""KL(π ‖ π_ref) to a frozen reference policy, per token, from samples of π (Schulman's k1-k3).

With ``log r = logp − logp_ref`` for tokens sampled from π:

- ``k1 = log r``: unbiased, high variance, can be negative per token.
- ``k2 = ½ (log r)²``: biased but low variance, ≥ 0; its gradient is that of the true KL's
  second-order expansion (it is the estimator whose gradient is right "in the loss").
- ``k3 = 1/r − 1 + log r = exp(−log r) − 1 + log r``: unbiased, ≥ 0, low variance (GRPO's choice).

Used either IN THE LOSS (``+ β·k`` per token, aggregated like the policy loss) or IN THE REWARD
(``A_t ← A_t − β·Σ_{s≥t} k1_s``, the return-to-go of the per-token penalty, no gradient).
"""

from __future__ import annotations

import torch
from torch import Tensor

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(π ‖ π_ref) (formulas in the module docstring), same shape.

    The log-ratio is clamped to ±20 before ``exp`` in k3, so a token the reference finds
    impossible cannot overflow the loss to inf.
    """
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        clamped = log_ratio.clamp(-20.0, 20.0)
        return torch.exp(-clamped) - 1.0 + clamped
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")


def kl_reward_to_go(kl: Tensor, mask: Tensor) -> Tensor:
    """``Σ_{s ≥ t, s masked} kl[b, s]`` on masked positions (0 elsewhere), along the last dim.

    With the KL as a per-token reward penalty ``−β·kl_s`` and γ = 1, the return from token t
    gains ``−β·Σ_{s≥t} kl_s``: this sum. Detached: a reward carries no gradient.
    """
    masked = (kl * mask.to(kl.dtype)).detach()
    rtg = masked.flip(-1).cumsum(-1).flip(-1)
    return rtg * mask.to(kl.dtype)
