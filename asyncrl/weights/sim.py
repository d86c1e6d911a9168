"""The ``sim`` weight transport: a group stand-in whose broadcast is a wait.

With ``weights.transport = "sim"`` the whole weight-sync protocol stays real (announcement,
join/go handshake, the epoch's store, buckets, acks, eviction); only the bytes do not travel.
Each broadcast of ``n`` bytes occupies a simulated wire for ``n · s_per_byte`` seconds, after
the broadcasts posted before it on the same group, which is how a real group serialises them.
The broadcaster sets ``s_per_byte`` so that one full update takes ``sim.sync_s`` (a model's
size over a bandwidth) whatever the size of the tiny stand-in model, and announces it to the
receivers (``transport_opts``, :meth:`SimTransport.announced_opts`).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch


class SimWork:
    """A posted broadcast: :meth:`wait` returns when the simulated wire delivered it."""

    def __init__(self, done_at: float, aborted: threading.Event) -> None:
        self._done_at = done_at
        self._aborted = aborted

    def wait(self, timeout_s: float | None = None) -> bool:
        remaining = self._done_at - time.monotonic()
        if timeout_s is not None and timeout_s < remaining:
            if self._aborted.wait(timeout_s):
                raise RuntimeError("sim weight group aborted")
            return False
        if remaining > 0 and self._aborted.wait(remaining):
            raise RuntimeError("sim weight group aborted")
        if self._aborted.is_set():
            raise RuntimeError("sim weight group aborted")
        return True


class SimTransport:
    """One end of a simulated group; see :class:`asyncrl.weights.transport.WeightTransport`.
    It needs no store, no address and no peers (``host``, ``timeout_s`` and ``device`` are
    unused: its buffers stay on the CPU):
    :meth:`connect` only records the rank."""

    packs_every_tensor = False

    def __init__(self, *, host: str, timeout_s: float, s_per_byte: float,
                 device: torch.device | None = None) -> None:
        self.rank, self.world = 0, 1
        self._s_per_byte = float(s_per_byte)
        self._wire_free_at = 0.0
        self._aborted = threading.Event()
        self._lock = threading.Lock()

    @staticmethod
    def announced_opts(update_bytes: int, sim_sync_s: float) -> dict[str, Any]:
        """The wire speed at which an update of ``update_bytes`` takes ``sim_sync_s``."""
        return {"s_per_byte": sim_sync_s / max(update_bytes, 1)}

    def connect(self, store: object, group: str, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def send(self, flat: torch.Tensor) -> SimWork:
        return self._post(flat)

    def receive(self, flat: torch.Tensor) -> SimWork:
        return self._post(flat)

    def _post(self, flat: torch.Tensor) -> SimWork:
        nbytes = flat.numel() * flat.element_size()
        with self._lock:
            start = max(time.monotonic(), self._wire_free_at)
            self._wire_free_at = start + nbytes * self._s_per_byte
            return SimWork(self._wire_free_at, self._aborted)

    def buffer_device(self) -> torch.device:
        return torch.device("cpu")

    def close(self) -> None:
        self._aborted.set()
