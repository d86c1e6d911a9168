"""A gloo weight-transfer backend for vLLM's RL API (``--weight-transfer-config
'{"backend": "asyncrl_gloo"}'``), both halves.

vLLM's built-in backends (nccl, ipc, ...) are CUDA-only, but its registry is pluggable
(``WeightTransferEngineFactory.register_engine``). The worker half, :class:`GlooWeightTransfer`,
joins a two-party group (the sender is rank 0, the server's worker rank 1) and loads each
broadcast tensor inside vLLM's layer-wise reload, which re-packs CPU linears. The sender half,
:func:`open_sender_group` and :func:`send_tensors`, is what :mod:`vllm_server` runs.

The group comes from ``stateless_init_torch_distributed_process_group``: it lives outside
``torch.distributed``'s default world, so it never collides with vLLM's own groups, and its
collectives are issued on the ``ProcessGroup`` object with group-local ranks.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
from torch.distributed import ProcessGroup
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

logger = logging.getLogger(__name__)

BACKEND = "asyncrl_gloo"
SENDER_RANK = 0


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int = 1
    world_size: int = 2
    timeout_s: float = 60.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)


def _init_group(host: str, port: int, rank: int, world: int, timeout_s: float,
                listen: socket.socket | None = None) -> ProcessGroup:
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    return stateless_init_torch_distributed_process_group(
        host, port, rank, world, backend="gloo", listen_socket=listen,
        timeout=timedelta(seconds=timeout_s))


def _broadcast(group: ProcessGroup, tensor: torch.Tensor) -> None:
    group.broadcast(tensor, SENDER_RANK).wait()


class GlooWeightTransfer(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Worker side: receive broadcast tensors from the sender, load them layer-wise."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.group: ProcessGroup | None = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        # Unique across data-parallel replicas, as vLLM's NCCL backend counts them.
        config = self.parallel_config
        rank = init_info.rank_offset + config.data_parallel_index * config.world_size + \
            config.rank
        self.group = _init_group(init_info.master_address, init_info.master_port, rank,
                                 init_info.world_size, init_info.timeout_s)
        logger.info("asyncrl_gloo: joined %s:%d as rank %d/%d", init_info.master_address,
                    init_info.master_port, rank, init_info.world_size)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict) -> None:
        """As the base class, without its accelerator synchronize (gloo is synchronous)."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        """Receive and load each tensor. If one fails (a name or shape the model refuses),
        the layer-wise reload is finalized before the error goes up: vLLM's worker then ends
        the update without finishing it, and layers left on the meta device would fail the
        next step; finalizing gives every layer that received nothing its old weights back."""
        if self.group is None:
            raise RuntimeError("asyncrl_gloo: init_weight_transfer_engine was not called")
        try:
            for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names,
                                               update_info.shapes):
                tensor = torch.empty(shape, dtype=getattr(torch, dtype_name))
                _broadcast(self.group, tensor)
                self.model.load_weights([(name, tensor.to(self.device))])
        except BaseException:
            self.finish_weight_update()
            raise

    def shutdown(self) -> None:
        self.group = None


def register() -> None:
    """Make ``asyncrl_gloo`` known to vLLM in this process (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransfer)


# --- sender side ---------------------------------------------------------------------------

def free_listen_socket(host: str) -> socket.socket:
    """A bound, listening socket on a free port: the sender's store, with no port race."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen()
    return sock


def open_sender_group(listen: socket.socket, world: int, timeout_s: float) -> ProcessGroup:
    """Rank 0 of the transfer group (blocks until every receiver has joined)."""
    host, port = listen.getsockname()[:2]
    return _init_group(host, port, SENDER_RANK, world, timeout_s, listen=listen)


def update_info(tensors: Sequence[tuple[str, torch.Tensor]]) -> dict:
    """The ``update_info`` body that tells the receivers what :func:`send_tensors` sends."""
    return {"names": [name for name, _ in tensors],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
            "shapes": [list(t.shape) for _, t in tensors]}


def send_tensors(group: ProcessGroup, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    for _, tensor in tensors:
        _broadcast(group, tensor.detach().to("cpu").contiguous())


def alongside(remote: Callable[[], object], local: Callable[[], None], timeout_s: float,
              what: str) -> None:
    """Run ``remote()`` (the engine's half of a collective: an RPC, an HTTP call) and
    ``local()`` (this process's half) at once, each on a helper thread, until both return or
    either fails: a remote half that refuses at once (a bad name, a shape) is reported at once,
    not after the local half's collective times out. The local half, blocked in gloo, then
    ends at the group's own timeout (``weights.timeout_s``); its group is dropped."""
    done = threading.Condition()
    results: dict[str, BaseException | None] = {}

    def run(name: str, fn: Callable[[], object]) -> None:
        error: BaseException | None = None
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            error = exc
        with done:
            results[name] = error
            done.notify_all()

    for name, fn in (("remote", remote), ("local", local)):
        threading.Thread(target=run, args=(name, fn), name=f"vllm-{what}-{name}",
                         daemon=True).start()
    with done:
        finished = done.wait_for(lambda: len(results) == 2 or any(results.values()),
                                 timeout_s)
    for name in ("remote", "local"):  # the engine's error says more than a gloo timeout
        if results.get(name) is not None:
            raise results[name]  # type: ignore[misc]
    if not finished:
        raise TimeoutError(f"vLLM {what} did not finish in {timeout_s}s (weights.timeout_s)")


class GlooSender:
    """This process as rank 0 of a gloo transfer group with one engine's ``workers``.

    ``init(init_info)`` and ``update(update_info)`` are the engine's own calls (vLLM's
    ``init_weight_transfer_engine`` / ``update_weights``, in-process, over ZMQ or HTTP): the
    sender does its half of each beside them."""

    def __init__(self, host: str, workers: int, timeout_s: float) -> None:
        self.host = host
        self.world = 1 + workers
        self.timeout_s = timeout_s
        self.group: ProcessGroup | None = None

    def join(self, init: Callable[[dict], object]) -> None:
        listen = free_listen_socket(self.host)
        port = listen.getsockname()[1]
        info = {"master_address": self.host, "master_port": port, "rank_offset": 1,
                "world_size": self.world, "timeout_s": self.timeout_s}
        groups: list[ProcessGroup] = []
        alongside(lambda: init(info),
                  lambda: groups.append(open_sender_group(listen, self.world, self.timeout_s)),
                  self.timeout_s, "init_weight_transfer_engine")
        self.group = groups[0]
        logger.info("asyncrl_gloo: transfer group of %d on %s:%d", self.world, self.host, port)

    def send(self, tensors: Sequence[tuple[str, torch.Tensor]],
             update: Callable[[dict], object]) -> None:
        """One update's broadcast beside the engine's ``update(update_info)``. A failed one
        leaves the group in an unknown state: it is dropped, and the next update (after the
        sender's eviction and rejoin) joins a fresh one."""
        if self.group is None:
            raise RuntimeError("asyncrl_gloo: join() first")
        group = self.group
        try:
            alongside(lambda: update(update_info(tensors)),
                      lambda: send_tensors(group, tensors), self.timeout_s, "update_weights")
        except BaseException:
            self.group = None
            raise
