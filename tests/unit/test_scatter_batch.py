"""learners.balance.scatter_batch: every rank gets exactly its token-balanced share, over gloo."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest
import torch
import torch.distributed as dist

from asyncrl.net import ReservedPort
from learners.balance import pack_shares, scatter_batch, split_batch
from learners.batching import collate
from tests.ranks import run_ranks
from tests.unit.test_zmq_buffer import make_group

pytestmark = pytest.mark.timeout(120)


def _check_share(rank: int, world: int, port: int, groups: int, routed: bool,
                 images: bool = False) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{port}")
    try:
        batch = collate([make_group(f"g{i}", version=i, generated=2 + 3 * i)
                         for i in range(groups)], True, 0)
        if routed:  # learner.routing_replay: [B, T, layers, top_k] travels too
            routing = torch.arange(batch.input_ids.numel() * 6, dtype=torch.int16) % 7
            batch = replace(batch, routing=routing.reshape(*batch.input_ids.shape, 3, 2))
        if images:  # a VLM's rows: [B, patches, dim] pixels and [B, images, 3] grids
            rows = batch.num_samples
            pixels = torch.arange(rows * 8 * 5, dtype=torch.float32) / 7   # same on every rank
            batch = replace(batch, pixel_values=pixels.reshape(rows, 8, 5),
                            image_grid_thw=torch.arange(rows * 2 * 3).reshape(rows, 2, 3) % 4)
        want = split_batch(batch, world)[rank]  # a pad row where a rank has no sample
        # the batch itself, then packed beforehand (as the learner's prefetch thread does)
        for outgoing in (batch, pack_shares(batch, world)):
            got = scatter_batch(outgoing if rank == 0 else None, rank, world)
            for f in fields(want):
                mine, expected = getattr(got, f.name), getattr(want, f.name)
                if expected is None:  # routing, when these groups carry none
                    assert mine is None, f.name
                    continue
                if f.name == "routing":  # layers and top-k travel as one axis
                    expected = expected.flatten(2)
                assert mine.dtype == expected.dtype, f.name
                assert torch.equal(mine, expected), (rank, f.name, mine, expected)
        if rank == 0:
            with pytest.raises(ValueError, match="shares packed for 2 ranks, the world is 3"):
                scatter_batch(pack_shares(batch, 2), rank, world)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("groups, routed, images", [(5, False, False), (1, False, False),
                                                    (5, True, True)])
def test_each_rank_receives_its_share_field_for_field(groups: int, routed: bool,
                                                      images: bool) -> None:
    """1 group = 2 samples for 3 ranks: one pad share. ``routed``: with routing replay's
    ``routing`` field; ``images``: with a VLM's pixels and grids (``learners.vision``)."""
    with ReservedPort() as port:
        run_ranks(_check_share, args=(3, port, groups, routed, images), nprocs=3)


class _Prefetched:
    """What end_of_step reads of rank 0's role: the next batch's shares, if fetched."""

    def __init__(self, packed) -> None:
        self._packed = packed

    def next_shares(self, version: int):
        return self._packed.header if version == 5 else None

    def sent_totals(self) -> list[int]:
        return [0, 0]   # no weights sent (weights.fanout: learners.rank_role)

    def ranks_sent(self, totals: list[list[int]]) -> None:
        pass


def _check_end_of_step(rank: int, world: int, port: int) -> None:
    from learners.agreement import end_of_step
    from learners.lost import Lost
    from learners.rank_role import OtherRank

    dist.init_process_group("gloo", rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{port}")
    try:
        batch = collate([make_group(f"g{i}", version=i, generated=2 + 3 * i)
                         for i in range(5)], True, 0)
        packed = pack_shares(batch, world)
        role = _Prefetched(packed) if rank == 0 else OtherRank()
        # fetched during the step: every rank learns the shares' sizes with the stop flag
        stopping, header, gone = end_of_step(world, role, 5, False, Lost())
        assert not stopping and not gone and torch.equal(header, packed.header)
        got = scatter_batch(packed if rank == 0 else None, rank, world, header)
        assert torch.equal(got.input_ids, split_batch(batch, world)[rank].input_ids)
        assert end_of_step(world, role, 6, False, Lost()) == (False, None, False)  # not yet
        assert end_of_step(world, role, 5, rank == world - 1, Lost()) == (True, None, False)
        # one rank's buffer request got no answer: every rank learns it, batch or not, and
        # whether any rank was stopping as well (then the loss ends the learner as a stop)
        lost = Lost()
        if rank == 1:
            lost.cause = TimeoutError("no reply")
        assert end_of_step(world, role, 5, False, lost) == (False, None, True)
        assert end_of_step(world, role, 5, rank == 2, lost) == (True, None, True)
    finally:
        dist.destroy_process_group()


def test_end_of_step_agrees_on_stop_and_the_next_shares_in_one_collective() -> None:
    with ReservedPort() as port:
        run_ranks(_check_end_of_step, args=(3, port), nprocs=3)
