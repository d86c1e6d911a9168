"""The learner's ranks agree on what each asked the buffer for itself: two gloo ranks, each
talking to a real ZMQ broker of its own, the two brokers at different versions (what a broker
restarted between the ranks' requests would answer). Without the agreement, a fresh start
stopped one rank and sent the other into its first collective, where it waited for ever; a
resume went on with a different version on each rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from asyncrl.config.schema import Config, RunConfig
from asyncrl.net import ReservedPort
from tests.ranks import run_ranks
from tests.unit.test_zmq_buffer import broker  # noqa: F401 (fixture: real brokers)

pytestmark = pytest.mark.timeout(120)


def _fresh_start(rank: int, world: int, port: int, addresses: list[str], run_dir: str,
                 results: dict) -> None:
    from asyncrl.config import ConfigError
    from buffers.zmq_client import ZmqBufferClient
    from learners.agreement import agree_max
    from learners.lifecycle import check_fresh_buffer
    from learners.rank_role import RankContext

    dist.init_process_group("gloo", rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{port}")
    client = ZmqBufferClient(addresses[rank], timeout_s=10)
    try:
        cfg = Config(run=RunConfig(name="agree", output_dir=Path(run_dir)))
        ctx = RankContext(cfg, rank, world, client, f"learner-{rank}")
        assert agree_max(ctx.world, 10 * rank + 1, "a number") == 10 * (world - 1) + 1
        try:
            check_fresh_buffer(ctx)
            results[rank] = "went on"
        except ConfigError as exc:
            results[rank] = str(exc)
        dist.barrier()  # a rank that went on alone would wait here for ever
    finally:
        client.close()
        dist.destroy_process_group()


def test_ranks_answered_differently_at_a_fresh_start_stop_together(broker,  # noqa: F811
                                                                   tmp_path: Path) -> None:
    from buffers.zmq_client import ZmqBufferClient

    fresh, ahead = broker(), broker()
    with ZmqBufferClient(ahead, timeout_s=5) as client:
        client.publish_version(3)
    results = mp.Manager().dict()
    with ReservedPort() as port:
        run_ranks(_fresh_start, args=(2, port, [fresh, ahead], str(tmp_path), results),
                  nprocs=2)
    assert set(results.keys()) == {0, 1}
    for rank in (0, 1):
        assert "the buffer holds this run at version 3" in results[rank], results[rank]


def test_one_rank_is_its_own_agreement() -> None:
    from learners.agreement import agree_max

    assert agree_max(1, 7, "a number") == 7
