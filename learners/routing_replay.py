"""Routing replay in the learner: its forward uses the experts the engine chose.

Each MoE router gets a forward hook that replaces the router's ``(logits, scores, indices)``
output by ``(logits, scores', replayed)``: ``replayed`` is the engine's choice for every token
the engine routed (:mod:`asyncrl.moe_routing`; a token it did not route keeps the learner's own
choice), and ``scores'`` are the learner's own router probabilities at those experts,
``softmax(logits)[replayed]``, renormalised as the router renormalises its top-k. The scores
stay a function of the router's weights, so the router is still trained; only the discrete
choice, which has no gradient anyway, comes from the engine.

The routing in effect is set per micro-batch (:meth:`RoutingReplay.use`) and stays set through
its backward, so activation checkpointing's recomputation routes as the forward did. With several
learner ranks each share's routing travels in the batch's scatter (:mod:`learners.balance`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn

from asyncrl.moe_routing import ROUTING, find_routers, pad_routing
from asyncrl.wire import TrajectoryGroup

if TYPE_CHECKING:
    from learners.batching import TrainBatch

logger = logging.getLogger(__name__)


class RoutingReplay:
    """Hooks on ``model``'s routers that replay a batch's ``routing`` (``packing``: the
    forward packs the rows into one, :func:`learners.packing.pack`)."""

    def __init__(self, model: nn.Module, packing: bool) -> None:
        self.routers = find_routers(model)
        self.packing = packing
        self._flat: Tensor | None = None  # [tokens of the forward, layers, top_k]
        self._handles = [router.register_forward_hook(partial(self._replay, layer))
                         for layer, router in enumerate(self.routers)]
        self._warned = False
        logger.info("routing replay: %d MoE routers (%s) replay the engine's experts",
                    len(self.routers), type(self.routers[0]).__name__)

    def use(self, batch: TrainBatch | None) -> None:
        """Replay ``batch.routing`` in the forwards (and recomputations) that follow, until the
        next call; None, or a batch without routing: the routers choose."""
        if batch is None or batch.routing is None:
            if batch is not None and not self._warned:
                logger.warning("routing replay: a batch came without routing (its engine did "
                               "not record any); the learner routes such batches itself")
                self._warned = True
            self._flat = None
            return
        layers, top_k = len(self.routers), int(self.routers[0].top_k)
        columns = math.prod(batch.routing.shape[2:])
        if columns != layers * top_k:
            raise ValueError(f"routing of {columns} experts a token for a model with "
                             f"{layers} MoE layers of top-{top_k}")
        # A rank's share comes with layers and top-k as one axis (learners.balance).
        routing = batch.routing.reshape(*batch.routing.shape[:2], layers, top_k)
        if self.packing:
            from learners.packing import pack  # it imports learners.batching, which imports us

            _, _, (rows, cols) = pack(batch)
            self._flat = routing[rows, cols]
        else:
            self._flat = routing.reshape(-1, *routing.shape[2:])

    def _replay(self, layer: int, router: nn.Module, args: Any, output: Any) -> Any:
        if self._flat is None:
            return None
        logits, _, own = output
        if logits.shape[0] != self._flat.shape[0]:
            raise ValueError(f"routing for {self._flat.shape[0]} tokens, the forward has "
                             f"{logits.shape[0]}")
        return replayed_output(router, logits, own, self._flat[:, layer].to(own.device))

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def replayed_output(router: nn.Module, logits: Tensor, own: Tensor, replayed: Tensor
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """The router's output with ``replayed`` experts (``[tokens, top_k]``; a token with any
    index outside ``[0, num_experts)`` keeps ``own``) and their scores from ``logits`` as the
    Qwen MoE routers compute them: softmax over every expert in float32, taken at the chosen
    experts, divided by their sum when ``norm_topk_prob``."""
    replayed = replayed.long()
    recorded = ((replayed >= 0) & (replayed < router.num_experts)).all(-1, keepdim=True)
    indices = torch.where(recorded, replayed, own)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    scores = probs.gather(-1, indices)
    if router.norm_topk_prob:
        scores = scores / scores.sum(dim=-1, keepdim=True)
    return logits, scores.to(logits.dtype), indices


def collate_routing(groups: Sequence[TrajectoryGroup], width: int) -> Tensor | None:
    """``[samples, width, layers, top_k]`` int16: every sample's routing (the groups'
    ``routing`` extras) right-padded with the unrecorded mark; None when no group carries one.
    A group without it (or one whose routing does not have a row per token) is routed by the
    learner itself, all of it."""
    carried = [g.extras[ROUTING] for g in groups if ROUTING in g.extras]
    if not carried:
        return None
    shape = carried[0].shape[1:]
    rows = []
    for group in groups:
        routing = group.extras.get(ROUTING)
        usable = (routing is not None and routing.shape == (group.num_tokens, *shape))
        for sample in group.sample_slices():
            row = routing[sample] if usable else np.zeros((0, *shape), np.int16)
            rows.append(pad_routing(row.astype(np.int16), width))
    return torch.from_numpy(np.stack(rows))


__all__ = ["RoutingReplay", "collate_routing", "replayed_output"]
