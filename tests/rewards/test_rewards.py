"""Rewards: exact match, math-verify equivalence, user functions by import path, failure
accounting (raise / hang / NaN score 0, counted, and never stall the caller)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from asyncrl.config import ConfigError, load_config
from rollouters.rewards import RewardScorer, exact_match, make_reward, math_equal
from rollouters.tasks.sample import Sample


def _sample(answer: object = "42", **fields: object) -> Sample:
    return Sample(sample_id="s-1", prompt="q", answer=answer, fields=dict(fields))


@pytest.mark.parametrize(("response", "answer", "expected"), [
    ("the answer is \\boxed{42}", "42", 1.0),
    ("Answer: Paris ", "paris", 1.0),
    ("blah\n41", "42", 0.0),
    ("42", "42", 1.0),
])
def test_exact_match(response: str, answer: str, expected: float) -> None:
    assert exact_match(response, _sample(answer)) == expected


@pytest.mark.parametrize(("response", "answer", "expected"), [
    ("so $\\boxed{0.5}$", "1/2", 1.0),
    ("The answer is $\\frac{2}{4}$", "\\frac{1}{2}", 1.0),
    ("$\\boxed{1+x}$", "x+1", 1.0),
    ("$\\boxed{\\{1, 2\\}}$", "\\{2, 1\\}", 1.0),
    ("I think $\\boxed{4}$", "3", 0.0),
    ("no number here", "3", 0.0),
])
def test_math_verify_equivalence(response: str, answer: str, expected: float) -> None:
    assert math_equal(response, _sample(answer)) == expected


def _scorer(path: str, timeout_s: float = 5.0) -> RewardScorer:
    cfg = load_config(None, ["reward.type=custom", f"reward.path={path}",
                             f"reward.timeout_s={timeout_s}"])
    return make_reward(cfg.reward)


def test_user_rewards_sync_and_async_by_import_path() -> None:
    assert asyncio.run(_scorer("tests.rewards.helpers:length_reward").score("abc", _sample())) \
        == 3.0
    scorer = _scorer("tests.rewards.helpers:async_reward")
    assert scorer.is_async and asyncio.run(scorer.score("x", _sample())) == 0.5


@pytest.mark.parametrize(("path", "message"), [
    ("tests.rewards.helpers", "reward.path: expected an import path 'pkg.module:name' or a "
                              "file 'path/to/file.py:name'"),
    ("no/such/rewards.py:f", "reward.path: no file 'no/such/rewards.py'"),
    ("tests.rewards.nope:f", "reward.path: cannot import module 'tests.rewards.nope'"),
    ("tests.rewards.helpers:missing", "reward.path: module 'tests.rewards.helpers' has no "
                                      "attribute 'missing'"),
    ("tests.rewards.helpers:NOT_CALLABLE", "reward.path: 'tests.rewards.helpers:NOT_CALLABLE' "
                                           "is a int, not a callable"),
])
def test_wrong_import_path_names_the_key(path: str, message: str) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        _scorer(path)
    assert message in str(info.value)


def test_a_reward_in_a_python_file_scores_in_the_pool_and_names_its_errors(tmp_path) -> None:
    """verl's custom_reward_function.path is a file: ``reward.path = "file.py:fn"`` loads it,
    here and in each pool process; an error inside the file names the key and the file."""
    rewards = tmp_path / "my_reward.py"
    rewards.write_text("def compute_score(data_source, solution_str, ground_truth, "
                       "extra_info=None):\n    return float(solution_str == ground_truth)\n")
    cfg = load_config(None, ["reward.type=verl", f"reward.path={rewards}:compute_score",
                             "reward.workers=1"])
    scorer = make_reward(cfg.reward)
    try:
        sample = Sample("s", "q", answer="7", fields={"data_source": "x"})
        assert asyncio.run(scorer.score("7", sample)) == 1.0
        assert asyncio.run(scorer.score("8", sample)) == 0.0
    finally:
        scorer.close()
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('not today')\n")
    with pytest.raises(ConfigError, match="reward.path: cannot import module .*broken.py.*"
                                          "RuntimeError while running .*not today"):
        _scorer(f"{broken}:f")


def test_custom_without_path_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="reward.path"):
        load_config(None, ["reward.type=custom"])


@pytest.mark.parametrize(("path", "reason"), [
    ("tests.rewards.helpers:raising_reward", "error:RuntimeError"),
    ("tests.rewards.helpers:hanging_reward", "timeout"),
    ("tests.rewards.helpers:async_hanging_reward", "timeout"),
    ("tests.rewards.helpers:nan_reward", "non_finite"),
])
def test_failing_rewards_score_zero_counted_and_logged(
        path: str, reason: str, caplog: pytest.LogCaptureFixture) -> None:
    timeout_s, calls = 1.0, 8
    scorer = _scorer(path, timeout_s=timeout_s)

    async def run() -> list[float]:
        # many at once: a hanging sync reward must not serialise or stall the others
        return await asyncio.gather(*(scorer.score("x", Sample(f"id-{i}", "q", "1"))
                                      for i in range(calls)))

    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="rollouters.rewards.base"):
        assert asyncio.run(run()) == [0.0] * calls
    # One timeout after another would take calls × timeout_s (8 s); at once, one timeout plus
    # the reward pool's start (3.4 s seen on a loaded 2-core machine, where 0.3 s timeouts
    # against a 3 s bound failed). The bound is the serial time, not a guess at the load.
    assert time.monotonic() - start < calls * timeout_s
    assert scorer.counts[reason] == 8 and scorer.counts["failed"] == 8
    assert "sample id-3" in caplog.text and reason in caplog.text
    scorer.close()
