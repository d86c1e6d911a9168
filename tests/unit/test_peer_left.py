"""``learners.dist.peer_left`` recognises gloo's own error for a rank that left the group,
taken from a real two-process gloo group whose second rank exits mid-run, and nothing else."""

from __future__ import annotations

import os
from datetime import timedelta

from asyncrl.net import ReservedPort
from learners.dist import peer_left
from tests.ranks import rank_context


def _rank(rank: int, port: int, out) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=30))
    values = torch.ones(2)
    dist.all_reduce(values)
    if rank == 1:
        os._exit(9)   # as a SIGKILLed rank: no goodbye to the group
    try:
        dist.all_reduce(values)
        out.put(None)
    except RuntimeError as exc:
        try:   # the failure seen while handling another, as in the learner's cleanup
            raise ValueError("while cleaning up") from None
        except ValueError as during:
            during.__context__ = exc
            out.put((peer_left(exc), peer_left(during), str(exc)))
    dist.destroy_process_group()   # returns at once with the peer gone (no barrier)


def test_a_rank_that_left_is_recognised_in_gloo_errors_and_their_context() -> None:
    ctx = rank_context()
    out = ctx.Queue()
    with ReservedPort() as port:
        procs = [ctx.Process(target=_rank, args=(rank, port, out)) for rank in (0, 1)]
        for proc in procs:
            proc.start()
        found = out.get(timeout=60)
        for proc in procs:
            proc.join(timeout=30)
    assert found is not None, "the collective did not fail with its peer gone"
    direct, through_context, message = found
    assert direct and "by peer" in direct and "This is typically" not in direct, message
    assert through_context == direct
    assert procs[0].exitcode == 0 and procs[1].exitcode == 9


def test_other_failures_are_not_a_rank_that_left() -> None:
    assert peer_left(RuntimeError("CUDA out of memory")) is None
    assert peer_left(ConnectionResetError("reset by peer")) is None   # not a collective
    assert peer_left(None) is None
