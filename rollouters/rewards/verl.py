"""verl's reward functions, as they are: ``reward.type = "verl"``.

verl calls ``compute_score(data_source, solution_str, ground_truth, extra_info)`` and accepts a
float or a dict with a ``"score"`` key (the other keys are extra metrics). Users arriving from
verl bring such functions; :class:`VerlReward` adapts one to our
``fn(response, sample) -> float`` (the row's ``data_source`` and ``extra_info`` are on
``sample.fields``, the ground truth is ``sample.answer``, read from ``data.answer_field``).

With no ``reward.path`` the scorer is chosen per row by its ``data_source``, as verl's
``default_compute_score`` does for the datasets its preprocessing scripts write
(:func:`default_compute_score`, itself a verl-signature function): GSM8K's
``#### answer`` (:func:`gsm8k_score`, strict as verl's), MATH-style equivalence by
math-verify (:func:`math_score`), and exact match for any other source (said once per source
in the log, since a silent fallback is how a run scores 0 without anyone noticing).
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

from rollouters.rewards.base import RewardError
from rollouters.rewards.match import exact_match, math_equal
from rollouters.tasks.sample import Sample

__all__ = ["VerlReward", "default_compute_score", "gsm8k_score", "math_score", "score_value",
           "scorer_for"]

logger = logging.getLogger(__name__)

VerlScore = Callable[[str, str, Any, Any], Any]

_GSM8K_FINAL = re.compile(r"#### (\-?[0-9\.\,]+)")


def gsm8k_score(data_source: str, solution_str: str, ground_truth: Any,
                extra_info: Any = None) -> float:
    """1.0 if the last ``#### <number>`` of the solution equals the ground truth (commas
    ignored), as verl's ``gsm8k.compute_score`` in its default strict mode."""
    found = _GSM8K_FINAL.findall(solution_str)
    if not found:
        return 0.0
    return float(found[-1].replace(",", "").rstrip(".") ==
                 str(ground_truth).replace(",", "").strip())


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
    """A verl score as a float: a number, a bool, or a dict's ``"score"``."""
    if isinstance(result, Mapping):
        if "score" not in result:
            raise RewardError("no_score", f"a dict without 'score' (keys: {sorted(result)})")
        result = result["score"]
    if isinstance(result, bool):
        return float(result)
    if isinstance(result, (int, float)):
        return float(result)
    raise RewardError("not_a_number", f"{type(result).__name__}: {result!r}"[:200])


class VerlReward:
    """``fn(response, sample)`` calling a (synchronous) verl ``compute_score``."""

    def __init__(self, compute_score: VerlScore = default_compute_score) -> None:
        self.compute_score = compute_score

    def __call__(self, response: str, sample: Sample) -> float:
        extra_info = sample.fields.get("extra_info")
        return score_value(self.compute_score(
            str(sample.fields.get("data_source", "")), response, sample.answer,
            extra_info if extra_info is not None else {}))
