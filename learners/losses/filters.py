"""Group filters applied before batching: pure functions of the groups and the loss config.

- Finish-reason filtering (DAPO's overlong filtering, the seeds' compact filtering): a sample
  whose finish reason is in ``drop_finish_reasons`` (e.g. ``"length"``: truncated) keeps its
  place in the group, so the group's reward baseline is unchanged, but its loss mask is zeroed:
  a truncated answer is not evidence that its tokens were bad.
- Dynamic sampling (DAPO; the seeds' rejection sampling): a group whose rewards are all equal
  has zero group-relative advantage, so it only dilutes the token count; it is dropped.

A group left with no trained token is dropped too. Counts are by reason, to report as metrics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from asyncrl.wire import TrajectoryGroup

if TYPE_CHECKING:
    from asyncrl.config.schema import LossConfig


def mask_finish_reasons(group: TrajectoryGroup, reasons: Sequence[str]
                        ) -> tuple[TrajectoryGroup, int]:
    """``group`` with the loss mask of samples finishing with one of ``reasons`` zeroed, and
    how many samples were masked. The input group is not modified."""
    drop = [i for i, reason in enumerate(group.finish_reasons) if reason in reasons]
    if not drop:
        return group, 0
    loss_mask = group.loss_mask.copy()
    slices = group.sample_slices()
    for i in drop:
        loss_mask[slices[i]] = 0
    return dataclasses.replace(group, loss_mask=loss_mask), len(drop)


def rewards_all_equal(group: TrajectoryGroup) -> bool:
    """True if every sample of the group has the same reward (no group-relative signal)."""
    return bool(np.ptp(np.asarray(group.rewards, dtype=np.float64)) == 0.0)


def filter_groups(groups: Sequence[TrajectoryGroup], cfg: LossConfig
                  ) -> tuple[list[TrajectoryGroup], dict[str, int]]:
    """Apply finish-reason masking then dynamic sampling; return ``(kept, counts)``.

    ``counts``: ``kept`` groups, ``dropped_equal_reward`` and ``dropped_no_tokens`` groups,
    ``masked_samples`` (samples whose loss mask was zeroed for their finish reason).
    """
    counts = {"kept": 0, "dropped_equal_reward": 0, "dropped_no_tokens": 0, "masked_samples": 0}
    kept = []
    for group in groups:
        group, masked = mask_finish_reasons(group, cfg.drop_finish_reasons)
        counts["masked_samples"] += masked
        if cfg.drop_equal_reward_groups and rewards_all_equal(group):
            counts["dropped_equal_reward"] += 1
        elif group.num_generated == 0:
            counts["dropped_no_tokens"] += 1
        else:
            kept.append(group)
    counts["kept"] = len(kept)
    return kept, counts


def zero_loss_mask(group: TrajectoryGroup) -> TrajectoryGroup:
    """A copy of ``group`` that trains on nothing: for a rank whose every group was filtered
    out but which must still join the collective ``train_step``."""
    return dataclasses.replace(group, loss_mask=np.zeros_like(group.loss_mask))
