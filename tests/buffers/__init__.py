"""The buffer contract suite (both backends) and Redis-only tests; shared helpers below."""

from __future__ import annotations

import time
from collections.abc import Callable

from asyncrl.wire import TrajectoryGroup


def make_group(name: str, version: int = 0, versions: list[int] | None = None,
               reward: float = 1.0, tokens: int = 4) -> TrajectoryGroup:
    """Two samples of 2 prompt + ``tokens - 2`` generated tokens, generated at ``versions``
    (oldest first matters) or all at ``version``."""
    gen = list(versions or [version] * (tokens - 2))
    gen += [gen[-1]] * (tokens - 2 - len(gen))
    samples = [{"tokens": list(range(5, 5 + tokens)), "logprobs": [0.0, 0.0] + [-0.5] * len(gen),
                "loss_mask": [0, 0] + [1] * len(gen), "versions": [-1, -1, *gen],
                "reward": reward, "finish_reason": "stop"} for _ in range(2)]
    return TrajectoryGroup.from_samples(name, f"prompt-{name}", samples)


def eventually(predicate: Callable[[], bool], timeout_s: float = 10.0, what: str = "",
               poll_s: float = 0.02) -> None:
    """Poll a condition that the system reaches on its own clock, with a deadline."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout_s}s: {what or predicate}")
        time.sleep(poll_s)
