"""User reward functions loaded by import path in the tests (sync, async, failing, hanging)."""

import asyncio
import os
import threading
import time
from pathlib import Path


def length_reward(response, sample):
    return float(len(response))


async def async_reward(response, sample):
    await asyncio.sleep(0)
    return 0.5


async def async_compute_score(*, data_source, solution_str, ground_truth, **extra):
    """A verl compute_score as its reward loop takes it: async, by keyword."""
    await asyncio.sleep(0)
    return float(solution_str.strip() == ground_truth)


def raising_reward(response, sample):
    raise RuntimeError("boom")


def hanging_reward(response, sample):
    time.sleep(30)
    return 1.0


async def async_hanging_reward(response, sample):
    await asyncio.sleep(30)
    return 1.0


def nan_reward(response, sample):
    return float("nan")


NOT_CALLABLE = 3


def hang_on_some(response, sample):
    """Never returns for the response "hang"; dies for "die"; else the response's length."""
    if response == "hang":
        threading.Event().wait()
    if response == "die":
        os._exit(3)
    return float(len(response))


async def async_blocking_on_some(response, sample):
    """An async reward that blocks its event loop (no await) for ever on "hang"."""
    if response == "hang":
        threading.Event().wait()
    return float(len(response))


def hang_and_mark(response, sample):
    """Writes its process id under $REWARD_MARKS, then never returns."""
    marks = Path(os.environ["REWARD_MARKS"])
    (marks / f"{os.getpid()}.tmp").write_text("hung")
    (marks / f"{os.getpid()}.tmp").rename(marks / str(os.getpid()))
    threading.Event().wait()


def hang_on_row_r3(response, sample):
    """The example's reward, but hung for ever on the data row with id r3."""
    from examples.agent.reward import digit_match

    if sample.sample_id == "r3":
        threading.Event().wait()
    return digit_match(response, sample)
