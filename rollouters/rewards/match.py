"""Answer-matching rewards: exact string match and math equivalence (``math-verify``)."""

from __future__ import annotations

import re

from rollouters.tasks.sample import Sample

_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")


def extract_answer(response: str) -> str:
    """The last ``\\boxed{...}``, else the text after the last 'Answer:', else the last line."""
    boxed = _BOXED.findall(response)
    if boxed:
        return boxed[-1].strip()
    if "answer:" in response.lower():
        return response[response.lower().rindex("answer:") + len("answer:"):].strip()
    lines = [line for line in response.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def exact_match(response: str, sample: Sample) -> float:
    """1.0 if the extracted answer equals ``sample.answer`` (whitespace-trimmed, case-folded)."""
    if sample.answer is None:
        raise ValueError(f"sample {sample.sample_id} has no answer to match")
    return float(extract_answer(response).casefold() == str(sample.answer).strip().casefold())


def math_equal(response: str, sample: Sample) -> float:
    """1.0 if the response's final answer is mathematically equal to ``sample.answer``.

    Uses ``math-verify`` (LaTeX and plain expressions, sets, intervals, units). Its own
    SIGALRM timeouts work only on the main thread, so they are off here. An answer such as
    ``9^{9^{9^9}}`` makes sympy compute for good without releasing the interpreter lock (no
    other thread of the process runs meanwhile), which is why the math reward runs in the
    reward pool's processes (:mod:`rollouters.rewards.pool`), killed at ``reward.timeout_s``.
    """
    from math_verify import parse, verify

    if sample.answer is None:
        raise ValueError(f"sample {sample.sample_id} has no answer to compare")
    gold_text = str(sample.answer)
    gold = parse(gold_text if "$" in gold_text else f"${gold_text}$",
                 parsing_timeout=None)
    predicted = parse(response, parsing_timeout=None)
    if not gold or not predicted:
        return 0.0
    return float(verify(gold, predicted, timeout_seconds=None))
