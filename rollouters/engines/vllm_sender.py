"""The sender half of the vLLM engines' weight transfer: what the vLLM engines
(:mod:`vllm_engine`, :mod:`vllm_async`, :mod:`vllm_server`) run beside the engine's own
``init_weight_transfer_engine`` / ``update_weights`` / ``finish_weight_update`` calls, behind
one small protocol (:class:`WeightSender`), built by :func:`make_sender` from the backend's
name.

:class:`GroupSender` is this process as rank 0 of a transfer group with one engine's workers
(our backends, :mod:`vllm_gloo`). The same code for ``asyncrl_gloo`` and ``asyncrl_nccl``:
only the group's torch backend and the buckets' device differ
(:func:`~rollouters.engines.vllm_gloo.transfer_plan`); every broadcast is bounded by the
weight groups' watchdog (:mod:`asyncrl.weights.watchdog`), so CPU CI runs NCCL's bound too.
The ``ipc`` and ``asyncrl_shm`` senders hand the engine handles instead
(:mod:`rollouters.engines.vllm_ipc`).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch.distributed import ProcessGroup

from asyncrl.weights.group import GroupPending
from asyncrl.weights.watchdog import Watchdog
from rollouters.engines.vllm_gloo import BACKEND, SENDER_RANK, init_group, transfer_plan

logger = logging.getLogger(__name__)


def free_listen_socket(host: str) -> socket.socket:
    """A bound, listening socket on a free port: the sender's store, with no port race."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen()
    return sock


def open_sender_group(listen: socket.socket, world: int, timeout_s: float,
                      backend: str = "gloo") -> ProcessGroup:
    """Rank 0 of the transfer group (blocks until every receiver has joined)."""
    host, port = listen.getsockname()[:2]
    return init_group(host, port, SENDER_RANK, world, timeout_s, backend, listen=listen)


def update_info(tensors: Sequence[tuple[str, torch.Tensor]]) -> dict:
    """The ``update_info`` body that tells the receivers what :func:`send_tensors` sends."""
    return {"names": [name for name, _ in tensors],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
            "shapes": [list(t.shape) for _, t in tensors]}


def send_tensors(group: ProcessGroup, tensors: Sequence[tuple[str, torch.Tensor]],
                 device: torch.device, watchdog: Watchdog) -> None:
    """Broadcast each tensor from ``device`` (host memory for gloo, this process's GPU for
    nccl), each wait bounded by ``watchdog`` as the learner's groups are
    (:mod:`asyncrl.weights.watchdog`): an NCCL wait on a frozen peer would not raise."""
    for _, tensor in tensors:
        bucket = tensor.detach().to(device).contiguous()
        GroupPending(group.broadcast(bucket, SENDER_RANK), watchdog.watch(), watchdog).wait()


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


class WeightSender(Protocol):
    """One engine's weight transfer, seen from this process. ``stage_device``: where
    :meth:`send` wants the tensors (the engines copy them there first)."""

    stage_device: torch.device

    @property
    def joined(self) -> bool:
        """Has :meth:`join` run since the sender was made or last dropped?"""

    def join(self, init: Callable[[dict], object]) -> None:
        """Set up the transfer beside the engine's ``init(init_info)``."""

    def send(self, tensors: Sequence[tuple[str, torch.Tensor]],
             update: Callable[[dict], object], finish: Callable[[], object]) -> None:
        """One update: the tensors reach the engine beside its ``update(update_info)``, then
        ``finish()``. A failed transfer drops the sender (the next update joins again)."""

    def drop(self) -> None:
        """Forget the transfer; the next update joins again."""


def make_sender(backend: str, host: str, workers: int, timeout_s: float) -> WeightSender:
    """The sender of vLLM backend ``backend`` (``opts.weight_backend``), for an engine of
    ``workers`` workers; ``host``: where a group's store binds."""
    from rollouters.engines.vllm_gloo import TORCH_BACKENDS

    if backend in TORCH_BACKENDS:
        return GroupSender(host, workers, timeout_s, backend)
    from rollouters.engines.vllm_ipc import IPC_BACKENDS, IpcSender

    if backend in IPC_BACKENDS:
        return IpcSender(backend, workers, timeout_s)
    raise ValueError(f"weights.transport: the vLLM engines send weights with "
                     f"{' | '.join([*TORCH_BACKENDS, *IPC_BACKENDS])}, not {backend!r}")


class GroupSender:
    """This process as rank 0 of a transfer group with one engine's ``workers``, over the
    torch backend of ``backend`` (``asyncrl_gloo`` or ``asyncrl_nccl``: :func:`transfer_plan`).

    ``init(init_info)`` and ``update(update_info)`` are the engine's own calls (vLLM's
    ``init_weight_transfer_engine`` / ``update_weights``, in-process, over ZMQ or HTTP): the
    sender does its half of each beside them."""

    def __init__(self, host: str, workers: int, timeout_s: float,
                 backend: str = BACKEND) -> None:
        self.backend = backend
        self.plan = transfer_plan(backend)
        if self.plan.device.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("weights.transport 'nccl' needs CUDA, and this process "
                                   "sees none")
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = self.plan.device
        self.stage_device = torch.device("cpu")  # the engines' copy; sent from self.device
        self.host = host
        self.world = 1 + workers
        self.timeout_s = timeout_s
        self.group: ProcessGroup | None = None
        self._watchdog: Watchdog | None = None

    @property
    def joined(self) -> bool:
        return self.group is not None

    def join(self, init: Callable[[dict], object]) -> None:
        from asyncrl.weights.transport import describe_device

        listen = free_listen_socket(self.host)
        port = listen.getsockname()[1]
        info = {"master_address": self.host, "master_port": port, "rank_offset": 1,
                "world_size": self.world, "timeout_s": self.timeout_s,
                "sender_device": describe_device(self.device)}
        groups: list[ProcessGroup] = []

        def open_group() -> None:  # on alongside's thread: the device is set there
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # NCCL binds this end's communicator to it
            groups.append(open_sender_group(listen, self.world, self.timeout_s,
                                            self.plan.torch_backend))

        alongside(lambda: init(info), open_group, self.timeout_s, "init_weight_transfer_engine")
        group = self.group = groups[0]
        self._watchdog = Watchdog(self.timeout_s, group.abort, f"{self.backend}-{port}")
        logger.info("%s: transfer group of %d on %s:%d", self.backend, self.world, self.host,
                    port)

    def send(self, tensors: Sequence[tuple[str, torch.Tensor]],
             update: Callable[[dict], object], finish: Callable[[], object]) -> None:
        """One update's broadcast beside the engine's ``update(update_info)``, then
        ``finish()``. A failed broadcast leaves the group in an unknown state: it is dropped,
        and the next update (after the sender's eviction and rejoin) joins a fresh one."""
        if self.group is None or self._watchdog is None:
            raise RuntimeError(f"{self.backend}: join() first")
        group, watchdog = self.group, self._watchdog
        try:
            alongside(lambda: update(update_info(tensors)),
                      lambda: send_tensors(group, tensors, self.device, watchdog),
                      self.timeout_s, "update_weights")
        except BaseException:
            self.drop()
            raise
        finish()

    def drop(self) -> None:
        """Forget the group (the next update joins a fresh one) and stop watching it."""
        self.group = None
        if self._watchdog is not None:
            self._watchdog.close()
            self._watchdog = None
