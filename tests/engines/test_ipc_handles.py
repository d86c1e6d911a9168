"""The handles of the vLLM ``ipc`` sender (:mod:`rollouters.engines.vllm_ipc`), with torch
alone: the host shared-memory ones of its CPU stand-in, and (``gpu``) the CUDA ones, opened in
another process as ``asyncrl_ipc``'s worker opens them: unpickled with torch's globals only,
then vLLM's ``IPCWeightTransferEngine.receive_weights`` (the GPU's UUID as the key, the
receiver's device index at ``args[6]``, ``rebuild_cuda_tensor``).
Not a ``test_vllm*`` module: the lent GPU machine has torch but no vLLM. The real engines take
``ipc`` updates in tests/engines/test_vllm_server.py (CPU) and test_vllm_gpu.py (GPU).
"""

from __future__ import annotations

import base64
import pickle
from pathlib import Path

import pytest
import torch

from rollouters.engines.vllm_ipc import (
    SEGMENT_PREFIX,
    SHM_DIR,
    cuda_handles,
    host_key,
    map_segment,
    pickled,
    shm_handles,
    unpickle_handles,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _segments() -> set[str]:
    return {path.name for path in Path(SHM_DIR).glob(f"{SEGMENT_PREFIX}*")}


def _tensors(device: str) -> list[tuple[str, torch.Tensor]]:
    """Views of one bucket, as the weight receiver hands them over, and tensors of other
    dtypes and shapes, one a scalar."""
    bucket = torch.arange(64, dtype=torch.float32, device=device)
    return [("a", bucket[:12].view(3, 4)), ("b", bucket[16:20]),
            ("c", torch.full((2, 3), 1.5, dtype=torch.bfloat16, device=device)),
            ("d", torch.tensor(7, dtype=torch.int64, device=device))]


def test_shm_handles_map_to_the_tensors_and_are_unlinked_once_released() -> None:
    before = _segments()
    tensors = _tensors("cpu")
    shared = shm_handles(tensors, torch.device("cpu"))
    handles = unpickle_handles(pickled(shared.handles))
    mappings = []
    for (name, tensor), handle in zip(tensors, handles):
        segment, offset, nbytes = handle[host_key()]
        mappings.append(map_segment(segment))
        view = torch.frombuffer(mappings[-1], dtype=torch.uint8, count=nbytes, offset=offset)
        assert torch.equal(view.view(tensor.dtype).view(tensor.shape), tensor), name
        del view
    assert len(_segments() - before) == 1  # one segment per update
    shared.release()
    assert _segments() == before
    assert torch.equal(torch.frombuffer(mappings[0], dtype=torch.float32, count=12),
                       tensors[0][1].reshape(-1))  # a mapping outlives the unlinked name
    for mapping in mappings:
        mapping.close()


def test_a_pickled_handle_naming_a_global_is_refused() -> None:
    """The stand-in's worker half unpickles plain data only: no code runs from a request."""
    import os

    text = base64.b64encode(pickle.dumps([{"k": (os.system, ("true",))}])).decode()
    with pytest.raises(pickle.UnpicklingError, match="refusing posix.system|refusing os.system"):
        unpickle_handles(text)
    with pytest.raises(ValueError, match="not a segment of ours"):
        map_segment("../etc/passwd")


def _open_as_vllm_does(text: str, names: list[str], queue: object) -> None:
    """The receiving process: our unpickling, then vLLM's unpacked ``receive_weights``, less
    the model."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from rollouters.engines.vllm_ipc import unpickled_cuda_handles

    device = torch.cuda.current_device()
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    received = {}
    for name, handle in zip(names, unpickled_cuda_handles(text)):
        args = list(handle[uuid])
        args[6] = device
        tensor = rebuild_cuda_tensor(*args)
        received[name] = (str(tensor.dtype), tensor.float().cpu().tolist())
    queue.put(received)  # type: ignore[attr-defined]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("where", ["cuda", "cpu"])  # CPU tensors are moved to the GPU first
def test_cuda_handles_open_in_another_process_as_vllm_opens_them(where: str) -> None:
    import torch.multiprocessing as mp

    tensors = _tensors(where)
    device = torch.device("cuda", torch.cuda.current_device())
    shared = cuda_handles(tensors, device)
    context = mp.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_open_as_vllm_does,
                            args=(pickled(shared.handles), [n for n, _ in tensors], queue))
    child.start()
    try:
        received = queue.get(timeout=120)
    finally:
        child.join(60)
        shared.release()
    assert child.exitcode == 0
    for name, tensor in tensors:
        assert received[name] == (str(tensor.dtype), tensor.float().cpu().tolist()), name

