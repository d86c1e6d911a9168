"""What a step reports of the staleness of the groups it trained on (rank 0's
``learners.batch_feed.consumed_versions``), with groups that generated no trained token."""

from __future__ import annotations

from asyncrl.wire import TrajectoryGroup
from learners.batch_feed import consumed_versions


def _group(name: str, versions: list[int], mask: list[int]) -> TrajectoryGroup:
    samples = [{"tokens": [1] * len(mask), "logprobs": [0.0] * len(mask), "loss_mask": mask,
                "versions": versions, "reward": float(r), "finish_reason": "stop"}
               for r in (0, 1)]
    return TrajectoryGroup.from_samples(name, name, samples)


def test_a_batch_with_no_trained_token_reports_without_failing() -> None:
    """The batch trains no token (the learner still runs the step, collectively): the
    report used to raise ``min() arg is an empty sequence`` on rank 0 after the step and
    its ack, and the learner died."""
    empty = _group("empty", [-1, -1, -1], [0, 0, 0])
    metrics = consumed_versions([empty], 3, 2)
    assert "staleness/consumed_version_min" not in metrics
    assert metrics["staleness/max"] == 0.0 and metrics["staleness/hist"] == [1, 0, 0]


def test_a_group_with_no_trained_token_is_not_stale() -> None:
    """As the buffer counts it (``TrajectoryGroup.staleness``): it used to read as
    ``version + 1`` steps stale, in the max and the mean."""
    fresh, empty = _group("fresh", [-1, 2, 2], [0, 1, 1]), _group("empty", [-1] * 3, [0] * 3)
    metrics = consumed_versions([fresh, empty], 3, 2)
    assert metrics["staleness/consumed_version_min"] == 2.0
    assert metrics["staleness/consumed_version_max"] == 2.0
    assert metrics["staleness/max"] == 1.0 and metrics["staleness/mean"] == 0.5
    assert metrics["staleness/hist"] == [1, 1, 0]
