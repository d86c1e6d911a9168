"""Who serves whom when several learner ranks send (:mod:`asyncrl.weights.fanout`): pure
functions of an announcement, which the broadcaster, the receivers and the senders all
compute alike. Free of torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

SENDER_PREFIX = "learner-sender-"


def sender_name(rank: int) -> str:
    """The name learner rank ``rank`` (>= 1) joins the handshake under."""
    return f"{SENDER_PREFIX}{rank}"


def slices(members: Sequence[str], senders: int) -> list[list[str]]:
    """The engines each learner rank serves: ``members[k::senders]`` for rank ``k``."""
    return [list(members[k::senders]) for k in range(max(1, senders))]


def slice_group(group: str, senders: int, index: int) -> str:
    """The name of slice ``index``'s group in an epoch named ``group``."""
    return group if senders <= 1 else f"{group}-s{index}"


@dataclass(frozen=True)
class Seat:
    """Where one party sits in an epoch: its slice, the slice's group, its rank, its size."""

    slice: int
    group: str
    rank: int
    world: int


def seat(ann: Mapping[str, Any], member: str) -> Seat:
    """``member``'s seat in the epoch ``ann`` announces (``member`` must be listed)."""
    senders = int(ann.get("senders", 1))
    for index, part in enumerate(slices(ann["members"], senders)):
        if member in part:
            return Seat(index, slice_group(ann["group"], senders, index),
                        part.index(member) + 1, len(part) + 1)
    raise KeyError(f"{member} is not a member of epoch {ann.get('epoch')}")
