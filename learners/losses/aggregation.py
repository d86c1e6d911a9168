"""Loss aggregation: per-token weights whose weighted SUM, divided by a global unit count, is
the loss.

A rank only sees its share of the batch, so aggregation is split in two: each rank computes
``Σ w·ℓ`` and its number of ``units``; the trainer all-reduces the units and divides
(``learners.backends.fsdp2``). Then W ranks reproduce one rank on the whole batch.

========== ============================================ ====================================
level      weight ``w[b, t]`` (on masked tokens)         units
========== ============================================ ====================================
token      ``1``                                         trained tokens
sequence   ``1 / n_b`` (``n_b`` = tokens of sample b)    samples with ≥ 1 trained token
group      ``1 / n_g`` (``n_g`` = tokens of its group)   groups with ≥ 1 trained token
========== ============================================ ====================================

Rows of one group may be split across ranks and micro-batches (the learner balances sequences,
not groups), so group-level weights take ``n_g`` of the WHOLE batch (``TrainBatch.group_tokens``)
and each row counts ``n_b / n_g`` of its group's unit: the shares of a group sum to 1 wherever
its rows went (up to float rounding, ~1e-7 relative).

Token-level (DAPO) weights every token equally, so long answers dominate; sequence-level
(GRPO's original) weights every sample equally, so a long answer's tokens each count less;
group-level weights every prompt equally.
"""

from __future__ import annotations

import torch
from torch import Tensor

AGGREGATIONS = ("token", "sequence", "group")


def aggregation_weights(mask: Tensor, group_index: Tensor, level: str,
                        group_tokens: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(w [B, T], units)`` for ``mask [B, T]`` and each row's group ``group_index [B]``.

    ``group_tokens [B]``: each row's group's trained tokens in the whole batch when these rows
    are a slice of it; ``None`` = the rows are the whole batch. ``units`` is a 0-dim float32
    tensor (all-reducible); rows or groups without a trained token get weight 0 and are not
    counted.
    """
    m = mask.to(torch.float32)
    if level == "token":
        return m, m.sum()
    if level == "sequence":
        per_row = m.sum(-1)
        return m / per_row.clamp(min=1.0).unsqueeze(-1), (per_row > 0).sum().float()
    if level == "group":
        per_row = m.sum(-1)
        if group_tokens is None:
            groups = int(group_index.max()) + 1 if group_index.numel() else 0
            per_group = torch.zeros(groups, device=m.device).index_add_(0, group_index, per_row)
            group_tokens = per_group[group_index]
        denominator = group_tokens.to(m.device, torch.float32).clamp(min=1.0)
        return m / denominator.unsqueeze(-1), (per_row / denominator).sum()
    raise ValueError(f"unknown aggregation {level!r}; expected one of {AGGREGATIONS}")


def aggregate(per_token: Tensor, weights: Tensor) -> Tensor:
    """``Σ w·ℓ``: the rank's share of the loss before division by the global units."""
    return (per_token * weights).sum()
