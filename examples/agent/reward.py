"""An example user reward, loaded by import path:
`reward.path = "examples.agent.reward:digit_match"`.

`fn(response, sample) -> float`, sync or async. If it raises or runs past `reward.timeout_s`,
the sample scores 0 and the failure is counted and logged with the sample id.
"""

from __future__ import annotations

from rollouters.tasks.sample import Sample


def digit_match(response: str, sample: Sample) -> float:
    """Fraction of the answer's digits right, position by position (a dense reward)."""
    want, got = str(sample.answer), response.strip()
    hits = sum(a == b for a, b in zip(want, got))
    return hits / max(len(want), len(got), 1)
