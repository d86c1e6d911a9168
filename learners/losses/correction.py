"""Rollout correction: importance weights and rejection masks for the train-vs-rollout gap.

The engine samples from ``π_μ`` (its kernels, its dtype, maybe older weights); the learner
trains ``π_θ``. Per masked token, ``δ_t = logp_old,t − logp_μ,t`` and ``ρ_t = exp(δ_t)``, where
``logp_old`` is the learner's logprob before the update: the proximal logprobs when the loss
computes them, else the current ones detached (the same numbers: the learner makes one
optimizer step per batch, so the forward of the step IS the old policy). Log-ratios are clamped
to ±20 before ``exp``, as verl does, so one absurd token cannot overflow a weight.

Two independent parts, after verl's rollout correction (``docs/algo/rollout_corr.md`` and
``rollout_corr_math.md``, Liu, Li et al. 2025, "When Speed Kills Stability"):

**Importance weights** (``is_level``), truncated at ``C = is_cap``, detached:

- ``token``:    ``w_t = min(ρ_t, C)`` (verl ``rollout_is = token``).
- ``sequence``: ``w_t = min(Π_s ρ_s, C)`` over the sample's masked tokens, one weight per
  sample (verl ``rollout_is = sequence``).

**Rejection masks** (``mask``) on the band ``[low, high]``: a rejected token keeps its place in
the batch but its loss is multiplied by 0.

- ``token``:    keep token t iff ``low ≤ ρ_t ≤ high`` (verl ``rollout_rs = token``, MIS).
- ``sequence``: keep every token of sample b iff ``low ≤ exp(Σ_t δ_t / n_b) ≤ high``: the
  geometric mean of the token ratios, so the test does not grow with the length (verl
  ``rollout_rs = geometric``; thresholds near 1, e.g. ``[0.999, 1.001]``).
- ``icepop``:   IcePop's two-sided token mask (Ling team, "Every Attention Matters", Ring-1T,
  2025; OpenRLHF ``--use_icepop``): ``M(ρ_t) = ρ_t`` inside ``[low, high]``, 0 outside (the
  paper's α = 0.5, β = 5). The weight ``ρ_t`` corrects the tokens it keeps; the mask drops the
  ones whose gap is too large to correct.

Composition with the policy losses. ``ppo_clip``, ``tis`` and ``gspo`` take their ratio against
``π_μ`` itself ("bypass" in verl's words): ``ρ`` is already inside their ratio, so an importance
weight would count the gap twice. With them the config refuses ``is_level`` and IcePop applies
its mask alone (its weight is in the ratio). ``reinforce`` has no ratio: the weights make it
verl's ``pg_is``. ``decoupled_ppo`` clips against the proximal policy and corrects for ``π_μ``
with ``min(ρ_t, tis_cap)``: ``is_level`` (or IcePop's weight) replaces that weight. The masks
compose with every loss.

A rejected token still counts in the aggregation's unit count (the units are summed over ranks
before the first forward, when no ratio is known yet). verl removes it from the denominator;
here the step shrinks by the rejected share instead of being spread over the survivors. When
every token is rejected the gradient is zero: the backend then steps nothing and says so
(``learners.backends.micro_steps``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from asyncrl.config.schema import CorrectionConfig

IS_LEVELS = ("none", "token", "sequence")
MASKS = ("none", "token", "sequence", "icepop")
# Losses whose ratio is taken against the behaviour policy: ρ is already inside it.
BYPASS_LOSSES = ("ppo_clip", "tis", "gspo")
LOG_BOUND = 20.0


@dataclass(frozen=True)
class Correction:
    """Per-token factors, detached, ``[B, T]``: ``weight`` multiplies the policy loss (1 where
    no weight applies), ``keep`` is 1 on tokens the masks keep (0 on rejected and unmasked)."""

    weight: Tensor
    keep: Tensor

    def factor(self) -> Tensor:
        """What the per-token loss is multiplied by: the weight on kept tokens, 0 elsewhere."""
        return self.weight * self.keep


def log_ratios(old_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor) -> Tensor:
    """``δ = logp_old − logp_μ`` clamped to ±20, 0 off the mask, detached."""
    with torch.no_grad():
        delta = (old_logprobs - behaviour_logprobs).clamp(-LOG_BOUND, LOG_BOUND)
        return delta * mask.to(delta.dtype)


def sequence_log_ratio(delta: Tensor, mask: Tensor, mean: bool) -> Tensor:
    """``Σ_t δ_t`` per sample, or its mean over the sample's masked tokens, as ``[B, 1]``."""
    total = delta.sum(-1, keepdim=True)
    if not mean:
        return total
    return total / mask.to(delta.dtype).sum(-1, keepdim=True).clamp(min=1.0)


def importance_weight(delta: Tensor, mask: Tensor, level: str, cap: float) -> Tensor:
    """Truncated IS weight per token: ``min(ρ_t, C)`` or ``min(Π ρ, C)`` per sample."""
    if level == "none":
        return torch.ones_like(delta)
    if level == "token":
        return torch.exp(delta).clamp(max=cap)
    if level == "sequence":
        log_seq = sequence_log_ratio(delta, mask, mean=False).clamp(-LOG_BOUND, LOG_BOUND)
        return torch.exp(log_seq).clamp(max=cap).expand_as(delta)
    raise ValueError(f"unknown correction.is_level {level!r}; expected one of {IS_LEVELS}")


def rejection_keep(delta: Tensor, mask: Tensor, kind: str, low: float, high: float) -> Tensor:
    """1 on masked tokens the rejection mask keeps, 0 on the rest (see the module docstring)."""
    on = mask.bool()
    if kind == "none":
        return on.to(delta.dtype)
    if kind in ("token", "icepop"):
        ratio = torch.exp(delta)
    elif kind == "sequence":
        ratio = torch.exp(sequence_log_ratio(delta, mask, mean=True)).expand_as(delta)
    else:
        raise ValueError(f"unknown correction.mask {kind!r}; expected one of {MASKS}")
    return (on & (ratio >= low) & (ratio <= high)).to(delta.dtype)


def rollout_correction(cfg: CorrectionConfig, policy_loss: str, old_logprobs: Tensor,
                       behaviour_logprobs: Tensor, mask: Tensor) -> Correction:
    """The weights and the mask ``cfg`` asks for, for a loss of kind ``policy_loss``."""
    delta = log_ratios(old_logprobs, behaviour_logprobs, mask)
    weight = importance_weight(delta, mask, cfg.is_level, cfg.is_cap)
    if cfg.mask == "icepop" and policy_loss not in BYPASS_LOSSES:
        weight = weight * torch.exp(delta)
    keep = rejection_keep(delta, mask, cfg.mask, cfg.mask_low, cfg.mask_high)
    return Correction(weight=weight, keep=keep)


def replaces_loss_weight(cfg: CorrectionConfig) -> bool:
    """Does ``cfg`` supply decoupled PPO's behaviour weight (instead of ``min(ρ, tis_cap)``)?"""
    return cfg.is_level != "none" or cfg.mask == "icepop"


def correction_stats(correction: Correction, mask: Tensor) -> dict[str, Tensor]:
    """Token means over the masked tokens: ``correction_masked_frac`` (rejected share) and
    ``correction_weight_mean`` (the factor kept tokens are multiplied by)."""
    m = mask.to(correction.keep.dtype)
    tokens = m.sum().clamp(min=1.0)
    with torch.no_grad():
        kept = correction.keep.sum()
        return {"correction_masked_frac": ((m.sum() - kept) / tokens).float(),
                "correction_weight_mean": ((correction.factor() * m).sum()
                                           / kept.clamp(min=1.0)).float()}


__all__ = ["BYPASS_LOSSES", "Correction", "IS_LEVELS", "MASKS", "correction_stats",
           "importance_weight", "log_ratios", "rejection_keep", "replaces_loss_weight",
           "rollout_correction"]
