"""The ``sim`` weight transport: a process-group stand-in whose broadcast is a wait.

With ``weights.transport = "sim"`` the whole weight-sync protocol stays real (announcement,
join/go handshake, the epoch's store, buckets, acks, eviction); only the bytes do not travel.
Each broadcast of ``n`` bytes occupies a simulated wire for ``n · s_per_byte`` seconds, after
the broadcasts posted before it on the same group, which is how a real group serialises them.
The broadcaster sets ``s_per_byte`` so that one full update takes ``sim.sync_s`` (a model's
size over a bandwidth) whatever the size of the tiny stand-in model, and announces it to the
receivers (``transport_opts``).
"""

from __future__ import annotations

import threading
import time

import torch


class SimWork:
    """A posted broadcast: :meth:`wait` returns when the simulated wire delivered it."""

    def __init__(self, done_at: float, aborted: threading.Event) -> None:
        self._done_at = done_at
        self._aborted = aborted

    def wait(self, timeout: object = None) -> bool:
        remaining = self._done_at - time.monotonic()
        if remaining > 0 and self._aborted.wait(remaining):
            raise RuntimeError("sim weight group aborted")
        if self._aborted.is_set():
            raise RuntimeError("sim weight group aborted")
        return True


class SimGroup:
    """What :func:`learners.weights_group.broadcast_async` and ``drop_group`` use of a group."""

    def __init__(self, rank: int, world: int, s_per_byte: float) -> None:
        self.rank, self.world = rank, world
        self._s_per_byte = s_per_byte
        self._wire_free_at = 0.0
        self._aborted = threading.Event()
        self._lock = threading.Lock()

    def broadcast(self, tensors: list[torch.Tensor], opts: object = None) -> SimWork:
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        with self._lock:
            start = max(time.monotonic(), self._wire_free_at)
            self._wire_free_at = start + nbytes * self._s_per_byte
            return SimWork(self._wire_free_at, self._aborted)

    def abort(self) -> None:
        self._aborted.set()
