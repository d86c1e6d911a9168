"""Built-in verifiable digit tasks: copy, reverse or sort L digits.

Prompt ``[BOS, d1..dL, SEP]``, target ``t1..tL, EOS``. The reward is dense (the fraction of
positions right, see :meth:`DigitTask.reward`), which is what lets a random-init model learn
these by RL on a CPU.

The prompt space is split by a stable hash (``crc32(digits) % 8 == 0`` is held out), so eval
prompts can never appear in training, in any process, whatever the seeds.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from asyncrl.config.errors import ConfigError
from asyncrl.config.schema import TaskConfig, TinyModelConfig
from asyncrl.models import BOS_ID, DIGIT_OFFSET, EOS_ID, SEP_ID

HOLDOUT_MODULUS = 8
_ENUMERATE_MAX_LENGTH = 5  # up to 10**5 prompts: enumerate; beyond, rejection-sample
_TRANSFORMS: dict[str, Callable[[str], str]] = {
    "copy": lambda s: s,
    "reverse": lambda s: s[::-1],
    "sort": lambda s: "".join(sorted(s)),
}


@dataclass(frozen=True)
class Prompt:
    """One task instance: what the policy sees (``tokens``, and ``images``: encoded PNGs, for
    a vision-language model) and what it should write."""

    prompt_id: str
    tokens: list[int]
    target: list[int]
    images: tuple[bytes, ...] = ()


class Task(Protocol):
    """What workflows and evaluation need from a task."""

    name: str

    def reward(self, prompt: Prompt, completion_tokens: Sequence[int]) -> float: ...

    def exact(self, prompt: Prompt, completion_tokens: Sequence[int]) -> bool: ...

    def eval_prompts(self) -> list[Prompt]: ...


def is_held_out(digits: str) -> bool:
    """Stable across processes and Python versions (unlike ``hash``)."""
    return zlib.crc32(digits.encode()) % HOLDOUT_MODULUS == 0


def _ids(digits: str) -> list[int]:
    return [DIGIT_OFFSET + int(c) for c in digits]


class DigitTask:
    """A digit task with a fixed held-out eval set of ``eval_size`` prompts."""

    def __init__(self, name: str, length: int, eval_size: int, seed: int) -> None:
        if name not in _TRANSFORMS:
            raise ValueError(f"unknown digit task {name!r}; expected one of {sorted(_TRANSFORMS)}")
        if length < 1:
            raise ValueError(f"task.length must be >= 1, got {length}")
        self.name = name
        self.length = length
        self.eval_size = eval_size
        self._transform = _TRANSFORMS[name]
        self._train_pool, held_out = self._enumerate() if length <= _ENUMERATE_MAX_LENGTH \
            else (None, None)
        self._eval = self._pick_eval(held_out, random.Random(f"{name}-{length}-{seed}-eval"))

    def make_prompt(self, digits: str) -> Prompt:
        target = _ids(self._transform(digits)) + [EOS_ID]
        return Prompt(prompt_id=f"{self.name}:{digits}",
                      tokens=[BOS_ID, *_ids(digits), SEP_ID], target=target)

    def sample(self, rng: random.Random, n: int) -> list[Prompt]:
        """``n`` training prompts (with replacement), never one of the held-out space."""
        if self._train_pool is not None:
            return [self.make_prompt(rng.choice(self._train_pool)) for _ in range(n)]
        return [self.make_prompt(self._draw(rng, held_out=False)) for _ in range(n)]

    def eval_prompts(self) -> list[Prompt]:
        """The fixed held-out eval set (same list for the same name, length, size and seed)."""
        return [self.make_prompt(d) for d in self._eval]

    def reward(self, prompt: Prompt, completion_tokens: Sequence[int]) -> float:
        """Positions matched over the longer of the target (digits, then EOS) and the
        completion up to its first EOS: missing positions are wrong, and so are extra ones.

        Counting extra tokens keeps a gradient on where to stop. Over the target's positions
        alone, "the digits, then anything but EOS" scores (L)/(L+1) for every sample once the
        digits are learnt; the group's advantages are then all zero and the policy never finds
        EOS (the quickstart plateaued at 0.8 that way in about one run in seven)."""
        return positions_matched(prompt.target, completion_tokens)

    def exact(self, prompt: Prompt, completion_tokens: Sequence[int]) -> bool:
        """The completion up to and including its first EOS equals the target."""
        return exact_match(prompt.target, completion_tokens)

    def _enumerate(self) -> tuple[list[str], list[str]]:
        everything = (f"{i:0{self.length}d}" for i in range(10 ** self.length))
        train: list[str] = []
        held_out: list[str] = []
        for digits in everything:
            (held_out if is_held_out(digits) else train).append(digits)
        if not train:
            raise ValueError(f"task.length={self.length} leaves no training prompts")
        return train, held_out

    def _draw(self, rng: random.Random, held_out: bool) -> str:
        while True:
            digits = "".join(rng.choice("0123456789") for _ in range(self.length))
            if is_held_out(digits) == held_out:
                return digits

    def _pick_eval(self, held_out: list[str] | None, rng: random.Random) -> list[str]:
        # For long prompts, only claim a conservative half of the ~10**L / 8 held-out strings.
        available = len(held_out) if held_out is not None \
            else 10 ** self.length // (2 * HOLDOUT_MODULUS)
        if self.eval_size > available:  # a ConfigError: `asyncrl up` checks it at start
            raise ConfigError(
                f"task.eval_size={self.eval_size} exceeds the {available} held-out prompts of "
                f"{self.name} with task.length={self.length}; lower task.eval_size or raise "
                f"task.length")
        if held_out is not None:
            return rng.sample(held_out, self.eval_size)
        chosen: dict[str, None] = {}
        while len(chosen) < self.eval_size:
            chosen[self._draw(rng, held_out=True)] = None
        return list(chosen)


def _until_eos(tokens: Sequence[int]) -> list[int]:
    tokens = list(tokens)
    return tokens[:tokens.index(EOS_ID) + 1] if EOS_ID in tokens else tokens


def positions_matched(target: Sequence[int], completion_tokens: Sequence[int]) -> float:
    """:meth:`DigitTask.reward`: positions right over the longer of target and completion."""
    tokens = _until_eos(completion_tokens)
    hits = sum(1 for got, want in zip(tokens, target) if got == want)
    return hits / max(len(target), len(tokens))


def exact_match(target: Sequence[int], completion_tokens: Sequence[int]) -> bool:
    """The completion up to and including its first EOS equals ``target``."""
    return _until_eos(completion_tokens) == list(target)


def make_task(cfg: TaskConfig, seed: int, tiny: TinyModelConfig | None = None) -> Task:
    """The task a config names; ``seed`` fixes which held-out prompts form the eval set.
    ``tiny``: the tiny model's config, whose token ids the visual ``colour`` task uses."""
    if cfg.name == "colour":
        from rollouters.tasks.colours import make_colour_task

        return make_colour_task(cfg, tiny or TinyModelConfig(), seed)
    return DigitTask(cfg.name, cfg.length, cfg.eval_size, seed)
