"""A reserved port: no other process gets it, and the learners' rendezvous still binds it."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest

from asyncrl.net import ReservedPort
from tests.ranks import rank_context, run_ranks


def _all_reduce(rank: int, port: int, out) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
    value = torch.tensor([rank + 1.0])
    dist.all_reduce(value)
    out.put(value.item())
    dist.destroy_process_group()


def test_a_reserved_port_is_kept_from_others_until_closed() -> None:
    reserved = ReservedPort()
    for host in ("127.0.0.1", ""):
        with socket.socket() as other, pytest.raises(OSError, match="in use"):
            other.bind((host, reserved.port))
    # the kernel's own picks skip it too (bind(0), as free_port and servers on port 0 do)
    for _ in range(2000):
        with socket.socket() as other:
            other.bind(("127.0.0.1", 0))
            assert other.getsockname()[1] != reserved.port
    reserved.close()
    with socket.socket() as other:
        other.bind(("127.0.0.1", reserved.port))


def test_the_learners_rendezvous_binds_a_port_held_for_it() -> None:
    """Two ranks form a gloo group on the reserved port while it is held: rank 0's TCPStore
    listens on it (SO_REUSEADDR), as the learner role's ranks do."""
    out = rank_context().Queue()
    with ReservedPort() as port:
        run_ranks(_all_reduce, (port, out), nprocs=2)
    assert sorted(out.get(timeout=10) for _ in range(2)) == [3.0, 3.0]
