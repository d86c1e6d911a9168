"""The rendezvous of the weight broadcast: control-plane keys, the epoch's store, bounded waits.

Every membership epoch meets through the control plane (the announcement, each receiver's
join, the broadcaster's go, each receiver's ack) and one ``TCPStore`` served by the
broadcaster, which the epoch's group (:mod:`asyncrl.weights.transport`) is built over.
Everything here is bounded by a timeout: a dead peer costs at most one timeout, never a hang.
None of it depends on the transport: moving to NCCL changes the group and the buffers' device,
not the announcement, the keys or the bucket format.
"""

from __future__ import annotations

import datetime
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from asyncrl.control_plane import ControlPlane

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


def group_name(token: str, epoch: int) -> str:
    """The name of one epoch's group: unique per broadcaster (``token``) and epoch, because
    a long-lived engine (an SGLang server) keeps every group it joined by name and refuses to
    join a second group of the same name."""
    return f"asyncrl-{token}-epoch{epoch}"


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
