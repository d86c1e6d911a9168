"""Set up and tear down the learners' process group (the torch.distributed default group).

The group is process-wide state owned by torch; these helpers only make its start and its end
explicit, so a learner entry point reads ``init → train → shutdown``.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

from asyncrl.devices import resolve_device

logger = logging.getLogger(__name__)


def init_learner_group(rank: int, world: int, *, master_port: int,
                       master_addr: str = "127.0.0.1", device: str = "cpu",
                       timeout_s: float = 300.0) -> torch.device:
    """Join the learners' default process group; returns this rank's device.

    CPU uses gloo. CUDA uses NCCL for CUDA tensors and gloo for CPU ones (``cpu:gloo,cuda:nccl``),
    because a full state dict gathered with ``cpu_offload`` still issues CPU-side collectives.
    The rendezvous is a ``tcp://`` URL rather than ``MASTER_ADDR``/``MASTER_PORT`` so that we do
    not write to the process environment.
    """
    resolved = resolve_device(device, rank)
    if resolved.type == "cuda":
        torch.cuda.set_device(resolved)
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend=backend, init_method=f"tcp://{master_addr}:{master_port}",
                            rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    logger.info("learner rank %d/%d joined %s group at %s:%d on %s",
                rank, world, backend, master_addr, master_port, resolved)
    return resolved


def shutdown_learner_group(barrier: bool = True) -> None:
    """Leave the group: ``barrier()`` THEN ``destroy_process_group()``.

    Measured on gloo: ranks that reach ``destroy_process_group`` at different times abort with
    SIGABRT ("terminate called without an active exception") in 2 of 3 runs; the barrier fixed
    it in every run. ``barrier=False`` when another rank already left (:func:`peer_left`):
    the barrier could only fail again, and destroying a group whose peer is gone returns at
    once (measured). A no-op when no group is initialised.
    """
    if not dist.is_available() or not dist.is_initialized():
        return
    if barrier:
        dist.barrier()
    dist.destroy_process_group()


# What gloo's TCP transport says when the other end of a pair went away (a rank's process
# died or closed its group): "Connection closed by peer", or "Read error ...: Connection
# reset by peer" (measured, torch 2.13), or a write into the closed socket.
_PEER_GONE = ("closed by peer", "reset by peer", "Broken pipe")


def peer_left(exc: BaseException | None) -> str | None:
    """The first line of the collective failure in ``exc`` (or in what it was raised from or
    during) that says another rank's connection closed; None when there is none."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc)
        if isinstance(exc, RuntimeError) and "gloo" in text and any(m in text for m in _PEER_GONE):
            return text.split(". This is typically", 1)[0].strip()
        exc = exc.__cause__ or exc.__context__
    return None


def gather_rows(values: torch.Tensor) -> torch.Tensor:
    """``[world, n]``: every rank's 1-D ``values``, on every rank (one ``all_gather``).
    COLLECTIVE.

    For a few numbers that need several reductions (a sum here, a max there), gathering them
    once and reducing locally replaces one all-reduce per reduction with one collective of
    half the sequential hops (a ring all-reduce takes 2(W − 1) hops, an all-gather W − 1):
    bench/pipeline.py measured one all-reduce of 8 gloo ranks on 2 busy cores at 6-56 ms.
    Every rank reduces the same rows in the same order, so results are identical on all."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values.reshape(1, -1)
    rows = [torch.empty_like(values) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, values.contiguous())
    return torch.stack(rows)

