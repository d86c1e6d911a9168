"""The phases of the colocated (hybrid) mode, ``launcher.colocate = true``, on the control plane.

Learner ranks and engines share devices, so they take turns: in the *rollout* phase the
engines generate while the learner's state waits in host memory; in the *train* phase the
engines sleep (their KV cache freed, their weights in host memory) while the learner steps.
Learner rank 0 leads (:class:`PhaseConductor`); every rollout worker follows on a thread of
its own (:class:`PhaseFollower`). Two keys carry it::

    colocate/phase           rank 0 → engines  {"phase": "train" | "rollout", "n": int,
                                                "token": str}
    colocate/ack/<member>    engine → rank 0   {"phase", "n", "token", "seconds", "memory"}:
                                               done, in that long, holding this much

``n`` counts the conductor's phases and ``token`` is its own: an ack left on the buffer by an
earlier learner (engines outlive a learner's restart) never passes for a new one.

The learner may touch the device only once every engine acked the train phase: it waits for
the acks of every present rollout member, bounded by ``weights.timeout_s`` and cut short by a
member that departs, says it stopped or goes silent (judged as the weight sync judges it,
:class:`asyncrl.weights.membership.Membership`), so a dead or frozen engine never holds the
run. The rollout phase is not waited for: the learner has moved its state out before it says
so, and an engine that wakes late only generates late. The staleness gate is unchanged, so
``buffer.max_staleness = 0`` is the synchronous schedule and ``>= 1`` lets the engines
generate the next batch with the previous weights (one step off).

An engine asked to sleep first finishes the generate call in flight (its KV cache is freed
when the call returns), so the handover costs at most one call. A follower that starts during
a train phase (a restarted worker) sleeps at once. Pure control-plane logic: importing it
imports no torch.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from asyncrl.control_plane import BufferStopped, ControlPlane
from asyncrl.weights.membership import Membership, present

__all__ = ["PHASE_KEY", "ROLLOUT", "TRAIN", "PhaseConductor", "PhaseFollower", "Sleeper",
           "ack_key"]

logger = logging.getLogger(__name__)

PHASE_KEY = "colocate/phase"
TRAIN = "train"      # engines asleep, the learner on the device
ROLLOUT = "rollout"  # engines awake, the learner's state in host memory
ACK_POLL_S = 0.5     # a wait for acks asks who is gone (and heartbeats) this often


def ack_key(member: str) -> str:
    """Engine → learner: ``{"phase", "n", "token", "seconds", "memory"}``, this phase's move
    is done (see the module docstring)."""
    return f"colocate/ack/{member}"


@runtime_checkable
class Sleeper(Protocol):
    """An engine that can give its device memory back between generation phases: what
    ``launcher.colocate`` needs of it (engine kinds that have it say so:
    :attr:`~asyncrl.engine_kinds.EngineKind.sleeps`). An engine may also say what it holds
    (``memory() -> {"weights_bytes", "kv_bytes", ...}``): the follower reports it."""

    @property
    def asleep(self) -> bool:
        """Between :meth:`sleep` and :meth:`wake_up`."""

    def sleep(self) -> None:
        """Finish the generate calls in flight, then free the KV cache and move the weights
        to host memory; generate calls made meanwhile wait for :meth:`wake_up`. Weight
        updates while asleep land in the host copy."""

    def wake_up(self) -> None:
        """Move the weights back to the device and let generation go on."""


class PhaseConductor:
    """Learner rank 0's side: says each phase and, for the train phase, waits until every
    engine is asleep. ``control`` is used from the caller's thread only; ``beat`` is called
    about every :data:`ACK_POLL_S` while waiting, so a learner that waits is never declared
    dead."""

    def __init__(self, control: ControlPlane, timeout_s: float,
                 beat: Callable[[], object] | None = None) -> None:
        self._control = control
        self._timeout_s = timeout_s
        self._beat = beat
        self._n = 0
        self._token = uuid.uuid4().hex[:8]
        self.phase = ROLLOUT
        self._woken: list[str] = []  # the members told to wake at the last rollout phase
        self._membership = Membership(timeout_s)  # who is lost, as the weight sync sees it
        self._version = 0

    def to_train(self, version: int = 0) -> dict[str, float]:
        """Put every present engine to sleep for the step from ``version``; returns the
        handover's metrics: how long the learner waited (``colocate/sleep_s``), the slowest
        engine's own sleep and its wake at the previous rollout phase, how many engines
        missed the deadline, and the bytes of weights, KV cache and receive buffers the
        sleeping engines say they still hold (``colocate/asleep_held_bytes``: 0 when all let
        go of them;
        on CUDA also ``colocate/engines_gib_asleep``, all their processes still allocate, and
        ``colocate/engines_gib_peak``, the sum of their peaks in the rollout phase before)."""
        from asyncrl.weights.rendezvous import await_keys  # imports torch.distributed

        start = time.monotonic()
        self._version = version  # named in the reason an engine is not waited for
        members = self._members()
        wakes = self._acks(self._woken, ROLLOUT, self._n)  # the last rollout's, if in already
        self._say(TRAIN)
        keys = [ack_key(name) for name in members]
        n = self._n

        def acked(value: dict[str, Any]) -> bool:
            return self._answers(value, TRAIN, n)

        missing = await_keys(self._control, keys, acked, start + self._timeout_s,
                             poll_s=ACK_POLL_S, gone=self._gone)
        if missing:
            logger.warning("colocate: %d engine(s) not asleep after %.1f s, training anyway: %s",
                           len(missing), time.monotonic() - start, missing)
        asleep = [value for _, value in self._control.get_keys(keys).values()
                  if self._answers(value, TRAIN, n)]
        sleeps = [float(value.get("seconds", 0.0)) for value in asleep]
        held = sum(value.get("memory", {}).get(part, 0) for value in asleep
                   for part in ("weights_bytes", "kv_bytes", "receive_bytes"))
        on_cuda = {}   # what engines on CUDA report: all their processes allocate, and peaked at
        for metric, part in (("engines_gib_asleep", "device_allocated_bytes"),
                             ("engines_gib_peak", "device_peak_bytes")):
            reported = [value["memory"][part] for value in asleep
                        if part in value.get("memory", {})]
            if reported:
                on_cuda[f"colocate/{metric}"] = sum(reported) / 2**30
        return {"colocate/sleep_s": time.monotonic() - start,
                "colocate/asleep_held_bytes": float(held), **on_cuda,
                "colocate/engine_sleep_s": max(sleeps, default=0.0),
                "colocate/wake_s": max(wakes, default=0.0),
                "colocate/engines": float(len(members)),
                "colocate/not_asleep": float(len(missing))}

    def to_rollout(self) -> None:
        """Let the engines wake and generate (the learner's state is in host memory)."""
        self._woken = self._members()
        self._say(ROLLOUT)

    def _say(self, phase: str) -> None:
        self._n += 1
        self.phase = phase
        self._control.set_key(PHASE_KEY, {"phase": phase, "n": self._n, "token": self._token})

    def _members(self) -> list[str]:
        listed = self._control.status().get("members", {})
        return sorted(name for name, entry in listed.items() if present(entry))

    def _gone(self, keys: list[str]) -> list[str]:
        """The keys still missing whose engine is lost: departed, stopped, or silent for half
        of the timeout (frozen: it would never ack), as the weight sync judges it (and a
        heartbeat of the learner)."""
        if self._beat is not None:
            self._beat()
        names = [key.removeprefix(ack_key("")) for key in keys]
        lost = self._membership.lost(self._control.status().get("members", {}), names,
                                     self._version)
        for name, why in lost.items():
            logger.warning("colocate: not waiting for %s to sleep: %s", name, why)
        return [ack_key(name) for name in lost]

    def _acks(self, members: list[str], phase: str, n: int) -> list[float]:
        """The seconds each of ``members`` reported for phase ``n`` (those that did)."""
        found = self._control.get_keys([ack_key(name) for name in members])
        return [float(value.get("seconds", 0.0)) for _, value in found.values()
                if self._answers(value, phase, n)]

    def _answers(self, ack: dict[str, Any], phase: str, n: int) -> bool:
        """Is ``ack`` an answer to this conductor's phase ``n``?"""
        return ack.get("phase") == phase and ack.get("n") == n \
            and ack.get("token") == self._token


class PhaseFollower:
    """A rollout worker's side, on a daemon thread: sleeps and wakes ``engine`` as rank 0
    says, and acks each move with its duration. ``control`` must be a client of its own
    (clients are not thread-safe); the caller closes it after :meth:`close`. ``on_phase`` is
    told ``"asleep"`` or ``"awake"`` after each move (the worker's heartbeat shows it).

    ``stop``: the worker's stop event. Its engine blocks generation while asleep, so the
    worker's loop may be waiting inside a generate call: once ``stop`` is set the follower
    wakes the engine, and the loop gets out and sees the stop."""

    def __init__(self, control: ControlPlane, member: str, engine: Sleeper,
                 stop: threading.Event | None = None,
                 on_phase: Callable[[str], None] | None = None, poll_s: float = 0.25) -> None:
        self.member = member
        self._control = control
        self._engine = engine
        self._on_phase = on_phase
        self._poll_s = poll_s
        self._seq = 0
        self._asleep = False
        self._stop = stop or threading.Event()   # the worker's: watched, never set here
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"colocate-{member}",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """End the thread (it wakes an engine it left asleep on its way out)."""
        self._closed.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            while not (self._stop.is_set() or self._closed.is_set()):
                try:
                    got = self._control.get_key(PHASE_KEY, newer_than=self._seq,
                                                timeout_s=self._poll_s)
                except BufferStopped:
                    return
                except (TimeoutError, RuntimeError) as exc:  # the next poll may get through
                    logger.warning("colocate: %s could not read the phase: %s", self.member,
                                   exc)
                    continue
                if got is not None:
                    self._seq, value = got
                    self._follow(value)
        finally:
            if self._asleep:  # a stopping worker's generate may be waiting for the wake
                self._engine.wake_up()
                self._asleep = False

    def _follow(self, value: dict[str, Any]) -> None:
        """Move into the phase ``value`` says (if not there yet), then ack it."""
        phase = value.get("phase")
        start = time.monotonic()
        if phase == TRAIN and not self._asleep:
            self._engine.sleep()
            self._asleep = True
        elif phase == ROLLOUT and self._asleep:
            self._engine.wake_up()
            self._asleep = False
        seconds = time.monotonic() - start
        if self._on_phase is not None:
            self._on_phase("asleep" if self._asleep else "awake")
        held = getattr(self._engine, "memory", None)  # what it still holds, if it can say
        self._control.set_key(ack_key(self.member), {
            "phase": phase, "n": value.get("n"), "token": value.get("token"),
            "seconds": round(seconds, 6),
            "memory": held() if held is not None else {}})
        logger.debug("colocate: %s %s in %.3f s", self.member,
                     "asleep" if self._asleep else "awake", seconds)
