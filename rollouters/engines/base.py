"""The engine protocol: what a workflow and the weight receiver need from an inference engine."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from asyncrl.colocate import Sleeper  # the engines' side of launcher.colocate

__all__ = ["Completion", "Engine", "Sleeper", "check_generate_args"]


@dataclass
class Completion:
    """One sampled continuation. ``versions[i]`` is the policy version that produced
    ``tokens[i]``: weights may change while a sequence is being generated."""

    tokens: list[int]
    logprobs: list[float]  # behaviour logprobs, after temperature
    versions: list[int]
    finish_reason: str  # "stop" (EOS) or "length"
    routing: Any = None
    """``[prompt + tokens, layers, top_k]`` numpy array: the experts each position was routed
    to (:mod:`asyncrl.moe_routing`), from an engine asked to record them; else None."""


def check_generate_args(prompts: list[list[int]], n: int, temperature: float,
                        max_new_tokens: int, greedy: bool,
                        images: list[list[bytes]] | None = None) -> None:
    """The argument checks every engine's :meth:`Engine.generate` makes, in one place."""
    if images is not None and len(images) != len(prompts):
        raise ValueError(f"{len(images)} image lists for {len(prompts)} prompts: give one "
                         "(possibly empty) list per prompt")
    if not prompts or n < 1 or max_new_tokens < 1:
        raise ValueError("need at least one prompt, n >= 1 and max_new_tokens >= 1")
    if not greedy and temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if any(not p for p in prompts):
        raise ValueError("empty prompt")


@runtime_checkable
class Engine(Protocol):
    @property
    def version(self) -> int:
        """Policy version of the weights currently loaded."""

    def generate(self, prompts: list[list[int]], n: int, temperature: float,
                 max_new_tokens: int, greedy: bool = False,
                 images: list[list[bytes]] | None = None) -> list[list[Completion]]:
        """``n`` completions for each prompt (token ids in, token ids out). ``images``: None,
        or one list per prompt of its encoded images (PNG or JPEG bytes), for a
        vision-language model; the prompt's ids are then already expanded, one image pad
        token per merged patch (:mod:`asyncrl.vlm`), so the learner recomputes the same
        sequence."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Replace weights by name and set :attr:`version`; safe to call from another thread
        while :meth:`generate` runs (takes effect at the next decode step). An update with a
        name or a shape the model lacks raises :class:`~asyncrl.weights.fit.WeightsRefused`
        and changes nothing."""

    def close(self) -> None:
        """Release what the engine holds (processes, threads, sockets); idempotent."""

