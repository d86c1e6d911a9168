"""verl's reward signature and per-data_source routing (``reward.type = "verl"``)."""

from __future__ import annotations

import logging

import pytest

from rollouters.rewards.base import RewardError
from rollouters.rewards.verl import VerlReward, gsm8k_score, score_value
from rollouters.tasks.sample import Sample


def _sample(source: str, truth: object, extra: object = None) -> Sample:
    fields = {"data_source": source, "extra_info": extra or {"split": "train", "index": 7}}
    return Sample("s0", "q", answer=truth, fields=fields)


def test_a_verl_compute_score_is_called_with_verls_arguments() -> None:
    calls = []

    def compute_score(data_source, solution_str, ground_truth, extra_info):
        calls.append((data_source, solution_str, ground_truth, extra_info))
        return {"score": 0.5, "acc": True}   # a dict: verl takes its "score"

    assert VerlReward(compute_score)("#### 3", _sample("openai/gsm8k", "3")) == 0.5
    assert calls == [("openai/gsm8k", "#### 3", "3", {"split": "train", "index": 7})]


def test_scores_that_are_not_numbers_are_refused_by_reason() -> None:
    assert score_value(True) == 1.0 and score_value(2) == 2.0
    with pytest.raises(RewardError) as missing:
        score_value({"acc": 1.0})
    assert missing.value.reason == "no_score"
    with pytest.raises(RewardError) as text:
        score_value("1.0")
    assert text.value.reason == "not_a_number"


def test_gsm8k_is_strict_like_verls() -> None:
    assert gsm8k_score("openai/gsm8k", "so 1,200 in all\n#### 1,200", "1200") == 1.0
    assert gsm8k_score("openai/gsm8k", "#### 12 then #### 13", "13") == 1.0
    assert gsm8k_score("openai/gsm8k", "the answer is 1200", "1200") == 0.0   # no ####


def test_rows_are_routed_by_data_source(caplog: pytest.LogCaptureFixture) -> None:
    reward = VerlReward()
    assert reward("#### 72", _sample("openai/gsm8k", "72")) == 1.0
    assert reward("so \\boxed{\\frac{1}{2}}", _sample("lighteval/MATH", "0.5")) == 1.0
    with caplog.at_level(logging.WARNING):
        assert reward("Answer: Paris", _sample("my/trivia", "paris")) == 1.0
        assert reward("Answer: Rome", _sample("my/trivia", "paris")) == 0.0
    warnings = [r for r in caplog.records if "my/trivia" in r.getMessage()]
    assert len(warnings) == 1   # said once per source, not per call


@pytest.mark.parametrize("path", ["examples.verl.reward:compute_score", ""])
def test_reward_type_verl_scores_in_the_process_pool(path: str) -> None:
    """`reward.type = "verl"` through make_reward: each pool process applies the adapter to
    the user's compute_score (or to the data_source routing when no path is given)."""
    import asyncio

    from asyncrl.config.schema import RewardConfig
    from rollouters.rewards import make_reward

    scorer = make_reward(RewardConfig(type="verl", path=path, workers=1))
    try:
        sample = _sample("openai/gsm8k", "1234")
        # the example's dense digit match, or GSM8K's "#### answer" (the row's data_source)
        right, wrong = ("1234", "1243") if path else ("so\n#### 1234", "so\n#### 1243")
        scores = asyncio.run(_score_all(scorer, [(right, sample), (wrong, sample)]))
    finally:
        scorer.close()
    assert scores == ([1.0, 0.5] if path else [1.0, 0.0])
    assert scorer.counts["ok"] == 2


async def _score_all(scorer, calls):
    return [await scorer.score(response, sample) for response, sample in calls]
