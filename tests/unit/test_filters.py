"""Dynamic sampling and finish-reason filtering of trajectory groups."""

from __future__ import annotations

import numpy as np

from asyncrl.config.schema import LossConfig
from asyncrl.wire import TrajectoryGroup
from learners.losses.filters import filter_groups, mask_finish_reasons, zero_loss_mask


def _group(group_id: str, rewards: list[float], reasons: list[str]) -> TrajectoryGroup:
    """Samples of 2 prompt + 2 generated tokens."""
    samples = [{"tokens": [1, 2, 3, 4], "reward": r, "finish_reason": why,
                "logprobs": [0.0, 0.0, -0.5, -0.5], "loss_mask": [0, 0, 1, 1],
                "versions": [-1, -1, 0, 0]} for r, why in zip(rewards, reasons)]
    return TrajectoryGroup.from_samples(group_id, group_id, samples)


def _groups() -> list[TrajectoryGroup]:
    return [_group("mixed", [1.0, 0.0], ["stop", "length"]),      # sample 1 masked, kept
            _group("equal", [1.0, 1.0], ["stop", "stop"]),        # no signal: dropped
            _group("truncated", [0.0, 1.0], ["length", "length"])]  # nothing left to train


def test_filter_groups_literal() -> None:
    groups = _groups()
    cfg = LossConfig(drop_equal_reward_groups=True, drop_finish_reasons=["length"])
    kept, counts = filter_groups(groups, cfg)
    assert [g.group_id for g in kept] == ["mixed"]
    assert counts == {"kept": 1, "dropped_equal_reward": 1, "dropped_no_tokens": 1,
                      "masked_samples": 3}
    assert kept[0].loss_mask.tolist() == [0, 0, 1, 1, 0, 0, 0, 0]
    assert kept[0].rewards == [1.0, 0.0]    # the masked sample still sets the baseline
    assert groups[0].loss_mask.tolist() == [0, 0, 1, 1, 0, 0, 1, 1]   # input untouched


def test_defaults_keep_everything() -> None:
    groups = _groups()
    kept, counts = filter_groups(groups, LossConfig())
    assert kept == groups
    assert counts == {"kept": 3, "dropped_equal_reward": 0, "dropped_no_tokens": 0,
                      "masked_samples": 0}


def test_only_dynamic_sampling() -> None:
    kept, counts = filter_groups(_groups(), LossConfig(drop_equal_reward_groups=True))
    assert [g.group_id for g in kept] == ["mixed", "truncated"]
    assert counts["dropped_equal_reward"] == 1 and counts["masked_samples"] == 0


def test_mask_finish_reasons_without_match_returns_the_group() -> None:
    group = _group("g", [1.0], ["stop"])
    same, masked = mask_finish_reasons(group, ["length"])
    assert same is group and masked == 0


def test_zero_loss_mask() -> None:
    group = _group("g", [1.0, 0.0], ["stop", "stop"])
    empty = zero_loss_mask(group)
    assert empty.num_generated == 0 and group.num_generated == 4
    assert np.array_equal(empty.tokens, group.tokens)
