"""verl's reward signature and per-data_source routing (``reward.type = "verl"``)."""

from __future__ import annotations

import logging

import pytest

from rollouters.rewards.base import RewardError
from rollouters.rewards.verl import (AsyncVerlReward, VerlReward, gsm8k_score, score_value,
                                     verl_reward)
from rollouters.tasks.sample import Sample


def _sample(source: str, truth: object, extra: object = None) -> Sample:
    fields = {"data_source": source, "extra_info": extra or {"split": "train", "index": 7}}
    return Sample("s0", "q", answer=truth, fields=fields)


def test_a_verl_compute_score_is_called_with_verls_arguments_by_keyword() -> None:
    """verl's reward managers pass the four by keyword: a function whose parameters come in
    another order, or are keyword-only, gets them right."""
    calls = []

    def compute_score(*, solution_str, ground_truth, data_source, extra_info=None):
        calls.append((data_source, solution_str, ground_truth, extra_info))
        return {"score": 0.5, "acc": True}   # a dict: verl takes its "score"

    assert verl_reward(compute_score)("#### 3", _sample("openai/gsm8k", "3")) == 0.5
    assert calls == [("openai/gsm8k", "#### 3", "3", {"split": "train", "index": 7})]


def test_an_async_compute_score_is_awaited() -> None:
    import asyncio

    from tests.rewards.helpers import async_compute_score

    reward = verl_reward(async_compute_score)
    assert isinstance(reward, AsyncVerlReward)
    assert asyncio.run(reward(" 42", _sample("x", "42"))) == 1.0
    assert type(verl_reward(lambda **kw: 1.0)) is VerlReward


def test_scores_that_are_not_numbers_are_refused_by_reason() -> None:
    import numpy as np
    import torch

    assert score_value(True) == 1.0 and score_value(2) == 2.0
    # what verl's reward tensor takes as well: numpy scalars, one-element tensors and arrays
    assert score_value(np.float32(0.25)) == 0.25 and score_value(np.bool_(True)) == 1.0
    assert score_value(torch.tensor(0.5)) == 0.5 and score_value(np.array([2.0])) == 2.0
    assert score_value({"score": np.float64(1.0), "pred": "x"}) == 1.0
    with pytest.raises(RewardError, match="not_a_number"):
        score_value(torch.tensor([1.0, 2.0]))
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
    assert gsm8k_score("openai/gsm8k", "#### 72.", "72") == 0.0   # verl keeps the period
    # verl reads only the last 300 characters: an answer before them scores 0
    assert gsm8k_score("openai/gsm8k", "#### 72" + " and so on" * 30, "72") == 0.0
    assert gsm8k_score("openai/gsm8k", "x" * 400 + "#### 72", 72) == 1.0


def test_rows_are_routed_by_data_source(caplog: pytest.LogCaptureFixture) -> None:
    reward = verl_reward()
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
    the user's compute_score (or to the data_source routing when no path is given); an async
    compute_score is awaited there (test below)."""
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


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_an_async_compute_score_scores_through_make_reward(isolation: str) -> None:
    import asyncio

    from asyncrl.config.schema import RewardConfig
    from rollouters.rewards import make_reward

    scorer = make_reward(RewardConfig(type="verl", workers=1, isolation=isolation,
                                      path="tests.rewards.helpers:async_compute_score"))
    try:
        sample = _sample("my/source", "42")
        scores = asyncio.run(_score_all(scorer, [("42", sample), ("41", sample)]))
    finally:
        scorer.close()
    assert scores == [1.0, 0.0] and scorer.counts["ok"] == 2
