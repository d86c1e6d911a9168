"""The sender half of ``weights.transport = "ipc"`` for vLLM: ``asyncrl_ipc`` (CUDA IPC
handles) and ``asyncrl_shm`` (host shared memory, its stand-in on CPU); worker half:
:mod:`rollouters.engines.vllm_ipc_worker`, vLLM's own ``IPCWeightTransferEngine`` with the
unpickling made safe and a failed update finalized.

On a GPU the rollout worker and its vLLM engine core share one device, so the bytes need not
leave it: this process exports a CUDA IPC handle of each tensor it received from the learner
(``reduce_tensor``), and vLLM's worker maps it (``rebuild_cuda_tensor``) and loads it into the
model, inside its layer-wise reload. The handles travel in vLLM's own ``update_info``
(``names``, ``dtype_names``, ``shapes``, ``ipc_handles``: one dict per tensor, the device's id
→ what maps it), pickled into ``ipc_handles_pickled`` both over HTTP and over AsyncLLM's ZMQ
(the handles hold torch classes, which neither JSON nor vLLM's msgpack carries).

CPU has no CUDA IPC, so ``asyncrl_shm`` is the same path with another handle maker, as
``asyncrl_gloo`` stands for ``asyncrl_nccl``: the tensors are copied into one POSIX
shared-memory segment and each handle is ``(segment, offset, bytes)`` under this host's name.
:meth:`IpcSender.send` is the one sending function; only :data:`IPC_BACKENDS` differs.

The handles view memory this process owns: the tensors (or the segment) are kept until the
engine's ``finish_weight_update`` returned, since vLLM's layer-wise reload may load a layer's
tensors only when the layer is complete, then released (the segment unlinked). A process
cannot open its own CUDA IPC handle, so the engine must be another process: AsyncLLM's engine
core or a server, not the in-process engine.
"""

from __future__ import annotations

import base64
import io
import logging
import mmap
import os
import pickle
import socket
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import torch

logger = logging.getLogger(__name__)

IPC_BACKEND = "asyncrl_ipc"  # vLLM's ipc worker half, made safe: vllm_ipc_worker
SHM_BACKEND = "asyncrl_shm"  # the same over host shared memory
SEGMENT_PREFIX = "asyncrl-shm-"  # /dev/shm/asyncrl-shm-*: a leak is easy to find
SHM_DIR = "/dev/shm"  # where POSIX shared memory lives on Linux (vLLM's CPU backend's OS)
ALIGN = 64  # bytes: each tensor's offset in a segment, for any dtype's alignment

Named = Sequence[tuple[str, torch.Tensor]]


@dataclass
class Shared:
    """One update's handles, one per tensor, and how to release what they view."""

    handles: list[dict[str, tuple]]
    release: Callable[[], None]


def host_key() -> str:
    """Where a shared-memory handle can be opened: this host (a GPU handle's key is the GPU's
    UUID, which vLLM's worker checks against its own the same way)."""
    return f"host:{socket.gethostname()}"


def cuda_handles(tensors: Named, device: torch.device) -> Shared:
    """A CUDA IPC handle of each tensor on ``device`` (moved there first, if not on it),
    keyed by the GPU's UUID as vLLM's worker looks it up."""
    from torch.multiprocessing.reductions import reduce_tensor

    kept = [t.detach().to(device).contiguous() for _, t in tensors]
    torch.cuda.current_stream(device).synchronize()  # written before another process reads
    gpu = str(torch.cuda.get_device_properties(device).uuid)
    return Shared([{gpu: reduce_tensor(t)[1]} for t in kept], kept.clear)


def shm_handles(tensors: Named, device: torch.device) -> Shared:
    """The tensors copied into one new shared-memory segment; each handle is
    ``(segment name, offset, bytes)`` keyed by :func:`host_key`. Released: unlinked."""
    sizes = [t.numel() * t.element_size() for _, t in tensors]
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += -(-size // ALIGN) * ALIGN
    segment = SharedMemory(f"{SEGMENT_PREFIX}{uuid.uuid4().hex[:16]}", create=True,
                           size=max(end, 1))
    try:
        _fill(segment, tensors, offsets, sizes)
    except BaseException:
        _unlink(segment)
        raise
    key = host_key()
    return Shared([{key: (segment.name, offset, size)} for offset, size in zip(offsets, sizes)],
                  lambda: _unlink(segment))


def _fill(segment: SharedMemory, tensors: Named, offsets: list[int], sizes: list[int]) -> None:
    """Copy each tensor's bytes to its offset (the view is dropped before returning, so the
    segment can be closed)."""
    whole = torch.frombuffer(segment.buf, dtype=torch.uint8, count=segment.size)
    for (_, tensor), offset, size in zip(tensors, offsets, sizes):
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        whole[offset:offset + size].copy_(data)
    del whole


def _unlink(segment: SharedMemory) -> None:
    segment.close()
    segment.unlink()


@dataclass(frozen=True)
class IpcBackend:
    """What differs between ``asyncrl_ipc`` and its CPU stand-in."""

    cuda: bool  # the handles view CUDA memory (this process's current GPU)
    share: Callable[[Named, torch.device], Shared]


IPC_BACKENDS: dict[str, IpcBackend] = {
    IPC_BACKEND: IpcBackend(cuda=True, share=cuda_handles),
    SHM_BACKEND: IpcBackend(cuda=False, share=shm_handles),
}


def pickled(handles: list[dict[str, tuple]]) -> str:
    """The handles as ``ipc_handles_pickled`` carries them (base64 of a pickle)."""
    return base64.b64encode(pickle.dumps(handles)).decode("ascii")


class _PlainOnly(pickle.Unpickler):
    """Unpickles plain data (dicts, lists, tuples, strings, numbers): refuses every global."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{SHM_BACKEND}: refusing {module}.{name} in the handles")


def unpickled_cuda_handles(text: str) -> Any:
    """CUDA IPC handles as :func:`pickled` wrote them, torch's globals only (the receiving
    end: what vLLM's own worker half would ``pickle.loads``)."""
    from asyncrl.weights.ipc import torch_only_loads

    return torch_only_loads(base64.b64decode(text))


def unpickle_handles(text: str) -> Any:
    """Shared-memory handles as :func:`pickled` wrote them; a pickle that names any global
    (a class, a function) is refused before it runs."""
    return _PlainOnly(io.BytesIO(base64.b64decode(text))).load()


def map_segment(name: str) -> mmap.mmap:
    """The sender's segment ``name`` mapped into this process (the receiving end; the file is
    closed at once, the mapping stays until closed, even once the sender unlinked the name)."""
    if "/" in name or not name.startswith(SEGMENT_PREFIX):
        raise ValueError(f"{SHM_BACKEND}: not a segment of ours: {name!r}")
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


class IpcSender:
    """This process's half of an ``ipc`` (or ``asyncrl_shm``) transfer with one engine: no
    group to join, only vLLM's ``init_weight_transfer_engine`` (``packed``: false) once; each
    update shares the tensors, calls the engine's ``update(update_info)`` and ``finish()``,
    then releases them. ``workers``: the engine's worker count; one, since the handles view
    this process's one GPU (vLLM's trainers all-gather one per GPU; a rollout worker has one).
    """

    def __init__(self, backend: str, workers: int, timeout_s: float) -> None:
        self.backend = backend
        self._kind = IPC_BACKENDS[backend]
        if workers != 1:
            raise ValueError(f"weights.transport 'ipc' needs one vLLM worker "
                             f"(tensor_parallel_size × data_parallel_size = 1, not {workers}): "
                             "its handles view this process's one device")
        if self._kind.cuda:
            if not torch.cuda.is_available():
                raise RuntimeError("weights.transport 'ipc' needs CUDA, and this process sees "
                                   "none")
            self.stage_device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.stage_device = torch.device("cpu")
        self.timeout_s = timeout_s
        self.joined = False

    def join(self, init: Callable[[dict], object]) -> None:
        """vLLM's ``init_weight_transfer_engine``: only the must-agree ``packed`` flag (one
        handle per tensor here)."""
        from rollouters.engines.vllm_sender import alongside

        alongside(lambda: init({"packed": False}), _nothing, self.timeout_s,
                  "init_weight_transfer_engine")
        self.joined = True
        logger.info("%s: the engine takes weights by handle", self.backend)

    def send(self, tensors: Named, update: Callable[[dict], object],
             finish: Callable[[], object]) -> None:
        """Share ``tensors``, ``update(update_info)`` (bounded by ``weights.timeout_s``), then
        ``finish()``; the shared memory is released after it, or after a failure (the next
        update then inits again)."""
        from rollouters.engines.vllm_sender import alongside, update_info

        shared = self._kind.share(tensors, self.stage_device)
        try:
            info = {**update_info(tensors), "ipc_handles_pickled": pickled(shared.handles)}
            alongside(lambda: update(info), _nothing, self.timeout_s, "update_weights")
            finish()
        except BaseException:
            self.drop()
            raise
        finally:
            shared.release()

    def drop(self) -> None:
        """Nothing held between updates: the next one inits again."""
        self.joined = False


def _nothing() -> None:
    """The local half of a call that has none (no collective: the handles are the data)."""
