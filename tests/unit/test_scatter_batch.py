"""learners.balance.scatter_batch: every rank gets exactly its token-balanced share, over gloo."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from learners.balance import scatter_batch, split_batch
from learners.batching import collate
from learners.dist import free_port
from tests.unit.test_zmq_buffer import make_group

pytestmark = pytest.mark.timeout(120)


def _check_share(rank: int, world: int, port: int, groups: int) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{port}")
    try:
        batch = collate([make_group(f"g{i}", version=i, generated=2 + 3 * i)
                         for i in range(groups)], True, 0)
        got = scatter_batch(batch if rank == 0 else None, rank, world)
        want = split_batch(batch, world)[rank]  # a pad row where a rank has no sample
        for f in fields(want):
            mine, expected = getattr(got, f.name), getattr(want, f.name)
            assert mine.dtype == expected.dtype, f.name
            assert torch.equal(mine, expected), (rank, f.name, mine, expected)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("groups", [5, 1])  # 1 group = 2 samples for 3 ranks: one pad share
def test_each_rank_receives_its_share_field_for_field(groups: int) -> None:
    mp.spawn(_check_share, args=(3, free_port(), groups), nprocs=3)
