"""User reward functions loaded by import path in the tests (sync, async, failing, hanging)."""

import asyncio
import time


def length_reward(response, sample):
    return float(len(response))


async def async_reward(response, sample):
    await asyncio.sleep(0)
    return 0.5


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
