"""Advantage estimators: pure torch on one group's (or one batch's) rewards, no distributed code.

Outcome rewards give one advantage per sample; the batcher writes it on every position of that
sample. All are computed in float64 and returned in float32 (or the rewards' float dtype).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "gae")


def _out_dtype(rewards: Tensor) -> torch.dtype:
    return rewards.dtype if rewards.is_floating_point() else torch.float32


def grpo_advantages(rewards: Tensor, std_norm: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO group-normalised advantages for the ``G`` samples of one prompt.

    ``(r − mean) / (std + eps)`` with the POPULATION std (``unbiased=False``): it is defined for
    ``G = 1`` (0, so the advantage is 0) where the sample std is NaN. With ``std_norm=False`` it is
    just ``r − mean`` (Dr. GRPO: the std rescales easy and hard prompts differently).

    A group whose rewards are all equal gets exact zeros: it carries no signal, and rounding in
    ``mean`` would otherwise leave ~1e-8 residues that ``/ eps`` blows up to ~1e-2.
    """
    r = rewards.to(torch.float64)
    if r.numel() == 0 or bool(r.max() == r.min()):
        return torch.zeros_like(r, dtype=_out_dtype(rewards))
    centered = r - r.mean()
    if std_norm:
        centered = centered / (r.std(unbiased=False) + eps)
    return centered.to(_out_dtype(rewards))


def rloo_advantages(rewards: Tensor) -> Tensor:
    """REINFORCE leave-one-out: ``A_i = r_i − mean_{j≠i} r_j = G/(G−1) · (r_i − mean(r))``.

    The baseline excludes the sample itself, so it is independent of the sample's action and
    the estimator is unbiased (GRPO's mean includes it, shrinking advantages by ``(G−1)/G``).
    ``G = 1`` has no other sample to compare with: advantage 0.
    """
    r = rewards.to(torch.float64)
    n = r.numel()
    if n < 2 or bool(r.max() == r.min()):
        return torch.zeros_like(r, dtype=_out_dtype(rewards))
    return (n / (n - 1) * (r - r.mean())).to(_out_dtype(rewards))


def reinforce_pp_advantages(group_rewards: Sequence[Tensor], eps: float = 1e-6) -> Tensor:
    """REINFORCE++ (baseline variant) over a batch of groups, concatenated in group order.

    ``x_i = r_i − mean(group of i)``, then ``A = (x − mean_batch(x)) / (std_batch(x) + eps)``
    (population std over every sample of the batch). Subtracting the group mean removes the
    prompt's difficulty; dividing by ONE batch-wide std (not each group's, as GRPO does) keeps
    the relative scale of groups, which GRPO's per-group std distorts. With several learner
    ranks "batch" is the rank's share.
    """
    if not group_rewards:
        return torch.zeros(0)
    centered = torch.cat([r.to(torch.float64) - r.to(torch.float64).mean() for r in group_rewards])
    std = centered.std(unbiased=False)
    if bool(std == 0):
        return torch.zeros_like(centered, dtype=torch.float32)
    return ((centered - centered.mean()) / (std + eps)).float()


def batch_advantages(group_rewards: Sequence[Tensor], kind: str, std_norm: bool = True) -> Tensor:
    """Per-sample advantages of a batch of groups (concatenated) by estimator ``kind``.

    ``grpo`` honours ``std_norm`` (``std_norm=False`` is Dr. GRPO); ``dr_grpo`` never divides.
    ``gae`` needs the critic's values, so it is computed by the trainer: zeros here.
    """
    if kind == "gae":
        return torch.zeros(sum(r.numel() for r in group_rewards))
    if kind == "reinforce_pp":
        return reinforce_pp_advantages(group_rewards)
    if kind == "grpo":
        per_group = [grpo_advantages(r, std_norm=std_norm) for r in group_rewards]
    elif kind == "dr_grpo":
        per_group = [grpo_advantages(r, std_norm=False) for r in group_rewards]
    elif kind == "rloo":
        per_group = [rloo_advantages(r) for r in group_rewards]
    else:
        raise ValueError(f"unknown advantage estimator {kind!r}; expected one of {ADVANTAGES}")
    return torch.cat(per_group).float() if per_group else torch.zeros(0)


def gae_advantages(token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0,
                   lam: float = 0.95) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation along each row of ``[B, T]`` (one sample per row).

    Over the masked (generated) positions only, in order, with ``V = 0`` after the last one:
    ``δ_t = r_t + γ·V_{t+1} − V_t`` and ``A_t = δ_t + γλ·A_{t+1}``; returns ``(A, A + V)``
    (advantages and the critic's regression targets), 0 off the mask. Unmasked positions are
    skipped, not treated as steps, so prompt tokens inside a row do not discount anything.
    For an outcome reward put it on the last generated token. λ trades bias (λ→0, trusts V)
    for variance (λ=1, Monte-Carlo returns).
    """
    m = mask.to(torch.float64)
    r, v = token_rewards.to(torch.float64) * m, values.to(torch.float64) * m
    adv = torch.zeros_like(r)
    next_value = torch.zeros(r.shape[0], dtype=torch.float64, device=r.device)
    running = torch.zeros_like(next_value)
    for t in range(r.shape[1] - 1, -1, -1):
        on = m[:, t] > 0
        delta = r[:, t] + gamma * next_value - v[:, t]
        running = torch.where(on, delta + gamma * lam * running, running)
        next_value = torch.where(on, v[:, t], next_value)
        adv[:, t] = torch.where(on, running, torch.zeros_like(running))
    return adv.float(), (adv + v).float() * m.float()


def outcome_token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """``[B, T]`` per-token rewards: each row's outcome reward on its LAST masked position, 0
    elsewhere (and everywhere on a row without a masked position). Input of :func:`gae_advantages`.
    """
    m = mask.to(torch.int64)
    positions = torch.arange(m.shape[-1], device=m.device)
    last = (positions * m).argmax(-1)
    out = torch.zeros(m.shape, dtype=torch.float32, device=m.device)
    has_tokens = m.sum(-1) > 0
    out[has_tokens, last[has_tokens]] = rewards.float()[has_tokens]
    return out
