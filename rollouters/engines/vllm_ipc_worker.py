"""The worker half of ``weights.transport = "ipc"`` for vLLM, registered twice:
``asyncrl_ipc`` (CUDA IPC handles, on a GPU) and ``asyncrl_shm`` (host shared memory, its
stand-in on CPU, as ``asyncrl_gloo`` stands for ``asyncrl_nccl``). Sender half:
:mod:`rollouters.engines.vllm_ipc`.

:class:`IpcWeightTransfer` is vLLM's own ``IPCWeightTransferEngine`` (its init, its layer-wise
start and finish, its update info and checks, its CUDA rebuild) with two changes, both for
what goes wrong:

* ``ipc_handles_pickled`` is unpickled with torch's globals only
  (:func:`asyncrl.weights.ipc.torch_only_loads`, as the learner's own ``ipc`` transport does),
  where vLLM's uses plain ``pickle`` and so needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``,
  which lets anyone who reaches the engine run code in it. Ours needs no such setting.
* an update that fails (a name or shape the model refuses) finalizes the layer-wise reload
  before the error goes up, as :class:`~rollouters.engines.vllm_gloo.GroupWeightTransfer`
  does: vLLM's worker then ends the update without finishing it, and vLLM's own class leaves
  the layers that had started reloading on the meta device, which kills the engine core at
  its next step ("Tensor on device cpu is not on the expected device meta!", seen on the CPU
  server with vLLM's class). Finalizing gives every layer that received nothing its old
  weights back.

:class:`ShmWeightTransfer` swaps only the rebuild: a handle is mapped from a POSIX
shared-memory segment (:func:`~rollouters.engines.vllm_ipc.map_segment`), its handles are
plain data (every global refused), and no accelerator is synchronized (a CPU worker has none).
The mapped tensors view the sender's segment; they and the mappings are kept until
``finish_weight_update``, as the GPU path keeps the sender's CUDA memory mapped, since the
layer-wise reload may load a layer only when it is complete.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Callable
from typing import Any

import torch
from vllm.distributed.weight_transfer.ipc_engine import (
    IPCWeightTransferEngine,
    IPCWeightTransferUpdateInfo,
)

from rollouters.engines.vllm_ipc import (
    IPC_BACKEND,
    SHM_BACKEND,
    host_key,
    map_segment,
    unpickle_handles,
    unpickled_cuda_handles,
)

logger = logging.getLogger(__name__)


class IpcWeightTransfer(IPCWeightTransferEngine):
    """``asyncrl_ipc``: vLLM's IPC worker half, handles unpickled with torch's globals only,
    a failed update finalized."""

    unpickle: Callable[[str], Any] = staticmethod(unpickled_cuda_handles)

    def parse_update_info(self, update_dict: dict[str, Any]) -> IPCWeightTransferUpdateInfo:
        text = update_dict.get("ipc_handles_pickled")
        if text is not None:
            update_dict = {key: value for key, value in update_dict.items()
                           if key != "ipc_handles_pickled"}
            update_dict["ipc_handles"] = self.unpickle(text)
        return super().parse_update_info(update_dict)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        try:
            self._update(update_info)
        except BaseException:  # vLLM's worker then ends the update without finishing it
            self.finish_weight_update()
            raise

    def _update(self, update_info: dict[str, Any]) -> None:
        """vLLM's: parse, receive and load, synchronize the accelerator."""
        super().update_weights(update_info)


class ShmWeightTransfer(IpcWeightTransfer):
    """``asyncrl_shm``: the same, handles mapped from host shared memory."""

    unpickle = staticmethod(unpickle_handles)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._segments: dict[str, mmap.mmap] = {}
        self._views: list[torch.Tensor] = []

    def _update(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))  # nothing to synchronize

    def receive_weights(self, update_info: IPCWeightTransferUpdateInfo) -> None:
        """As vLLM's, one handle per tensor (the sender never packs), each mapped from its
        segment."""
        if self.packed or not isinstance(update_info.ipc_handles, list):
            raise ValueError(f"{SHM_BACKEND}: packed transfers are not sent")
        key = host_key()
        weights = []
        for name, dtype_name, shape, handle in zip(update_info.names, update_info.dtype_names,
                                                   update_info.shapes, update_info.ipc_handles):
            if key not in handle:
                raise ValueError(f"{SHM_BACKEND}: handle not made on this host ({key}); "
                                 f"available: {list(handle)}")
            segment, offset, nbytes = handle[key]
            weights.append((name, self._view(segment, offset, nbytes, dtype_name, shape)))
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )

        with disable_mtp_completeness_check():
            self.model.load_weights(weights)

    def _view(self, segment: str, offset: int, nbytes: int, dtype_name: str,
              shape: list[int]) -> torch.Tensor:
        """The tensor at ``offset`` of ``segment`` (mapped once per update)."""
        if segment not in self._segments:
            self._segments[segment] = map_segment(segment)
        raw = torch.frombuffer(self._segments[segment], dtype=torch.uint8, count=nbytes,
                               offset=offset)
        view = raw.view(getattr(torch, dtype_name)).view(shape)
        self._views.append(view)
        return view

    def finish_weight_update(self) -> None:
        try:
            super().finish_weight_update()
        finally:
            self._unmap()

    def shutdown(self) -> None:
        super().shutdown()
        self._unmap()

    def _unmap(self) -> None:
        """Drop this update's views and close its mappings. A view vLLM still holds keeps
        its mapping open (``BufferError``): then it goes with the last view."""
        self._views.clear()
        segments, self._segments = self._segments, {}
        for name, mapping in segments.items():
            try:
                mapping.close()
            except BufferError:
                logger.warning("%s: segment %s still viewed after the update; it is unmapped "
                               "with its last view", SHM_BACKEND, name)


WORKER_HALVES = {IPC_BACKEND: IpcWeightTransfer, SHM_BACKEND: ShmWeightTransfer}


def register() -> None:
    """Make ``asyncrl_ipc`` and ``asyncrl_shm`` known to vLLM in this process (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    for name, cls in WORKER_HALVES.items():
        if name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(name, cls)

