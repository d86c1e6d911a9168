"""Digit tasks: targets, position-wise rewards, and a held-out split that never leaks."""

from __future__ import annotations

import random

import pytest

from asyncrl.config.schema import TaskConfig
from asyncrl.models import BOS_ID, EOS_ID, SEP_ID
from rollouters.tasks import DigitTask, make_task


def _ids(digits: str) -> list[int]:
    return [4 + int(c) for c in digits]


@pytest.mark.parametrize("name, expected", [("copy", "3141"), ("reverse", "1413"),
                                            ("sort", "1134")])
def test_prompt_and_target(name: str, expected: str) -> None:
    prompt = DigitTask(name, 4, 8, seed=0).make_prompt("3141")
    assert prompt.tokens == [BOS_ID, *_ids("3141"), SEP_ID]
    assert prompt.target == [*_ids(expected), EOS_ID]
    assert prompt.prompt_id == f"{name}:3141"


def test_rewards_exact_partial_empty() -> None:
    task = DigitTask("reverse", 4, 8, seed=0)
    prompt = task.make_prompt("1234")
    target = prompt.target
    assert task.reward(prompt, target) == 1.0 and task.exact(prompt, target)
    assert task.reward(prompt, []) == 0.0 and not task.exact(prompt, [])
    assert task.reward(prompt, target[:2]) == pytest.approx(2 / 5)  # missing positions are wrong
    wrong_middle = [target[0], 0, target[2], target[3], EOS_ID]
    assert task.reward(prompt, wrong_middle) == pytest.approx(4 / 5)
    assert not task.exact(prompt, wrong_middle)
    assert task.reward(prompt, target[:4]) == pytest.approx(4 / 5)  # no EOS
    # Extra tokens before the first EOS are wrong positions too; what follows EOS is ignored.
    assert task.reward(prompt, [*target[:4], 7, 7, 7, 7]) == pytest.approx(4 / 8)
    assert task.reward(prompt, [*target[:4], 7, EOS_ID]) == pytest.approx(4 / 6)
    assert task.reward(prompt, [*target, 7, 7]) == 1.0
    assert not task.exact(prompt, target[:4])
    assert task.exact(prompt, [*target, 7, 7])  # what follows the first EOS is ignored
    assert not task.exact(prompt, [*target[:3], EOS_ID, EOS_ID])


def test_eval_prompts_fixed_and_disjoint_from_training() -> None:
    task = make_task(TaskConfig(name="copy", length=4, eval_size=128), seed=1)
    evals = task.eval_prompts()
    assert len(evals) == 128 == len({p.prompt_id for p in evals})
    assert [p.prompt_id for p in evals] == \
        [p.prompt_id for p in DigitTask("copy", 4, 128, seed=1).eval_prompts()]
    train = {p.prompt_id for p in task.sample(random.Random(0), 20_000)}
    assert len(train) > 5_000  # most of the ~8750 training prompts were drawn
    assert train.isdisjoint(p.prompt_id for p in evals)


def test_long_prompts_are_split_too() -> None:
    task = DigitTask("sort", 12, 64, seed=0)
    evals = {p.prompt_id for p in task.eval_prompts()}
    assert len(evals) == 64
    assert evals.isdisjoint(p.prompt_id for p in task.sample(random.Random(0), 2_000))


def test_sampling_is_reproducible() -> None:
    task = DigitTask("copy", 4, 8, seed=0)
    assert task.sample(random.Random(7), 5) == task.sample(random.Random(7), 5)


def test_too_large_eval_size_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="task.eval_size"):
        DigitTask("copy", 2, 100, seed=0)


def test_unknown_task_name() -> None:
    with pytest.raises(ValueError, match="unknown digit task"):
        DigitTask("add", 4, 8, seed=0)
