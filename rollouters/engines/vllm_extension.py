"""Worker-side half of the vLLM engines: methods mixed into every vLLM worker.

vLLM instantiates its worker class with this class as an extra base
(``worker_extension_cls="rollouters.engines.vllm_extension.AsyncRLWorkerExtension"``), so
``collective_rpc("asyncrl_load_weights", ...)`` runs :meth:`asyncrl_load_weights` beside the
model, in whatever process owns it. Arguments cross process boundaries as msgpack, which turns
nested tensors into lists, so tensors travel as one safetensors blob.

On CPU the linear weights are repacked for oneDNN after start, so ``model.load_weights`` no
longer works; the worker's ``reload_weights`` (layer-wise reload, re-packs) does, on CPU and GPU.

Importing this module also registers our weight-transfer backends, ``asyncrl_gloo`` and
``asyncrl_nccl`` (:mod:`rollouters.engines.vllm_gloo`), ``asyncrl_ipc`` and ``asyncrl_shm``
(vLLM's ``ipc``, and the same on a host: :mod:`rollouters.engines.vllm_ipc_worker`): vLLM
imports the extension in every worker before it builds the worker's transfer engine, so a
server started with this extension can use them.
For the same reason it sets up vLLM's Qwen2-VL without torchvision (:mod:`vllm_qwen2_vl`),
where that is missing, before the worker loads the model.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from rollouters.engines.vllm_gloo import register as register_gloo_backend
from rollouters.engines.vllm_ipc_worker import register as register_ipc_backends
from rollouters.engines.vllm_qwen2_vl import install as install_qwen2_vl

logger = logging.getLogger(__name__)

EXTENSION_CLS = f"{__name__}.AsyncRLWorkerExtension"

register_gloo_backend()
register_ipc_backends()
install_qwen2_vl()  # the engine core's process imports vLLM's Qwen2-VL after this, if served


def pack_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> bytes:
    """Named tensors as one safetensors blob (contiguous CPU copies; tied names kept)."""
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        tensors[name] = tensor.detach().to("cpu").contiguous().clone()
    return save_safetensors(tensors)


def unpack_weights(blob: bytes) -> dict[str, torch.Tensor]:
    return load_safetensors(blob)


class AsyncRLWorkerExtension:
    """Mixed into the vLLM worker (which provides ``reload_weights`` and ``model_runner``)."""

    def asyncrl_load_weights(self, blob: bytes) -> int:
        """Load the named tensors in ``blob`` into the running model; returns how many."""
        tensors = unpack_weights(blob)
        self.reload_weights(weights_iterator=_iterate(tensors))  # type: ignore[attr-defined]
        logger.debug("asyncrl: reloaded %d tensors", len(tensors))
        return len(tensors)

    def asyncrl_weight(self, name: str) -> list:
        """One parameter of the running model, as nested lists (a test and debug probe)."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return dict(model.named_parameters())[name].detach().float().cpu().tolist()

    def asyncrl_memory(self) -> dict[str, int]:
        """Bytes of the model's parameters and of the KV cache, as allocated at start (what
        a sleep frees, on GPUs: the engines report it, :mod:`vllm_sleep`)."""
        runner = self.model_runner  # type: ignore[attr-defined]
        return {"weights_bytes": _storage_bytes(runner.get_model().parameters()),
                "kv_bytes": _storage_bytes(_tensors(getattr(runner, "kv_caches", [])))}


def _storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages under ``tensors`` (views and tied weights once)."""
    storages = {s.data_ptr(): s.nbytes() for s in (t.untyped_storage() for t in tensors)}
    return sum(storages.values())


def _tensors(nested: object) -> Iterator[torch.Tensor]:
    """The tensors in a (possibly nested) list of KV caches."""
    if isinstance(nested, torch.Tensor):
        yield nested
    elif isinstance(nested, (list, tuple)):
        for item in nested:
            yield from _tensors(item)


def _iterate(tensors: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    yield from tensors.items()
