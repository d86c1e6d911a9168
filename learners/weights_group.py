"""Transport pieces of the weight broadcast: control-plane keys, the group, and bounded waits.

The broadcast group lives beside the learners' world (a standalone process group over its own
``TCPStore``, see ``notes/cpu-stack.md``), so rollout processes never join the learners'
``init_process_group``. Everything here is bounded by a timeout: a dead peer costs at most one
timeout, never a hang. Only :func:`new_group` knows the backend; moving to NCCL changes that
function and the buffers' device, not the announcement or the bucket format.
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from buffers.protocol import ControlPlane

logger = logging.getLogger(__name__)

ANNOUNCE_KEY = "weights/announce"  # broadcaster → receivers: one update (see WeightBroadcaster)
GROUP_KEY = "weights/group"  # broadcaster → receivers: {"epoch", "store", "go": bool}


def join_key(member: str) -> str:
    """Receiver → broadcaster: ``{"epoch", "store"}``, "I am about to create the group"."""
    return f"weights/join/{member}"


def ack_key(member: str) -> str:
    """Receiver → broadcaster: ``{"version", "epoch", "store"}``, "I loaded this version"."""
    return f"weights/ack/{member}"


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def serve_store(host: str, timeout_s: float) -> dist.TCPStore:
    """A ``TCPStore`` server listening on ``host`` only: we bind the socket and hand its fd
    over, because the store's own listener would bind every interface. The store owns the fd
    from then on (it closes it when it goes), so the Python socket lets go of it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind((host, 0))
        listener.listen()
        store = dist.TCPStore(host, listener.getsockname()[1], is_master=True,
                              wait_for_workers=False, timeout=_timeout(timeout_s),
                              master_listen_fd=listener.fileno())
        listener.detach()
    return store


def dial_store(address: str, timeout_s: float) -> dist.TCPStore:
    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=_timeout(timeout_s))


def buffer_device(transport: str) -> torch.device:
    """Where bucket buffers live for ``transport`` (NCCL would need CUDA buffers)."""
    return torch.device("cuda" if transport == "nccl" else "cpu")


def group_name(token: str, epoch: int) -> str:
    """The name of one epoch's group: unique per broadcaster (``token``) and epoch, because
    a long-lived engine (an SGLang server) keeps every group it joined by name and refuses to
    join a second group of the same name."""
    return f"asyncrl-{token}-epoch{epoch}"


def new_group(transport: str, store: dist.Store, name: str, rank: int, world: int,
              timeout_s: float, host: str, **transport_opts: Any) -> dist.ProcessGroup:
    """The broadcast group ``name`` (one membership epoch); blocks until all ``world`` ranks
    joined (or raises after ``timeout_s``). ``transport_opts`` come from the announcement
    (``sim``: ``s_per_byte``).

    The store keys follow the layout of SGLang's ``init_custom_process_group`` (also vLLM's
    and OpenRLHF's): ``PrefixStore(name, store)`` handed to torch's
    ``_new_process_group_helper``, which adds ``PrefixStore(f"{name}/")`` and, per device
    backend, ``PrefixStore("cpu/")`` for gloo. Building the same chain here lets an SGLang
    server (rank >= 1 via ``/init_weights_update_group``) meet our ranks in one group, while
    this process keeps the group out of torch's global registry (no default group needed,
    no name clashes, nothing to unregister)."""
    if transport == "sim":
        from learners.weights_sim import SimGroup

        group = SimGroup(rank, world, float(transport_opts["s_per_byte"]))
        return group  # type: ignore[return-value]  # what broadcast_async and drop_group use
    if transport != "gloo":
        raise NotImplementedError(f"weight transport {transport!r} (gloo or sim)")
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    opts._timeout = _timeout(timeout_s)
    keys = dist.PrefixStore("cpu/", dist.PrefixStore(f"{name}/", dist.PrefixStore(name, store)))
    return dist.ProcessGroupGloo(keys, rank, world, opts)


def broadcast(group: dist.ProcessGroup, flat: torch.Tensor) -> None:
    """Broadcast ``flat`` in place from rank 0; raises on the group's timeout or a lost peer."""
    broadcast_async(group, flat).wait()


def broadcast_async(group: dist.ProcessGroup, flat: torch.Tensor) -> dist.Work:
    """Start broadcasting ``flat`` from rank 0 and return at once, so the caller can pack or
    unpack another bucket meanwhile. ``flat`` must stay untouched until ``wait()`` returns;
    ``wait()`` raises on the group's timeout or a lost peer. Collectives of one group match
    by issue order, so every rank must issue its broadcasts in the same order."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    return group.broadcast([flat], opts)


def drop_group(group: dist.ProcessGroup | None) -> None:
    """Tear a group down without a barrier: peers may be dead, and a barrier would wait for
    them. ``abort`` closes the connections, so a live peer blocked in a collective of this
    group fails at once instead of waiting out its timeout."""
    if group is None:
        return
    try:
        group.abort()
    except RuntimeError as exc:  # already broken: the connections are gone either way
        logger.debug("abort of a broken weight group: %s", exc)


def await_key(control: ControlPlane, key: str, accept: Callable[[dict[str, Any]], bool],
              deadline: float, after_seq: int = 0, stop: threading.Event | None = None,
              poll_s: float = 1.0) -> dict[str, Any] | None:
    """Long-poll ``key`` until a value newer than ``after_seq`` passes ``accept``; None once
    ``deadline`` (``time.monotonic``) passes or ``stop`` is set. Polls in ``poll_s`` slices so
    that ``stop`` is seen promptly and no single request outlives the client's own timeout."""
    seq = after_seq
    while True:
        remaining = deadline - time.monotonic()
        got = control.get_key(key, newer_than=seq, timeout_s=max(0.0, min(poll_s, remaining)))
        if got is not None:
            seq, value = got
            if accept(value):
                return value
        if remaining <= 0 or (stop is not None and stop.is_set()):
            return None


def await_keys(control: ControlPlane, keys: list[str], accept: Callable[[dict[str, Any]], bool],
               deadline: float, poll_s: float = 1.0,
               gone: Callable[[list[str]], list[str]] | None = None) -> list[str]:
    """Wait until every key in ``keys`` holds a value that passes ``accept``; returns those
    that still do not when it returns (empty: all accepted): at ``deadline``, or as soon as
    ``gone`` names any of them: their writer is known to be gone, waiting on is pointless.
    ``gone`` is asked with the keys still missing once every ``poll_s`` of waiting, not
    before the first ``poll_s`` (a wait that ends sooner costs it nothing).

    One :meth:`ControlPlane.get_keys` reads every key per round, so a rendezvous over N
    members costs a few round trips, not N. Between rounds it long-polls the first missing
    key (the others usually arrive at about the same time), so it never spins."""
    missing = list(keys)
    seqs: dict[str, int] = {}
    next_check = time.monotonic() + poll_s
    while True:
        found = control.get_keys(missing)
        seqs.update({key: seq for key, (seq, _) in found.items()})
        missing = [key for key in missing if key not in found or not accept(found[key][1])]
        now = time.monotonic()
        remaining = deadline - now
        if not missing or remaining <= 0:
            return missing
        if gone is not None and now >= next_check:
            next_check = now + poll_s
            if gone(missing):
                return missing
        control.get_key(missing[0], newer_than=seqs.get(missing[0], 0),
                        timeout_s=max(0.0, min(poll_s, remaining)))
