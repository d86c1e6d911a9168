"""A reward that hangs cannot starve the worker: in a pool of processes (the default for custom
rewards) a hung call is killed with its process, which is replaced; in the worker's threads
(``reward.isolation = "thread"``) a stuck thread is abandoned and replaced. Failures past a
rate say so in one WARNING, not one per call. Real processes and threads throughout."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import pytest

from asyncrl.config import ConfigError, load_config
from rollouters.rewards import RewardScorer, make_reward
from rollouters.rewards.base import FailureRate
from rollouters.tasks.sample import Sample


def _scorer(path: str, *sets: str, timeout_s: float = 1.0) -> RewardScorer:
    cfg = load_config(None, ["reward.type=custom", f"reward.path={path}",
                             f"reward.timeout_s={timeout_s}", *sets])
    return make_reward(cfg.reward)


async def _score_all(scorer: RewardScorer, responses: list[str]) -> list[float]:
    return await asyncio.gather(*(scorer.score(r, Sample(f"id-{i}", "q", "1"))
                                  for i, r in enumerate(responses)))


def _children() -> set[int]:
    """This process's children, zombies included."""
    children = set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
            children.add(int(entry))
    return children


@pytest.mark.parametrize("path", ["tests.rewards.helpers:hang_on_some",
                                  "tests.rewards.helpers:async_blocking_on_some"])
def test_hung_calls_are_killed_and_later_calls_still_score(path: str) -> None:
    before = _children()
    scorer = _scorer(path, "reward.workers=2", timeout_s=0.5)
    try:
        # both processes hung: a pool that kept them would time out every later call
        assert asyncio.run(_score_all(scorer, ["hang", "hang", "a"])) == [0.0, 0.0, 1.0]
        assert asyncio.run(_score_all(scorer, ["hang", "hang", "abc", "ab", "abcd"])) == \
            [0.0, 0.0, 3.0, 2.0, 4.0]
        assert scorer.metrics() == {"reward/timeout": 4, "reward/failed": 4,
                                    "reward/ok": 4, "reward/replaced": 4}
        assert len(scorer.runner.pids()) <= 2
    finally:
        scorer.close()
    assert _children() == before  # the hung ones killed and reaped, the others too


def test_a_math_answer_that_holds_the_interpreter_lock_for_good_is_killed() -> None:
    """sympy evaluates a tower of powers without releasing the GIL: in the worker this froze
    every thread (the heartbeat included) and no timeout could fire."""
    cfg = load_config(None, ["reward.type=math", "reward.timeout_s=1", "reward.workers=1"])
    scorer = make_reward(cfg.reward)
    try:
        tower = asyncio.run(_score_all(scorer, ["$\\boxed{9^{9^{9^{9}}}}$"]))
        assert tower == [0.0] and scorer.counts["timeout"] == 1
        assert asyncio.run(_score_all(scorer, ["so $\\boxed{1}$"])) == [1.0]
    finally:
        scorer.close()


def test_a_reward_process_that_dies_is_replaced() -> None:
    scorer = _scorer("tests.rewards.helpers:hang_on_some", "reward.workers=1")
    try:
        assert asyncio.run(_score_all(scorer, ["die", "xy", "die", "xyz"])) == \
            [0.0, 2.0, 0.0, 3.0]
        assert scorer.counts["worker_died"] == 2 and scorer.counts["ok"] == 2
    finally:
        scorer.close()


def test_stuck_threads_are_replaced_with_thread_isolation() -> None:
    scorer = _scorer("tests.rewards.helpers:hang_on_some", "reward.isolation=thread",
                     "reward.workers=1", timeout_s=0.3)
    try:
        # one thread: each hung call takes it for good; its replacement scores the next
        assert asyncio.run(_score_all(scorer, ["hang"])) == [0.0]
        assert asyncio.run(_score_all(scorer, ["ab"])) == [2.0]
        assert asyncio.run(_score_all(scorer, ["hang"])) == [0.0]
        assert asyncio.run(_score_all(scorer, ["abc"])) == [3.0]
        assert scorer.metrics() == {"reward/timeout": 2, "reward/failed": 2, "reward/ok": 2,
                                    "reward/replaced": 2}
    finally:
        scorer.close()


def test_a_failure_rate_past_the_threshold_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    scorer = _scorer("tests.rewards.helpers:raising_reward", "reward.workers=2")
    try:
        with caplog.at_level(logging.WARNING, logger="rollouters.rewards.base"):
            asyncio.run(_score_all(scorer, ["x"] * 60))
    finally:
        scorer.close()
    rate = [r for r in caplog.records if "of the last" in r.getMessage()]
    assert len(rate) == 1, [r.getMessage() for r in rate]
    assert rate[0].levelno == logging.WARNING
    assert "20 of the last 20 calls failed" in rate[0].getMessage()
    assert "error:RuntimeError 20" in rate[0].getMessage()
    assert scorer.counts["error:RuntimeError"] == 60


def test_failure_rate_threshold_and_repeat() -> None:
    now = [0.0]
    rate = FailureRate(window=100, min_calls=20, rate=0.1, every_s=60.0, clock=lambda: now[0])
    assert [rate.add(i % 10 == 9) for i in range(100)] == [None] * 100  # 10 %: not past it
    assert rate.add(True) == 11  # 11 of the last 100
    assert rate.add(True) is None  # said: not again within every_s
    now[0] = 61.0
    assert rate.add(True) == 13
    assert [rate.add(False) for _ in range(100)] == [None] * 100


@pytest.mark.parametrize(("sets", "message"), [
    (["reward.isolation=fork"], "reward.isolation"),
    (["reward.workers=0"], "reward.workers"),
])
def test_isolation_settings_are_checked_naming_the_key(sets: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, sets)
