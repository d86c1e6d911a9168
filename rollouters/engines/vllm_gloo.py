"""Our weight-transfer backend for vLLM's RL API, both halves, registered twice:
``asyncrl_gloo`` and ``asyncrl_nccl`` (``--weight-transfer-config '{"backend": ...}'``).

vLLM's built-in backends (nccl, ipc, ...) are CUDA-only, and its nccl has no sender half we
can drive from a rollout process (its ipc worker half we feed ourselves:
:mod:`rollouters.engines.vllm_ipc`), but its registry is pluggable
(``WeightTransferEngineFactory.register_engine``). The worker half, :class:`GroupWeightTransfer`,
joins a group with the sender (rank 0) and loads each broadcast tensor inside vLLM's
layer-wise reload, which re-packs CPU linears. The sender half is
:class:`~rollouters.engines.vllm_sender.GroupSender`.

``asyncrl_gloo`` and ``asyncrl_nccl`` are the same class and the same code: the registered
name only picks the :class:`TransferPlan` (:func:`transfer_plan`): the torch backend of the
group and where the buckets live (host memory for gloo, the engine's CUDA device for nccl),
as :mod:`asyncrl.weights.group` does for the learner's own ``gloo`` / ``nccl``. So CPU CI runs
the nccl path through gloo. NCCL refuses two ranks on one GPU, so ``asyncrl_nccl`` needs the
sender on a GPU none of the engine's workers use; the worker refuses at once otherwise
(:func:`check_devices`). It has not run here: no machine of ours has vLLM and a GPU.

The group comes from ``stateless_init_torch_distributed_process_group``: it lives outside
``torch.distributed``'s default world, so it never collides with vLLM's own groups, and its
collectives are issued on the ``ProcessGroup`` object with group-local ranks.
"""

from __future__ import annotations

import logging
import socket
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
NCCL_BACKEND = "asyncrl_nccl"
TORCH_BACKENDS = {BACKEND: "gloo", NCCL_BACKEND: "nccl"}
"""Each registered name and the torch backend of its group: the only difference between them."""
SENDER_RANK = 0


@dataclass(frozen=True)
class TransferPlan:
    """What a registered name decides: the group's torch backend and the buckets' device."""

    torch_backend: str
    device: torch.device


def transfer_plan(name: str, device: torch.device | None = None) -> TransferPlan:
    """The plan of backend ``name``: gloo buckets in host memory; nccl buckets on ``device``
    (the worker's model device; None: this process's CUDA device, resolved when used)."""
    try:
        torch_backend = TORCH_BACKENDS[name]
    except KeyError:
        raise ValueError(f"weights.transport: vLLM backend {name!r} is not ours "
                         f"({' | '.join(TORCH_BACKENDS)})") from None
    if torch_backend == "gloo":
        return TransferPlan(torch_backend, torch.device("cpu"))
    if device is None or device.type != "cuda":
        device = torch.device("cuda")
    return TransferPlan(torch_backend, device)


def check_devices(plan: TransferPlan, sender: str, worker: torch.device) -> None:
    """Refuse an NCCL group whose sender shares the worker's GPU (``sender``: the sender's
    :func:`~asyncrl.weights.transport.describe_device`): NCCL would fail the group's build
    with "Duplicate GPU detected" after the sender had waited for it."""
    from asyncrl.weights.transport import describe_device

    if plan.torch_backend == "nccl" and sender == describe_device(worker):
        raise RuntimeError(
            "weights.transport 'nccl': the vLLM worker shares the sender's GPU, and NCCL "
            "refuses two ranks on one device (use weights.transport = 'gloo' or 'auto')")


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int = 1
    world_size: int = 2
    timeout_s: float = 60.0
    sender_device: str = "cpu"  # the sender's describe_device, for check_devices


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)


def init_group(host: str, port: int, rank: int, world: int, timeout_s: float,
               backend: str, listen: socket.socket | None = None) -> ProcessGroup:
    """One end of a transfer group over torch backend ``backend`` (``listen``: the sender's
    bound socket, where its store serves)."""
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    return stateless_init_torch_distributed_process_group(
        host, port, rank, world, backend=backend, listen_socket=listen,
        timeout=timedelta(seconds=timeout_s))


def _broadcast(group: ProcessGroup, tensor: torch.Tensor) -> None:
    """One tensor from the sender (worker side; over NCCL the wait only orders the stream,
    and :meth:`GroupWeightTransfer.update_weights` synchronizes at the end)."""
    group.broadcast(tensor, SENDER_RANK).wait()


class GroupWeightTransfer(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Worker side: receive broadcast tensors from the sender, load them layer-wise. One
    class for ``asyncrl_gloo`` and ``asyncrl_nccl``: the name it was created under
    (``config.backend``) picks its :class:`TransferPlan`."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.plan = transfer_plan(self.config.backend, self.device)
        self.group: ProcessGroup | None = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        check_devices(self.plan, init_info.sender_device, self.device)
        # Unique across data-parallel replicas, as vLLM's NCCL backend counts them.
        config = self.parallel_config
        rank = init_info.rank_offset + config.data_parallel_index * config.world_size + \
            config.rank
        self.group = init_group(init_info.master_address, init_info.master_port, rank,
                                 init_info.world_size, init_info.timeout_s,
                                 self.plan.torch_backend)
        logger.info("%s: joined %s:%d as rank %d/%d", self.config.backend,
                    init_info.master_address, init_info.master_port, rank, init_info.world_size)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict) -> None:
        """As the base class; its accelerator synchronize only where the buckets are on
        CUDA (NCCL's waits are asynchronous; gloo's are not, and a CPU worker has none)."""
        self.receive_weights(self.parse_update_info(update_info))
        if self.plan.device.type == "cuda":
            torch.cuda.synchronize(self.plan.device)

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        """Receive and load each tensor. If one fails (a name or shape the model refuses),
        the layer-wise reload is finalized before the error goes up: vLLM's worker then ends
        the update without finishing it, and layers left on the meta device would fail the
        next step; finalizing gives every layer that received nothing its old weights back."""
        if self.group is None:
            raise RuntimeError(f"{self.config.backend}: init_weight_transfer_engine was not "
                               "called")
        try:
            for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names,
                                               update_info.shapes):
                tensor = torch.empty(shape, dtype=getattr(torch, dtype_name),
                                     device=self.plan.device)
                _broadcast(self.group, tensor)
                self.model.load_weights([(name, tensor.to(self.device))])
        except BaseException:
            self.finish_weight_update()
            raise

    def shutdown(self) -> None:
        self.group = None


def register() -> None:
    """Make ``asyncrl_gloo`` and ``asyncrl_nccl`` known to vLLM in this process, both as
    :class:`GroupWeightTransfer` (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    for name in TORCH_BACKENDS:
        if name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(name, GroupWeightTransfer)
