"""verl's reward functions, as they are: ``reward.type = "verl"``.

verl's reward managers call ``compute_score(data_source=..., solution_str=...,
ground_truth=..., extra_info=...)`` by keyword, await it when it is a coroutine function, and
accept a number (a bool, an int, a float, a numpy scalar, a one-element tensor) or a dict with a
``"score"`` key (verl logs the dict's other keys; here they are ignored). Users arriving from
verl bring such functions; :func:`verl_reward` adapts one to our
``fn(response, sample) -> float`` (the row's ``data_source`` and ``extra_info`` are on
``sample.fields``, the ground truth is ``sample.answer``, read from ``data.answer_field``).

With no ``reward.path`` the scorer is chosen per row by its ``data_source``, as verl's
``default_compute_score`` does for the datasets its preprocessing scripts write
(:func:`default_compute_score`, itself a verl-signature function): GSM8K's
``#### answer`` (:func:`gsm8k_score`, verl's strict rule), MATH-style equivalence by
math-verify (:func:`math_score`: more lenient than verl's string comparison of the last
``\boxed{}``, and 0/1 where verl scores its DAPO sources -1/1), and exact match for any other
source (said once per source in the log, since a silent fallback is how a run scores 0
without anyone noticing; verl raises there).
"""

from __future__ import annotations

import functools
import logging
import numbers
import re
from collections.abc import Callable, Mapping
from typing import Any

from rollouters.rewards.base import RewardError, is_coroutine_fn
from rollouters.rewards.match import exact_match, math_equal
from rollouters.tasks.sample import Sample

__all__ = ["AsyncVerlReward", "VerlReward", "default_compute_score", "gsm8k_score",
           "math_score", "score_value", "scorer_for", "verl_reward"]

logger = logging.getLogger(__name__)

VerlScore = Callable[[str, str, Any, Any], Any]

_GSM8K_FINAL = re.compile(r"#### (\-?[0-9\.\,]+)")
GSM8K_TAIL_CHARS = 300  # verl looks for the answer in the solution's last 300 characters


def gsm8k_score(data_source: str, solution_str: str, ground_truth: Any,
                extra_info: Any = None) -> float:
    """1.0 if the last ``#### <number>`` in the solution's last 300 characters, commas
    removed, is the ground truth's text, as verl's ``gsm8k.compute_score`` in its default
    strict mode: a trailing period (``#### 72.``) or an answer given earlier scores 0 there,
    and here."""
    found = _GSM8K_FINAL.findall(solution_str[-GSM8K_TAIL_CHARS:])
    if not found:
        return 0.0
    return float(found[-1].replace(",", "") == str(ground_truth))


def math_score(data_source: str, solution_str: str, ground_truth: Any,
               extra_info: Any = None) -> float:
    """Mathematical equivalence of the final answer (math-verify)."""
    return math_equal(solution_str, Sample("", "", answer=ground_truth))


def exact_score(data_source: str, solution_str: str, ground_truth: Any,
                extra_info: Any = None) -> float:
    """The extracted final answer equals the ground truth (trimmed, case-folded)."""
    return exact_match(solution_str, Sample("", "", answer=ground_truth))


# data_source values verl's preprocessing scripts write, and the scorer verl routes them to.
ROUTES: dict[str, VerlScore] = {
    "openai/gsm8k": gsm8k_score,
    "gsm8k": gsm8k_score,
    "lighteval/MATH": math_score,
    "DigitalLearningGmbH/MATH-lighteval": math_score,
    "HuggingFaceH4/MATH-500": math_score,
    "math": math_score,
    "math_dapo": math_score,
    "numina_aops_forum": math_score,
    "numina_synthetic_math": math_score,
    "numina_amc_aime": math_score,
    "numina_synthetic_amc": math_score,
    "numina_cn_k12": math_score,
    "numina_olympiads": math_score,
}


def scorer_for(data_source: str) -> VerlScore:
    """The built-in scorer for ``data_source`` (exact match when verl has none for it)."""
    scorer = ROUTES.get(data_source)
    if scorer is None:
        _warn_unrouted(data_source)
        return exact_score
    return scorer


@functools.lru_cache(maxsize=256)
def _warn_unrouted(data_source: str) -> None:
    """Once per source and process (the cache remembers who was warned about)."""
    logger.warning("reward: no built-in scorer for data_source %r: exact match of the final "
                   "answer; set reward.path to your compute_score for another rule", data_source)


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any,
                          extra_info: Any = None) -> float:
    """verl's ``default_compute_score``: the built-in scorer for the row's ``data_source``."""
    return scorer_for(data_source)(data_source, solution_str, ground_truth, extra_info)


def score_value(result: Any) -> float:
    """A verl score as a float: a number (``bool``, ``int``, ``float``, a numpy scalar, a
    one-element tensor or array: what verl writes into its reward tensor), or a dict's
    ``"score"``."""
    if isinstance(result, Mapping):
        if "score" not in result:
            raise RewardError("no_score", f"a dict without 'score' (keys: {sorted(result)})")
        result = result["score"]
    if isinstance(result, numbers.Real):   # bool, int, float, numpy's scalars
        return float(result)
    item = getattr(result, "item", None)   # a tensor or an array of one element
    if callable(item):
        try:
            value = item()
        except (ValueError, RuntimeError):   # more than one element
            value = None
        if isinstance(value, numbers.Real):
            return float(value)
    raise RewardError("not_a_number", f"{type(result).__name__}: {result!r}"[:200])


class VerlReward:
    """``fn(response, sample)`` calling a synchronous verl ``compute_score`` as verl's reward
    managers do: by keyword."""

    def __init__(self, compute_score: VerlScore = default_compute_score) -> None:
        self.compute_score = compute_score

    def arguments(self, response: str, sample: Sample) -> dict[str, Any]:
        extra_info = sample.fields.get("extra_info")
        return {"data_source": str(sample.fields.get("data_source", "")),
                "solution_str": response, "ground_truth": sample.answer,
                "extra_info": extra_info if extra_info is not None else {}}

    def __call__(self, response: str, sample: Sample) -> float:
        return score_value(self.compute_score(**self.arguments(response, sample)))


class AsyncVerlReward(VerlReward):
    """:class:`VerlReward` for an ``async def compute_score``, which verl awaits too."""

    async def __call__(self, response: str, sample: Sample) -> float:  # type: ignore[override]
        return score_value(await self.compute_score(**self.arguments(response, sample)))


def verl_reward(compute_score: VerlScore = default_compute_score) -> VerlReward:
    """The adapter for ``compute_score``: awaited when it is a coroutine function."""
    if is_coroutine_fn(compute_score):
        return AsyncVerlReward(compute_score)
    return VerlReward(compute_score)
