"""The learner's half of the colocated mode (``launcher.colocate``): its state leaves the
device while the engines generate, and comes back once they sleep.

:class:`HostOffload` moves a trainer's sharded parameters, their gradients and the optimizer
state (the reference model's and the critic's too, when there are) into host memory and back.
It goes through ``nn.Module._apply``, which FSDP2 overrides to re-register each shard after a
move (``FSDPParam.reset_sharded_param``), so the parameters stay the same objects and the
optimizer keeps pointing at them. Every move makes a new allocation, on CPU too: the moves are
real, and a test sees the old storage go.

:func:`make_phases` gives the loop one interface whether the run is colocated or not:
:class:`Colocated` (rank 0 conducts the engines, :mod:`asyncrl.colocate`; every rank moves its
own shards) or :class:`Separate`, which does nothing. The order of one colocated step::

    (rollout phase: engines generate, the learner's state in host memory)
    train_phase    rank 0 puts the engines to sleep and waits for them; the ranks agree
                   (a barrier); each moves its state to the device
    train_step
    gather         the full weights for the engines (on host: ``cpu_offload``)
    rollout_phase  each rank moves its state to host; rank 0 lets the engines wake
    publish        the weights go to the engines (awake or waking: they commit them at once)

The learner waits for every engine to be asleep before it touches the device; the engines
wake only after the learner let go of it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from asyncrl.devices import release_device_memory

if TYPE_CHECKING:
    from learners.lost import Lost

logger = logging.getLogger(__name__)

HOST = torch.device("cpu")
SLEEPING = "colocated: putting the engines to sleep"   # the learner's state, as the monitor shows
TRAINING = "colocated: training, engines asleep"


class HostOffload:
    """Moves ``modules`` (parameters, gradients, buffers) and ``optimizers``' state between
    ``device`` and host memory. From CUDA, plain tensors go to pinned memory (their way back
    is a DMA); DTensor shards move through ``DTensor.to``, into pageable memory."""

    def __init__(self, modules: Iterable[nn.Module], optimizers: Iterable[torch.optim.Optimizer],
                 device: torch.device) -> None:
        self.modules = list(modules)
        self.optimizers = list(optimizers)
        self.device = device
        self.on_host = False
        # optimizer state tensors that live on the device (AdamW keeps its ``step`` on CPU)
        self._moved: set[tuple[int, str]] = set()

    def to_host(self) -> float:
        """Everything to host memory; returns the seconds it took."""
        start = time.perf_counter()
        move = _mover(HOST)
        for module in self.modules:
            module._apply(move)
        self._moved = set()
        for state in self._states():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.device == self.device:
                    state[key] = move(value)
                    self._moved.add((id(state), key))
        release_device_memory(self.device)   # the engines come next: all of it, workspaces too
        self.on_host = True
        return time.perf_counter() - start

    def to_device(self) -> float:
        """Everything back to ``device``; returns the seconds it took."""
        start = time.perf_counter()
        move = _mover(self.device)
        for module in self.modules:
            module._apply(move)
        for state in self._states():
            for key, value in state.items():
                if (id(state), key) in self._moved:
                    state[key] = move(value)
        self._moved = set()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.on_host = False
        return time.perf_counter() - start

    def _states(self) -> list[dict[str, Any]]:
        return [state for opt in self.optimizers for state in opt.state.values()]


def _mover(device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """A copy to ``device`` in storage of its own, also when the tensor is there already."""
    pin = device.type == "cpu" and torch.cuda.is_available()

    def move(tensor: torch.Tensor) -> torch.Tensor:
        if pin and tensor.is_cuda and not hasattr(tensor, "_local_tensor"):
            return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor)
        return tensor.to(device, copy=True)

    return move


def trainer_offload(trainer: Any) -> HostOffload:
    """A :class:`HostOffload` over everything an FSDP2 trainer keeps on its device."""
    modules = [trainer.model]
    optimizers = [trainer.optimizer]
    if getattr(trainer, "reference", None) is not None:
        modules.append(trainer.reference)
    critic = getattr(trainer, "critic", None)
    if critic is not None:
        modules.append(critic.model)
        optimizers.append(critic.optimizer)
    return HostOffload(modules, optimizers, trainer.device)


class Separate:
    """Not colocated: the learner keeps its device, the engines theirs. Nothing to do."""

    def train_phase(self, version: int, lost: Lost | None = None) -> None:
        return None

    def rollout_phase(self, lost: Lost | None = None) -> dict[str, Any]:
        return {}

    def end(self) -> None:
        return None


class Colocated:
    """Time-slices the device with the engines (see the module docstring). ``conductor`` is
    rank 0's :class:`~asyncrl.colocate.PhaseConductor`, None on the other ranks. Every
    method is COLLECTIVE with more than one rank."""

    def __init__(self, offload: HostOffload, conductor: Any | None, world: int,
                 beat: Callable[[str], object] | None = None) -> None:
        self.offload = offload
        self.conductor = conductor
        self.world = world
        self._beat = beat   # rank 0: the learner's heartbeat with a state (the monitor shows)
        self._handover: dict[str, Any] = {}

    def start(self) -> None:
        """Before the first batch: the engines generate, so the learner's state leaves."""
        self.rollout_phase()

    def train_phase(self, version: int, lost: Lost | None = None) -> None:
        """Engines asleep, then this rank's state on the device. Its metrics come with
        :meth:`rollout_phase`'s. ``version``: the learner's, before the step. ``lost``: the
        step's :class:`~learners.lost.Lost`; a buffer that stops answering costs no training
        (the step goes on, and its end finds the buffer lost, as every request's does)."""
        start = time.perf_counter()
        metrics = self._ask(lost, self.conductor.to_train, version) \
            if self.conductor is not None else {}
        if self.world > 1:
            dist.barrier()   # no rank takes the device before rank 0 saw every engine asleep
        metrics["colocate/onload_s"] = self.offload.to_device()
        metrics.update(self._allocated("in"))
        if self.offload.device.type == "cuda":   # the train phase's peak, read before the move out
            torch.cuda.reset_peak_memory_stats(self.offload.device)
        if self._beat is not None:
            self._ask(lost, self._beat, TRAINING)
        self._handover = {**metrics, "colocate/handover_s": time.perf_counter() - start}

    def rollout_phase(self, lost: Lost | None = None) -> dict[str, Any]:
        """This rank's state to host, then (rank 0) the engines may wake. Returns this step's
        handover metrics: ``colocate/handover_s`` (the learner's wall time in both moves),
        ``colocate/sleep_s`` (its wait for the engines), ``onload_s``, ``offload_s``, the
        slowest engine's own ``engine_sleep_s`` and ``wake_s``."""
        start = time.perf_counter()
        peak = self._peak()
        offload_s = self.offload.to_host()
        out = {**peak, **self._allocated("out")}
        if self.conductor is not None:
            self._ask(lost, self.conductor.to_rollout)
        metrics, self._handover = self._handover, {}
        handover = metrics.get("colocate/handover_s", 0.0) + time.perf_counter() - start
        return {**metrics, **out, "colocate/offload_s": offload_s,
                "colocate/handover_s": handover}

    @staticmethod
    def _ask(lost: Lost | None, request: Callable[..., Any], *args: Any) -> Any:
        """``request(*args)`` through ``lost`` (nothing once the buffer is lost)."""
        if lost is None:
            return request(*args)
        return lost.call(request, *args, default={})

    def _allocated(self, when: str) -> dict[str, float]:
        """CUDA: what this process holds on its device now (``colocate/learner_gib_in`` after
        the move in, ``_out`` after the move out). CPU: nothing (host and device are one)."""
        device = self.offload.device
        if device.type != "cuda":
            return {}
        return {f"colocate/learner_gib_{when}": torch.cuda.memory_allocated(device) / 2**30}

    def _peak(self) -> dict[str, float]:
        """CUDA: the most this process held on its device since the move in
        (``colocate/learner_gib_peak``: state, activations, workspaces); nothing before the
        first step, or on CPU."""
        device = self.offload.device
        if device.type != "cuda" or self.offload.on_host:
            return {}
        return {"colocate/learner_gib_peak": torch.cuda.max_memory_allocated(device) / 2**30}

    def end(self) -> None:
        """After the last step: the state back on the device for the run's end (export, final
        checkpoint, whose gathers need it there). The engines are not put to sleep: the run
        is over, they exit."""
        if self.offload.on_host:
            self.offload.to_device()


def make_phases(cfg: Any, trainer: Any, control: Any, rank: int, world: int,
                beat: Callable[[str], object] | None = None) -> Colocated | Separate:
    """:class:`Colocated` with ``launcher.colocate``, else :class:`Separate`. ``control``:
    rank 0's buffer client, used from the loop's thread only; ``beat(state)`` heartbeats the
    learner with that state (rank 0): while it waits for the engines, and as it trains."""
    if not cfg.launcher.colocate:
        return Separate()
    from asyncrl.colocate import PhaseConductor

    conductor = beat_on = None
    if rank == 0:
        beat_on = beat
        waiting = (lambda: beat(SLEEPING)) if beat is not None else None
        conductor = PhaseConductor(control, cfg.weights.timeout_s, waiting)
    phases = Colocated(trainer_offload(trainer), conductor, world, beat_on)
    phases.start()
    logger.info("colocated: the learner's state is in host memory while the engines generate")
    return phases
