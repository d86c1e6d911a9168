"""Rank 0's side of each step's batch: fetched ahead, held under lease while it trains,
acked, and reported on (what was filtered, how stale it was, whether the data ran out).

Only rank 0 reads the buffer; the other ranks get their shares in the scatter. The batch is
fetched, filtered, collated and split on the prefetch thread (:mod:`learners.prefetch`)
during the step before, so a step usually starts with its batch there.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from buffers import connect_buffer
from buffers.lease import keep_leased
from buffers.protocol import DATA_EXHAUSTED
from learners.lifecycle import groups_consumed

if TYPE_CHECKING:
    from asyncrl.config import Config
    from learners.lost import Lost
    from learners.prefetch import BatchPrefetcher
    from learners.rank_role import RankContext

logger = logging.getLogger(__name__)

BATCH_POLL_S = 2.0  # get_batch long-poll; between polls rank 0 re-syncs engines that joined late


class BatchFeed:
    """The batch rank 0 holds for the step, from its prefetcher."""

    def __init__(self, ctx: RankContext, prefetcher: BatchPrefetcher) -> None:
        self.ctx, self.cfg, self.prefetcher = ctx, ctx.cfg, prefetcher
        self.batch: Any = None      # as the buffer delivered it: acked after the step
        self.outgoing: Any = None   # collated, packed for the scatter
        self.filter_counts: dict[str, int] = {}

    @classmethod
    def connect(cls, ctx: RankContext, pad_id: int, vision: Any = None) -> BatchFeed:
        """The next batch is fetched and collated on a thread of its own, with its own
        client; rows are padded with the model's ``pad_id`` (:mod:`asyncrl.tokens`).
        ``vision``: a VLM's :class:`~learners.vision.LearnerVision` (None: text only)."""
        from learners.prefetch import BatchPrefetcher

        cfg = ctx.cfg
        return cls(ctx, BatchPrefetcher(
            connect_buffer(cfg, ctx.address, ctx.stop), ctx.member,
            cfg.learner.groups_per_step, lambda batch: _prepare(cfg, ctx.world, batch, pad_id, vision),
            BATCH_POLL_S, cfg.buffer.reclaim_idle_s))

    def poll(self, version: int, stop: threading.Event, lost: Lost) -> tuple[bool, bool]:
        """Wait up to :data:`BATCH_POLL_S` for the batch of ``version`` (none once stopped);
        without one, ask whether the data ran out. Returns ``(got, ran_out)``."""
        taken = None
        if not stop.is_set():
            taken = lost.call(self.prefetcher.take, version, BATCH_POLL_S)
        self._hold(taken)
        ran_out = (taken is None and not stop.is_set()
                   and lost.call(self.data_ran_out, default=False))
        return taken is not None, ran_out

    def take_ready(self, version: int) -> None:
        """Hold the batch every rank agreed is fetched already (at the end of the step
        before, :func:`~learners.agreement.end_of_step`)."""
        taken = self.prefetcher.take(version, 0.0)
        if taken is None:
            raise RuntimeError(f"the batch of version {version} was agreed ready and is not")
        self._hold(taken)

    @contextlib.contextmanager
    def leased(self) -> Iterator[Any]:
        """The step may outlast buffer.reclaim_idle_s: the batch's lease is renewed
        meanwhile, so it is not redelivered to another learner and trained twice."""
        with keep_leased(self.ctx.client, self.ctx.member, self.batch,
                         self.cfg.buffer.reclaim_idle_s):
            yield self.outgoing

    def prefetch(self, version: int) -> None:
        """Fetch the next batch while this one trains (called after the scatter: not
        competing with it for rank 0's interpreter); none past the last step."""
        if version < self.cfg.learner.total_steps:
            self.prefetcher.start(version)

    def next_shares(self, version: int) -> Any | None:
        prepared = self.prefetcher.prepared(version)
        return prepared[0].header if prepared is not None else None

    def ack(self, version: int, metrics: dict[str, Any], lost: Lost) -> dict[str, Any]:
        """Only now may the buffer forget the trained groups; the count lets a broker that
        lost its state take over the steps it did not see (``BufferClient.ack``). Adds the
        batch's filter counts and staleness to ``metrics``; returns its stats."""
        lost.call(self.ctx.client.ack, self.ctx.member, self.batch,
                  consumed=groups_consumed(self.cfg, version))
        metrics.update({f"filter/{k}": float(v) for k, v in self.filter_counts.items()})
        metrics.update(consumed_versions(self.batch.groups, version - 1,
                                         self.cfg.buffer.max_staleness))
        return self.batch.stats

    def data_ran_out(self) -> bool:
        """Whether the data ran out for good (:func:`data_ran_out`); said once, when it did.
        Without ``data.epochs`` over a ``data.path`` it never does: no status request."""
        if not (self.cfg.data.path and self.cfg.data.epochs):
            return False
        why = data_ran_out(self.ctx.client.status(), self.cfg.learner.groups_per_step)
        if why is not None:
            logger.info("the data ran out: %s", why)
        return why is not None

    def close(self) -> None:
        self.prefetcher.close()

    def _hold(self, taken: tuple[Any, Any] | None) -> None:
        self.batch, (self.outgoing, self.filter_counts) = (taken if taken is not None
                                                           else (None, (None, {})))


def _prepare(cfg: Config, world: int, batch, pad_id: int, vision: Any = None):
    """On the prefetch thread: the step's batch collated (:func:`_collate`) and, with
    several ranks, already split and packed for the scatter (none of it is collective)."""
    from learners.balance import pack_shares

    whole, filter_counts = _collate(cfg, batch, pad_id, vision)
    return (pack_shares(whole, world) if world > 1 else whole), filter_counts


def _collate(cfg: Config, batch, pad_id: int, vision: Any = None):
    """The step's groups, filtered (DAPO), as ONE batch with advantages per group; a VLM's
    groups with their images' pixels, those whose images fail dropped and counted
    (:mod:`learners.vision`)."""
    from learners.batching import collate
    from learners.losses.filters import filter_groups, zero_loss_mask

    groups, filter_counts = filter_groups(batch.groups, cfg.learner.loss)
    # train_step is collective: a step whose groups were all filtered still runs, with a group
    # that trains no token.
    groups = groups or [zero_loss_mask(batch.groups[0])]
    inputs = None
    if vision is not None:
        checked, inputs, dropped = vision.prepare(groups)
        filter_counts.update({f"dropped_{reason}": n for reason, n in dropped.items()})
        if not checked:   # every group's images failed: one that trains nothing, no images
            checked, inputs = [vision.without_images(zero_loss_mask(groups[0]), pad_id)], [None]
        groups = checked
    loss = cfg.learner.loss
    return collate(groups, cfg.learner.advantage_std_norm, pad_id, advantage=loss.advantage,
                   step_advantage=loss.step_advantage, step_gamma=loss.step_gamma,
                   vision=inputs), filter_counts


def consumed_versions(groups, version: int, max_staleness: int) -> dict[str, Any]:
    """Staleness of what this step trained on: the whole batch, on rank 0 (the s = 0 test
    reads it), with ``staleness/hist``: groups consumed at staleness 0..s (the gate admits no
    more; anything older was dropped by the buffer)."""
    versions = [v for g in groups if (v := g.versions[g.loss_mask.astype(bool)]).size]
    # A group that generated no trained token is as fresh as can be (the buffer's rule):
    # counted as -1's staleness it read as version + 1 steps stale.
    stale = [g.staleness(version) for g in groups]
    hist = [0] * (max_staleness + 1)
    for value in stale:
        hist[min(max(value, 0), max_staleness)] += 1
    span = ({"staleness/consumed_version_min": float(min(int(v.min()) for v in versions)),
             "staleness/consumed_version_max": float(max(int(v.max()) for v in versions))}
            if versions else {})  # none when no group of the batch has a trained token
    return {**span, "staleness/max": float(max(stale)),
            "staleness/mean": sum(stale) / len(stale), "staleness/hist": hist}


def data_ran_out(status: dict[str, Any], groups_per_step: int) -> str | None:
    """Why no batch can come any more, from a buffer's ``status()``, or None while one may.

    A rollout worker whose share of data.path ran out (``data.epochs`` passes) exits, its
    last heartbeat saying so with its share (:data:`~buffers.protocol.DATA_EXHAUSTED`).
    Once every share of the fleet's split ran out and the buffer holds less than a step,
    nothing will fill the next batch: the learner used to wait for it for ever, and ``asyncrl
    up`` with it, saying nothing. Shares are counted, not workers: a restarted worker reads
    its share on from where it stopped, and runs out with it."""
    shares: set[int] = set()
    fleets: set[int] = set()
    for member in status.get("members", {}).values():
        info = member.get("info") or {}
        if member.get("role") == "rollout" and info.get("exit") == DATA_EXHAUSTED:
            index, workers = info["shard"]
            shares.add(index)
            fleets.add(workers)
    if len(fleets) != 1:   # no share ran out yet, or fleets that split the data differently
        return None
    workers, = fleets
    depth, in_flight = status.get("depth", 0), status.get("in_flight", 0)
    if shares != set(range(workers)) or depth >= groups_per_step or in_flight:
        return None
    return (f"the {workers} rollout workers' shares of data.path all ran out, and the buffer "
            f"holds {depth} group(s), fewer than learner.groups_per_step = {groups_per_step}")
