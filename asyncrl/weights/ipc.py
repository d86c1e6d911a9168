"""The ``ipc`` weight transport: engines on rank 0's own GPU map its packed buckets.

When the learner and an engine share a GPU (the colocated mode), sending the bytes through a
process group would copy them GPU → GPU through NCCL's own buffers at best, or through the
host with gloo. Instead rank 0 hands out a CUDA IPC handle of each packed bucket
(``torch.multiprocessing.reductions.reduce_tensor``: ``cudaIpcGetMemHandle`` plus the
offset); each receiver maps it (``rebuild_cuda_tensor``: ``cudaIpcOpenMemHandle``) and copies
it device to device into its own receive buffer, never through the host, then says so.

The handles travel through the epoch's ``TCPStore`` (the broadcaster's, already there for
the handshake): bucket ``i`` of the group is key ``b<i>``, each receiver's done is
``d<i>/<rank>``. Rank 0 may reuse a bucket's staging memory only after every receiver's done,
which is what :meth:`IpcPending.wait` on the sending side waits for; keys are deleted once
every receiver is done with them. Every wait is bounded by the group's ``timeout_s``.

The handle is pickled with torch's own reduction (a tuple of ints, bytes, dtypes and torch
classes) and unpickled by an unpickler that accepts torch classes only. A process cannot
open its own IPC handle, so both ends are always two processes (tests spawn the receiver).
"""

from __future__ import annotations

import datetime
import io
import pickle
import time
from typing import Any

import torch
import torch.distributed as dist


class _TorchOnly(pickle.Unpickler):
    """Unpickles a CUDA IPC reduction: refuses any global outside torch."""

    def find_class(self, module: str, name: str) -> Any:
        if module.split(".")[0] != "torch":
            raise pickle.UnpicklingError(f"weights ipc: refusing {module}.{name}")
        return super().find_class(module, name)


def share(flat: torch.Tensor) -> bytes:
    """A CUDA tensor as bytes another process on the same GPU can map (no copy)."""
    from torch.multiprocessing.reductions import reduce_tensor

    return pickle.dumps(reduce_tensor(flat))


def torch_only_loads(payload: bytes) -> Any:
    """Unpickle ``payload`` allowing torch's globals only (CUDA IPC reductions: also what the
    vLLM ``ipc`` backend's handles are, :mod:`rollouters.engines.vllm_ipc_worker`)."""
    return _TorchOnly(io.BytesIO(payload)).load()


def open_shared(payload: bytes) -> torch.Tensor:
    """The tensor :func:`share` described, mapped into this process (it views rank 0's
    memory: copy out of it, then drop it)."""
    rebuild, args = torch_only_loads(payload)
    return rebuild(*args)


class IpcPending:
    """One bucket of an ``ipc`` group; see :class:`asyncrl.weights.transport.Pending`.

    Rank 0: done once every receiver copied it. A receiver: the copy happens in the first
    :meth:`wait` that finds the handle (buckets are waited for in plan order)."""

    def __init__(self, end: IpcTransport, index: int, flat: torch.Tensor) -> None:
        self._end = end
        self._index = index
        self._flat = flat
        self._posted = time.monotonic()
        self._done = False

    def wait(self, timeout_s: float | None = None) -> bool:
        """Bounded like a group's collectives (:mod:`asyncrl.weights.watchdog`): it fails
        once ``timeout_s`` passed since it was posted or since the group's last bucket
        went through, whichever is later."""
        if self._done:
            return True
        deadline = max(self._posted, self._end.progress_at) + self._end.timeout_s
        remaining = deadline - time.monotonic()
        slice_s = remaining if timeout_s is None else min(timeout_s, remaining)
        keys = self._end.keys_for(self._index)
        if not self._end.arrived(keys, max(slice_s, 0.001)):
            if time.monotonic() >= deadline:
                raise RuntimeError(f"weights ipc: bucket {self._index} not through within "
                                   f"{self._end.timeout_s:.1f} s (weights.timeout_s)")
            return False
        self._end.finish(self._index, self._flat)
        self._done = True
        return True


class IpcTransport:
    """One end of an ``ipc`` group; see :class:`asyncrl.weights.transport.WeightTransport`.
    ``host`` is unused (the store is the epoch's); ``device`` is this end's GPU.

    Each bucket costs round trips through the store and a ``cudaIpcOpenMemHandle`` whatever
    its size: about 0.5 ms, so the first GPU run (H200) sent a 0.5B model's 170 buckets, one
    per tensor of 1 MB or more, in 0.098 s where a device-to-device copy of the same bytes
    took 0.0014 s. Hence :attr:`packs_every_tensor`: the broadcaster packs every tensor into
    buckets for such a group."""

    packs_every_tensor = True

    def __init__(self, *, host: str, timeout_s: float, device: torch.device | None = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("weights.transport 'ipc' needs CUDA, and this process sees none")
        self.timeout_s = timeout_s
        if device is None or device.type != "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        self._device = device
        self._store: dist.Store | None = None
        self.rank, self.world = 0, 1
        self._next = 0  # index of the next bucket posted on this group, the same on every end
        self.progress_at = 0.0  # when a bucket of this group last went through

    @staticmethod
    def announced_opts(update_bytes: int, sim_sync_s: float) -> dict[str, Any]:
        return {}

    def connect(self, store: dist.Store | None, group: str, rank: int, world: int) -> None:
        """No collective to build: the keys of this group live under its name in the store."""
        assert store is not None, "ipc needs the epoch's store"
        self._store = dist.PrefixStore(f"ipc/{group}/", store)
        self.rank, self.world = rank, world

    def send(self, flat: torch.Tensor) -> IpcPending:
        """Publish ``flat``'s handle once its bytes are written (the pack ran on the current
        stream; a receiver's copy runs on its own)."""
        assert self._store is not None, "connect first"
        index = self._post()
        torch.cuda.current_stream(flat.device).synchronize()
        self._store.set(f"b{index}", share(flat))
        return IpcPending(self, index, flat)

    def receive(self, flat: torch.Tensor) -> IpcPending:
        return IpcPending(self, self._post(), flat)

    def _post(self) -> int:
        index, self._next = self._next, self._next + 1
        return index

    def keys_for(self, index: int) -> list[str]:
        """What a wait for bucket ``index`` waits for: every receiver's done (rank 0), or
        the handle (a receiver)."""
        if self.rank == 0:
            return [f"d{index}/{rank}" for rank in range(1, self.world)]
        return [f"b{index}"]

    def arrived(self, keys: list[str], timeout_s: float) -> bool:
        """Have ``keys`` all been set within ``timeout_s``? (The store's own bounded wait.)"""
        store = self._live()
        try:
            store.wait(keys, datetime.timedelta(seconds=timeout_s))
        except dist.DistStoreError as exc:
            if "timeout" in str(exc).lower():
                return False
            raise
        return True

    def _live(self) -> dist.Store:
        if self._store is None:
            raise RuntimeError("weights ipc: the group was closed")
        return self._store

    def finish(self, index: int, flat: torch.Tensor) -> None:
        """Rank 0: every receiver has the bucket, forget its keys. A receiver: copy it out of
        rank 0's memory, device to device, and say done."""
        store = self._live()
        self.progress_at = time.monotonic()
        if self.rank == 0:
            for key in [f"b{index}", *self.keys_for(index)]:
                store.delete_key(key)
            return
        source = open_shared(store.get(f"b{index}"))
        flat.copy_(source)
        torch.cuda.current_stream(flat.device).synchronize()
        del source  # unmaps rank 0's memory before rank 0 may reuse it
        store.set(f"d{index}/{self.rank}", b"1")

    def buffer_device(self) -> torch.device:
        return self._device

    def close(self) -> None:
        """Nothing held but the store's keys: a pending wait fails at its next look."""
        self._store = None
