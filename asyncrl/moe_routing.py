"""The experts an MoE model routed each token to: what both ends of routing replay share.

Routing replay (``learner.routing_replay``; R3 in slime and AReaL) sends the engine's expert
choice of every token to the learner, whose forward then uses it instead of its own router's
choice. Without it, a token the engine routed to experts (2, 5) may be routed to (2, 7) by the
learner, whose weights or kernels differ a little, and its logprob comes from other weights:
train/inference mismatch that MoE RL is known to collapse from.

A routing array is ``[tokens, layers, top_k]``, one row per token of a sample (prompt and
completion), its layers in the model's order of MoE blocks. A position the engine did not
route (the last generated token is never fed back; a tool's output added after the last turn)
holds :func:`unrecorded` in every slot, and the learner routes it itself. It travels in the
wire format as the group's ``routing`` extra (:mod:`asyncrl.wire.group`).

Which routers: transformers' ``Qwen2MoeTopKRouter`` and ``Qwen3MoeTopKRouter``, whose forward
returns ``(router_logits, router_scores, router_indices)`` with the scores a softmax over all
experts, taken at the top-k and renormalised when ``norm_topk_prob``. Others compute their
scores differently (sigmoid, grouped top-k) and are refused rather than replayed wrongly.

numpy only at import; torch is imported by the functions that take a model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from torch import nn

ROUTING = "routing"
"""The name of the routing extra on a :class:`~asyncrl.wire.TrajectoryGroup`."""
ROUTER_CLASSES = ("Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter")


def find_routers(model: nn.Module) -> list[nn.Module]:
    """The model's MoE routers in forward order; ValueError naming ``learner.routing_replay``
    when it has none, or one whose scores this replay does not know how to recompute."""
    routers = [m for m in model.modules() if type(m).__name__ in ROUTER_CLASSES]
    unknown = sorted({type(m).__name__ for m in model.modules()
                      if type(m).__name__.endswith("Router") and m not in routers})
    if unknown:
        raise ValueError(f"learner.routing_replay: the model's routers ({', '.join(unknown)}) "
                         f"are not supported; replay knows {', '.join(ROUTER_CLASSES)}")
    if not routers:
        raise ValueError(f"learner.routing_replay = true but {type(model).__name__} has no MoE "
                         "router to replay (a dense model: set it false)")
    return routers


def routing_dtype(num_experts: int) -> np.dtype:
    """uint8 while every expert index and the unrecorded mark fit (up to 255 experts), else
    int16."""
    return np.dtype("u1") if num_experts < 255 else np.dtype("<i2")


def unrecorded(dtype: np.dtype) -> int:
    """The mark of a position the engine did not route: 255 in uint8, -1 in int16. Any value
    outside ``[0, num_experts)`` reads as unrecorded."""
    return 255 if np.dtype(dtype) == np.dtype("u1") else -1


def pad_routing(routing: np.ndarray, length: int) -> np.ndarray:
    """``routing`` (a prefix of a sample's positions) extended to ``length`` rows of
    :func:`unrecorded`."""
    if len(routing) >= length:
        return routing[:length]
    tail = np.full((length - len(routing), *routing.shape[1:]), unrecorded(routing.dtype),
                   dtype=routing.dtype)
    return np.concatenate([routing, tail])


def merge_routing(old: np.ndarray | None, new: np.ndarray) -> np.ndarray:
    """A multi-turn sample's routing after another turn: ``new`` (the turn's engine call, which
    routed the whole context again) except where ``old`` already holds the routing a position
    had when its own turn generated it, which is the one its behaviour logprob came from."""
    if old is None:
        return new
    merged = new.copy()
    n = min(len(old), len(new))
    recorded = (old[:n] != unrecorded(old.dtype)).all(axis=(-2, -1))
    merged[:n][recorded] = old[:n][recorded]
    return merged
