"""What the learner's ranks agree on, each in ONE collective: every rank calls the same
function at the same point, with its own values, and gets the same answer.

Why agree at all: rank 0 alone reads the buffer, yet every rank must take the same branch
(train a batch, wait, stop, save before exit), or one rank waits in a collective the others
never reach. Every helper here is COLLECTIVE (none on a world of one).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from learners.lost import Lost
    from learners.rank_role import RankRole

logger = logging.getLogger(__name__)


def every_rank(world: int, values: list[int]) -> list[list[int]]:
    """Every rank's ``values``, one row per rank, on every rank (one all-gather)."""
    import torch

    from learners.dist import gather_rows

    if world == 1:
        return [values]
    return gather_rows(torch.tensor(values, dtype=torch.int64)).tolist()


def agree_max(world: int, value: int, what: str) -> int:
    """The largest of the ranks' ``value``, on every rank (one all-gather).

    Why: where each rank asks the buffer for itself (the version at resume, at a fresh
    start), the ranks should get the same answer, and what they do next depends on it: the
    version they train on, or whether they stop. A buffer restarted between two ranks'
    requests could answer them differently; ranks that went on with different versions
    would publish under numbers that do not match their weights, and a rank that stopped
    alone would leave the others waiting in their next collective for ever. Differing
    answers are logged."""
    values = [row[0] for row in every_rank(world, [value])]
    if len(set(values)) > 1:
        logger.warning("%s differed between the learner's ranks (%s): going on with the "
                       "largest, %d", what, values, max(values))
    return max(values)


def agree_any(world: int, flags: list[bool]) -> list[bool]:
    """Each flag OR-ed over the ranks (one all-gather)."""
    return [any(column) for column in zip(*every_rank(world, [int(f) for f in flags]))]


def end_of_step(world: int, role: RankRole, version: int, stopping: bool,
                lost: Lost) -> tuple[bool, Any, bool]:
    """ONE all-reduce at the end of a step: whether to stop (rank 0 decides on an eval
    target, any rank may be told to stop), and whether rank 0 already holds the batch of
    ``version`` (prefetched during the step) together with its shares' sizes
    (``role.next_shares``). When it does, the next step starts with no agreement of its own
    and its scatter with no broadcast: two collectives fewer per step, each costing the
    slowest rank's scheduling delay (5-20 ms for 8 ranks on 2 busy cores in
    bench/pipeline.py). Returns ``(stop, header, gone)``; ``header`` is None when the batch
    is not there yet (the next fetch waits); ``gone``: a rank lost the buffer
    (:class:`~learners.lost.BufferLost`), and then ``stop`` says whether any rank was
    stopping as well (``BufferLost.stopping``)."""
    import torch

    from learners.balance import HEADER_COLUMNS
    from learners.dist import gather_rows

    gone = lost.cause is not None
    if world == 1:
        return stopping, None, gone
    shares = torch.zeros(world, HEADER_COLUMNS, dtype=torch.float64)
    ready = False
    if not (stopping or gone):
        prepared = role.next_shares(version)
        if prepared is not None:
            ready, shares = True, prepared.to(torch.float64)
    flags = torch.cat([torch.tensor([float(stopping), float(ready), float(gone)],
                                    dtype=torch.float64), shares.reshape(-1)])
    flags = gather_rows(flags).max(0).values   # the others' zeros leave rank 0's values
    if flags[2]:
        return bool(flags[0]), None, True
    if flags[0]:
        return True, None, False
    header = flags[3:].reshape(world, HEADER_COLUMNS).to(torch.int64)
    return False, (header if flags[1] else None), False
