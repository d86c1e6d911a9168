"""What the engines that sleep in the colocated mode (``launcher.colocate``) share: both vLLM
engines, the vLLM server engine (its ``/sleep`` and ``/wake_up`` routes) and, with
:class:`DeferredUpdate`, SGLang (``/release_memory_occupation``, ``/resume_memory_occupation``:
the same tags, in the same order).

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

**An update whose data is not here is deferred** (:class:`DeferredUpdate`): SGLang's server
receives the learner's broadcast itself, so nothing can be copied aside; the thread that
brings the update waits, and the wake runs it at the same point, between the two wakes.

**Memory release is GPU-only.** vLLM refuses ``enable_sleep_mode`` on CPU, and its CPU
worker's ``sleep``/``wake_up`` are logged no-ops; on CPU the engines leave the option unset and
run the same calls, so CI tests the sequence against a real vLLM, but the freeing itself is
vLLM's (its CuMem allocator) and has not run here.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager

import torch

__all__ = ["SLEEP_LEVEL", "DeferredUpdate", "GenerateGate", "HeldUpdate", "SleepCycle",
           "memory_report", "releases_memory", "wake_in_order"]

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

    def apply_with(self, apply: Callable[[list[tuple[str, torch.Tensor]], int], None]) -> None:
        """``apply(tensors, version)`` the held update, if one came (and forget it)."""
        update = self.take()
        if update is not None:
            apply(*update)


class DeferredUpdate:
    """The update that arrived while asleep, for an engine whose server receives the weights
    itself (SGLang): not data but the call that makes the server take them. The thread that
    brings it leaves it (:meth:`defer`) and waits (:meth:`wait`) while the wake runs it
    (:meth:`run`, between the two wakes), and gets its outcome. One at a time: the weight
    receiver brings one update."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: tuple[Future[None], Callable[[], None]] | None = None

    def defer(self, update: Callable[[], None]) -> Future[None]:
        """Leave ``update`` for the wake, then :meth:`wait` for it. Call it under the
        engine's lock, as the wake runs under it: no wake can slip in between."""
        future: Future[None] = Future()
        with self._lock:
            if self._pending is not None:
                raise RuntimeError("an update is already waiting for the wake")
            self._pending = (future, update)
        return future

    def wait(self, future: Future[None], timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the wake to run the update (its error is raised here);
        False: no wake came in time, and the update was withdrawn, not run."""
        try:
            future.result(timeout_s)
            return True
        except (FutureTimeout, CancelledError):
            with self._lock:
                if self._pending is not None and self._pending[0] is future:
                    self._pending = None
            if future.cancel():  # not started: withdrawn
                return False
            future.result()  # the wake took it as the time ran out: its outcome
            return True

    def run(self) -> None:
        """The wake's side: run the waiting update, if any, and hand its outcome to the
        thread that brought it (an error is also raised here, for the wake to log)."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return
        future, update = pending
        if not future.set_running_or_notify_cancel():
            return
        try:
            update()
        except BaseException as exc:
            future.set_exception(exc)
            raise
        future.set_result(None)


class SleepCycle:
    """An engine's side of its server's sleep (vLLM's, SGLang's): the gate its generate calls
    pass (:class:`GenerateGate`), whether the server is asleep, and the order of the moves.
    ``lock``: the engine's update lock (one update, sleep or wake at a time); an update that
    reads :attr:`in_server` must hold it."""

    def __init__(self, lock: threading.Lock) -> None:
        self.gate = GenerateGate()  # closed while asleep
        self.in_server = False  # between the server's sleep and its last wake
        self._lock = lock

    @property
    def asleep(self) -> bool:
        return self.gate.closed

    def sleep(self, release: Callable[[], object]) -> None:
        """Let the generate calls in flight finish (new ones wait), then ``release()`` (the
        server's sleep) under the lock; if it fails, the engine is still awake and the waiting
        calls go on."""
        self.gate.close()
        with self._lock:
            try:
                release()
            except BaseException:
                self.gate.open()
                raise
            self.in_server = True

    def wake(self, wake: Callable[[list[str]], object], apply_held: Callable[[], object]) -> None:
        """:func:`wake_in_order` (not if the sleep failed), then the waiting calls go on."""
        with self._lock:
            if self.in_server:
                wake_in_order(wake, apply_held)
                self.in_server = False
        self.gate.open()


def wake_in_order(wake: Callable[[list[str]], object],
                  apply_held: Callable[[], object]) -> None:
    """vLLM's order for RL (SGLang's is the same): ``wake(["weights"])``, ``apply_held()``
    (the update held or deferred while asleep, if one came), ``wake(["kv_cache"])`` (the
    server resumes its scheduler once both are back). An update that fails here is logged and
    the engine wakes with the weights it had (level 1 kept them), labelled with their own
    version: the next update replaces them."""
    wake(["weights"])
    try:
        apply_held()
    except Exception:  # noqa: BLE001 - the engine must wake, with the weights it has
        logger.exception("the update held while asleep failed; the engine wakes with its "
                         "previous weights")
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
