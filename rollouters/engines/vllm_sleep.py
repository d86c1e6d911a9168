"""What both vLLM engines share to sleep in the colocated mode (``launcher.colocate``).

The engines' :meth:`sleep` and :meth:`wake_up` follow vLLM's sleep mode as its docs give it
for RL weight updates: ``sleep(level)`` (vLLM pauses its scheduler, then frees the device
memory), and on waking ``wake_up(tags=["weights"])``, load the new weights,
``wake_up(tags=["kv_cache"])`` (the KV cache is allocated only once the weights are in, and
the scheduler resumes when both are back).

**Level 1**, not 2. Level 2 discards the weights; vLLM's docs suggest it for RL weight updates,
where an update always comes before the next generation (a synchronous loop). Ours need not:
with ``buffer.max_staleness >= 1`` an engine wakes and generates with the weights it had while
the learner's next update is still on its way (the learner publishes after it lets the engines
wake), and an update can also fail or never come (an engine evicted from the epoch, a learner
that restarts). At level 2 the engine would then generate from freed memory; at level 1 its
weights wait in host memory and come back as they were. The price is one copy of the weights to
host and back per step.

**An update that arrives while asleep is held until the wake**, in host memory
(:class:`HeldUpdate`), then applied between the two wakes: waking the weights to apply it
at once would put them back on the device while the learner steps there.

**Memory release is GPU-only.** vLLM refuses ``enable_sleep_mode`` on CPU, and its CPU
worker's ``sleep``/``wake_up`` are logged no-ops; on CPU the engines leave the option unset and
run the same calls, so CI tests the sequence against a real vLLM, but the freeing itself is
vLLM's (its CuMem allocator) and has not run here.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch

__all__ = ["SLEEP_LEVEL", "GenerateGate", "HeldUpdate", "memory_report", "releases_memory",
           "wake_in_order"]

logger = logging.getLogger(__name__)

SLEEP_LEVEL = 1
"""vLLM's sleep level: weights to host memory, KV cache discarded (see the module docstring)."""


def releases_memory(device: str) -> bool:
    """Does vLLM's sleep free memory on ``device``? On GPUs (sleep mode on); on CPU it is a
    no-op, and ``enable_sleep_mode`` is refused there."""
    return device != "cpu"


class GenerateGate:
    """Generate calls go through it; :meth:`close` waits for those in flight and makes new
    ones wait until :meth:`open`. The engine's side of "finish the calls in flight, and let
    the calls made asleep wait for the wake", whatever vLLM does with its own queue."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    @contextmanager
    def call(self) -> Iterator[None]:
        """One generate call: waits while the gate is closed."""
        with self._cond:
            self._cond.wait_for(lambda: not self._closed)
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify_all()

    def close(self) -> None:
        """No new call starts; returns once none is in flight."""
        with self._cond:
            self._closed = True
            self._cond.wait_for(lambda: self._active == 0)

    def open(self) -> None:
        with self._cond:
            self._closed = False
            self._cond.notify_all()


class HeldUpdate:
    """The weight updates that arrived while the engine slept, merged by name (a later tensor
    replaces an earlier one of the same name), with the newest version. The tensors are
    copied: the receiver reuses its buffers once the engine returns."""

    def __init__(self) -> None:
        self._tensors: dict[str, torch.Tensor] = {}
        self.version: int | None = None

    def hold(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        for name, tensor in weights:
            self._tensors[name] = tensor.detach().to("cpu", copy=True).contiguous()
        self.version = version
        logger.debug("asleep: holding %d tensors of version %d for the wake",
                     len(self._tensors), version)

    def take(self) -> tuple[list[tuple[str, torch.Tensor]], int] | None:
        """The held update and its version (None: nothing came), and forget it."""
        if self.version is None:
            return None
        held = (list(self._tensors.items()), self.version)
        self._tensors, self.version = {}, None
        return held

    @property
    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self._tensors.values())


def wake_in_order(wake: Callable[[list[str]], object], held: HeldUpdate,
                  apply: Callable[[list[tuple[str, torch.Tensor]], int], None]) -> None:
    """vLLM's order for RL: ``wake(["weights"])``, ``apply`` the update ``held`` while asleep
    (if one came), ``wake(["kv_cache"])`` (vLLM resumes its scheduler once both are back).
    An update that fails here is logged and the engine wakes with the weights it had (level
    1 kept them), labelled with their own version: the next update replaces them."""
    wake(["weights"])
    try:
        update = held.take()
        if update is not None:
            apply(*update)
    except Exception:  # noqa: BLE001 - the engine must wake, with the weights it has
        logger.exception("vLLM: the update held while asleep failed; the engine wakes with "
                         "its previous weights")
    finally:
        wake(["kv_cache"])


def memory_report(sizes: dict[str, int], asleep: bool, frees: bool,
                  held_bytes: int) -> dict[str, int]:
    """What a vLLM engine says it holds (:class:`~asyncrl.colocate.Sleeper`'s ``memory``):
    ``sizes`` are the worker's weights and KV cache at start (``asyncrl_memory``). Asleep on a
    GPU they are gone from the device and the weights wait in host memory (``host_bytes``), by
    vLLM's account of its level-1 sleep, not measured here; on CPU nothing is freed, and the
    figures say so. ``frees``: vLLM's sleep mode is on (``sleep_frees_memory`` in the report).
    ``host_bytes`` also counts a held update."""
    gone = asleep and frees
    weights, kv = sizes.get("weights_bytes", 0), sizes.get("kv_bytes", 0)
    return {"weights_bytes": 0 if gone else weights, "kv_bytes": 0 if gone else kv,
            "host_bytes": (weights if gone else 0) + held_bytes,
            "sleep_frees_memory": int(frees)}
