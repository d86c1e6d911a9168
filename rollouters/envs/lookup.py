"""``lookup``: a two-turn, tool-using toy environment a tiny random-init model learns on CPU.

The user message is a key (``12``). The value behind it is drawn at random for every episode,
so the only way to answer right is to call the tool ``lookup(12)`` and copy what it returns::

    <bos> 1 2 <sep>  lookup( 1 2 ) <eos>  7 3 <sep>  7 3 <eos>
    user             model: tool call     tool      model: answer

Turn 1 earns 0.1 for calling the tool (``lookup(`` opens the call; the closing bracket is
optional) and up to 0.4 more for the key, turn 2 up to 0.5 for the answer, by the fraction of
positions right (the key's or value's digits, then the end of the turn; extra output counts
against it). Only content is rewarded beyond the call itself: a policy that learned the
syntax alone has everything left to gain, which keeps it from settling there. A dense signal
like this is what lets RL start from chance. A turn that is not a tool call ends the episode.
Success is a return of 1.0. The key space is split by a stable hash: keys with
``crc32(key) % 4 == 0`` are held out for evaluation.
"""

from __future__ import annotations

import random
import re
import zlib

from rollouters.tasks.sample import Sample
from rollouters.workflows.multi_turn import Action, StepResult

TOOL = "lookup"
_UNITS = re.compile(r"lookup\(|\d|\S")
_END = "<end>"
HOLDOUT_MODULUS = 4
CALL_REWARD = 0.1  # for calling the tool at all; the rest of turn 1's 0.5 is the key


def is_held_out(key: str) -> bool:
    return zlib.crc32(key.encode()) % HOLDOUT_MODULUS == 0


def _units(text: str, finished: bool) -> list[str]:
    return _UNITS.findall(text) + ([_END] if finished else [])


def positional_score(expected: list[str], got: list[str]) -> float:
    """Matches at equal positions over the longer length: extra output costs like a miss."""
    hits = sum(a == b for a, b in zip(expected, got))
    return hits / max(len(expected), len(got), 1)


def _content_score(expected: list[str], got: list[str]) -> float:
    """:func:`positional_score`, but 0 for output holding the tool's name: a call where an
    argument or the answer belongs earns nothing, not even for ending the turn on time (else
    a policy that writes `lookup(` everywhere scores, and stops exploring digits)."""
    return 0.0 if "lookup(" in got else positional_score(expected, got)


class LookupEnv:
    """One episode. ``rng`` draws the hidden values (a fresh one per episode is fine)."""

    def __init__(self, key_length: int = 2, value_length: int = 2, eval_repeats: int = 1,
                 rng: random.Random | None = None) -> None:
        self.key_length, self.value_length = key_length, value_length
        self.rng = rng or random.Random()
        self.values: dict[str, str] = {}
        self.key = ""
        self.turn = 0

    def reset(self, sample: Sample) -> str:
        self.key = str(sample.fields.get("key", sample.prompt))
        self.values = {self.key: self._draw()}
        self.turn = 0
        return self.key

    def step(self, action: Action) -> StepResult:
        self.turn += 1
        finished = action.finish_reason == "stop"
        if self.turn == 1:
            call = action.tool_call
            if call is None or call.name != TOOL:
                return StepResult("", 0.0, done=True, info={"called": False})
            arg = str(call.arguments.get("arg", ""))
            reward = CALL_REWARD + (0.5 - CALL_REWARD) * _content_score(
                [*self.key, _END], _units(arg, finished))
            value = self.values.setdefault(arg, self._draw())
            return StepResult(value, reward, done=False, info={"called": True})
        expected = [*self.values[self.key], _END]
        reward = 0.5 * _content_score(expected, _units(action.text, finished))
        return StepResult("", reward, done=True)

    def _draw(self) -> str:
        return "".join(self.rng.choice("0123456789") for _ in range(self.value_length))

    # Samples: the env generates its own prompts (no data file needed).
    @staticmethod
    def samples(rng: random.Random, n: int, key_length: int = 2, **_: object) -> list[Sample]:
        keys = [k for k in _all_keys(key_length) if not is_held_out(k)]
        return [_sample(rng.choice(keys)) for _ in range(n)]

    @staticmethod
    def eval_samples(key_length: int = 2, eval_repeats: int = 1, **_: object) -> list[Sample]:
        """Every held-out key, ``eval_repeats`` times (each episode draws its own value)."""
        return [_sample(k, i) for i in range(eval_repeats) for k in _all_keys(key_length)
                if is_held_out(k)]


def _all_keys(length: int) -> list[str]:
    return [f"{i:0{length}d}" for i in range(10 ** length)]


def _sample(key: str, repeat: int = 0) -> Sample:
    suffix = f"#{repeat}" if repeat else ""
    return Sample(sample_id=f"lookup:{key}{suffix}", prompt=key, fields={"key": key})
