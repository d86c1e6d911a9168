"""The LoRA adapter update as it travels to the engines, and the one merge rule both ends use.

An adapter update is an ordinary weight update (same manifest, buckets and transport) whose
tensor names say what they are: for the linear weight ``W`` named ``N`` (its plain HF name),
``N#lora_A`` is ``A`` (``[r, in]``) and ``N#lora_B`` is ``scale · B`` (``[out, r]``), with
``scale = alpha / r`` folded in by the learner so that the engine needs no LoRA config. The
engine's weight becomes ``W0 + B'·A``, always from its own copy of the base ``W0`` (never from
the previous merge, so updates do not accumulate rounding). ``#`` never occurs in a module
path, so an adapter name can never be taken for a weight name, or the other way round.

Why names rather than a flag on the announcement: the names already reach every engine's apply
call through every transport, unchanged; a flag would have to be threaded through each one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from asyncrl.weights.fit import WeightsRefused

SEPARATOR = "#"
A, B = "lora_A", "lora_B"


def adapter_name(weight_name: str, part: str) -> str:
    """The wire name of one half (``lora_A`` or ``lora_B``) of the adapter on ``weight_name``."""
    if part not in (A, B):
        raise ValueError(f"adapter part must be {A!r} or {B!r}, got {part!r}")
    return f"{weight_name}{SEPARATOR}{part}"


def is_adapter_name(name: str) -> bool:
    return SEPARATOR in name


def split_adapters(named: Iterable[tuple[str, torch.Tensor]]
                   ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]],
                              list[tuple[str, torch.Tensor]]]:
    """``(adapters, weights)``: adapters as ``{weight name: (A, scaled B)}``, and the plain
    named weights. Raises ``ValueError`` when an adapter misses its other half or has an
    unknown part, before anything is applied."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    weights: list[tuple[str, torch.Tensor]] = []
    for name, tensor in named:
        if not is_adapter_name(name):
            weights.append((name, tensor))
            continue
        base, _, part = name.rpartition(SEPARATOR)
        if part not in (A, B):
            raise ValueError(f"{name}: unknown adapter part {part!r}")
        parts.setdefault(base, {})[part] = tensor
    incomplete = sorted(base for base, p in parts.items() if set(p) != {A, B})
    if incomplete:
        raise ValueError(f"adapters without both lora_A and lora_B: {incomplete}")
    return {base: (p[A], p[B]) for base, p in parts.items()}, weights


def merge(base: torch.Tensor, lora_a: torch.Tensor, scaled_b: torch.Tensor) -> torch.Tensor:
    """``base + scaled_b @ lora_a`` as a new tensor in ``base``'s dtype and device; the product
    is taken in float32 (a bf16 ``B·A`` would lose most of a small update)."""
    delta = scaled_b.to(base.device, torch.float32) @ lora_a.to(base.device, torch.float32)
    return (base.float() + delta).to(base.dtype)


def check_targets(adapters: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                  targets: Mapping[str, torch.Tensor]) -> None:
    """Every adapter names a known 2-D weight and fits its shape (checked before any merge)."""
    unknown = sorted(name for name in adapters if name not in targets)
    if unknown:
        raise WeightsRefused(f"adapters on unknown weights: {unknown}")
    for name, (lora_a, scaled_b) in adapters.items():
        shape = targets[name].shape
        if len(shape) != 2 or tuple(shape) != (scaled_b.shape[0], lora_a.shape[1]) \
                or scaled_b.shape[1] != lora_a.shape[0]:
            raise WeightsRefused(f"{name}: adapter B {tuple(scaled_b.shape)} · A "
                                 f"{tuple(lora_a.shape)} does not fit {tuple(shape)}")
