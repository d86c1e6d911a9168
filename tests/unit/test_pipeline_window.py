"""bench/pipeline.py's measuring window: it starts once the start-up backlog has drained, read
from the run's own queue depth, never before the planned warm-up."""

from __future__ import annotations

import sys

from tests.integration.conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
from pipeline import Scale, window_start  # noqa: E402


def records(queued: list[int]) -> list[dict]:
    return [{"step": i + 1, "buffer/queued": q} for i, q in enumerate(queued)]


def test_window_starts_after_a_draining_backlog() -> None:
    # generation-bound: s + 1 = 9 steps of groups queued at the start, drained at 32 a step
    queued = [max(0, 576 - 32 * k) for k in range(18)] + [40, 12, 55, 30, 0, 61, 20, 8]
    start = window_start(records(queued), warmup=11, tail_steps=5)
    assert start == 18  # the first step at or under the steady depth (61), not the warm-up 11
    assert queued[start - 1] <= 61 < queued[start - 2]


def test_window_starts_at_the_warmup_when_the_queue_stays_full() -> None:
    # training-bound: the gate keeps the queue at its window; there is no drain to wait out
    queued = [256, 250, 255, 248, 256, 251, 249, 256, 252, 254]
    assert window_start(records(queued), warmup=4, tail_steps=5) == 4


def test_planned_warmup_covers_the_drain_where_generation_is_slower() -> None:
    scale = Scale()
    assert scale.warmup_steps(8, ratio=2) == 20  # (8 + 1) / (1 - 1/2) = 18 steps, + 2
    assert scale.warmup_steps(8, ratio=4) == 14
    assert scale.warmup_steps(8, ratio=1) == 11  # the learner is never slower than the fleet
    assert scale.warmup_steps(1, ratio=0.5) == Scale().warmup
