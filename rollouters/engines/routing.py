"""The torch engine's record of the experts each token was routed to (routing replay).

A forward hook on each MoE router keeps the indices it chose. The prefill routes every prompt
token (left-padded rows: a row's prompt is the last columns of the batch), and each decode step
routes the token fed back, the one generated the step before. So a completion of ``n`` tokens
gets the routing of its prompt and of its first ``n − 1`` tokens; its last token is never fed
back, and its row is :func:`~asyncrl.moe_routing.unrecorded` (the learner routes that position
itself; it predicts nothing, so nothing trained depends on it).

The hooks write into a list the calling thread set (thread-local): two ``generate`` calls whose
steps interleave under the engine's lock never see each other's routing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import numpy as np
import torch

from asyncrl.moe_routing import find_routers, routing_dtype, unrecorded
from rollouters.engines.base import Completion


class RoutingRecorder:
    """Hooks on ``model``'s routers; :meth:`record` collects one forward's choices."""

    def __init__(self, model: torch.nn.Module) -> None:
        routers = find_routers(model)
        self.num_layers = len(routers)
        self.top_k = int(routers[0].top_k)
        self.dtype = routing_dtype(int(routers[0].num_experts))
        self._sink = threading.local()
        self._handles = [router.register_forward_hook(partial(self._keep, layer))
                         for layer, router in enumerate(routers)]

    def _keep(self, layer: int, module: torch.nn.Module, args: Any, output: Any) -> None:
        layers = getattr(self._sink, "layers", None)
        if layers is not None:
            layers[layer] = output[2]  # router_indices, [batch × tokens, top_k]

    @contextmanager
    def record(self, steps: list[torch.Tensor], shape: torch.Size) -> Iterator[None]:
        """Around one forward of ``input_ids`` of ``shape`` ``(B, T)``: appends its routing,
        ``[B, T, layers, top_k]`` on the CPU, to ``steps``."""
        layers: list[torch.Tensor | None] = [None] * self.num_layers
        self._sink.layers = layers
        try:
            yield
        finally:
            self._sink.layers = None
        if any(layer is None for layer in layers):
            raise RuntimeError("a router did not run in this forward: cannot record routing")
        stacked = torch.stack(layers, dim=1).to("cpu", torch.int16)  # type: ignore[arg-type]
        steps.append(stacked.view(*shape, self.num_layers, self.top_k))

    def attach(self, completions: Sequence[Completion], steps: list[torch.Tensor],
               prompt_lengths: Sequence[int]) -> None:
        """Give each completion (row ``i`` of the batch) its routing over prompt + tokens."""
        prefill, decoded = steps[0], steps[1:]
        width = prefill.shape[1]
        for row, (completion, prompt) in enumerate(zip(completions, prompt_lengths)):
            fed = len(completion.tokens) - 1  # generated tokens fed back: all but the last
            parts = [prefill[row, width - prompt:]]
            parts += [step[row] for step in decoded[:fed]]
            routing = torch.cat(parts).numpy().astype(self.dtype)
            last = np.full((1, self.num_layers, self.top_k), unrecorded(self.dtype), self.dtype)
            completion.routing = np.concatenate([routing, last])

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


@contextmanager
def maybe_record(recorder: RoutingRecorder | None, steps: list[torch.Tensor],
                 shape: torch.Size) -> Iterator[None]:
    """:meth:`RoutingRecorder.record`, or nothing without a recorder."""
    if recorder is None:
        yield
        return
    with recorder.record(steps, shape):
        yield
