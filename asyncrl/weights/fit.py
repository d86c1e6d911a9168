"""Does an update fit the engine's model? The check an engine makes before it loads anything.

An update whose names or shapes the engine's model lacks is not a fault that passes: the
learner and this engine hold different models (a fleet started with another ``model.path`` or
``model.tiny``), and every later update is refused the same way. So the refusal is its own
error, :class:`WeightsRefused`, which the receiver does not retry
(:mod:`asyncrl.weights.receiver`) and the rollout worker turns into a config error (its fleet
stops with the reason, and is not restarted into the same refusal).

Checking first also keeps a refused update from being partial. vLLM loads an update tensor by
tensor: one it refuses half-way leaves the layers before it on the new weights and the rest on
the old, under the old version. The torch engine checks its own parameters
(:meth:`~rollouters.engines.torch_engine.TorchEngine.load_weights`); engines whose model lives
in another process (vLLM) check against the shapes of the model class the learner builds from
the same directory (:func:`asyncrl.models.model_shapes`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

SHOWN = 8  # unknown names listed in the message; the count says how many more


class WeightsRefused(ValueError):
    """An update with a name or a shape the engine's model does not have: the learner's model
    and the engine's differ, which no retry mends."""


def check_fit(items: Iterable[tuple[str, Any]], shapes: Mapping[str, Sequence[int]]) -> None:
    """Raise :class:`WeightsRefused` unless every ``(name, tensor)`` names one of ``shapes``
    with that shape (a tensor, or its shape where the update is only announced). Nothing is
    loaded by it: call it before the first tensor moves."""
    items = list(items)
    unknown = sorted(name for name, _ in items if name not in shapes)
    if unknown:
        more = f" and {len(unknown) - SHOWN} more" if len(unknown) > SHOWN else ""
        raise WeightsRefused(f"unknown weight names: {unknown[:SHOWN]}{more}")
    for name, value in items:
        shape = tuple(getattr(value, "shape", value))
        if tuple(shapes[name]) != shape:
            raise WeightsRefused(f"{name}: shape {shape} does not match "
                                 f"{tuple(shapes[name])}")
