"""Rank 0's weight publication off the critical path: broadcast, then publish the version.

Without overlap a learner step is ``wait for data + compute + gather + sync``: the engines'
transfer, their acks and the version publish sit between two optimizer steps. Nothing in the
next step needs them: its batch is already in the buffer (or being generated), and the gate
opens for the new version only once the publish happens, after every engine acked. So the
publisher runs ``sync`` and ``publish_version`` on a thread of its own, with a buffer client of
its own (clients are not thread-safe), while the learner goes on. At most one sync is in
flight: the next one first waits for it, which is also where its failure surfaces.

``bench/pipeline.py`` measured the serial sync at 10 % of a step with 64 engines (acks from
every engine, then the publish); ``weights.overlap = false`` restores the serial order.

A delivery may take up to ``weights.timeout_s`` per attempt (a slow engine is waited for), longer
than the buffer's heartbeat timeout: every delivery runs on the publisher's thread, and whoever
waits for it calls ``beat`` (the learner's heartbeat, on its own client) every ``beat_s``, so a
learner waiting for engines is never declared dead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

import torch

from asyncrl.control_plane import ControlPlane
from asyncrl.weights.broadcaster import WeightBroadcaster

logger = logging.getLogger(__name__)

BEAT_S = 2.0  # heartbeat this often while waiting for a delivery (buffer timeout: 15 s)


class WeightPublisher:
    """Delivers each version to the engines, then publishes it; one delivery in flight.

    ``control`` is used only by this object (from its thread while a delivery runs); the
    caller closes it after :meth:`close`. ``beat`` is called on the caller's thread, every
    ``beat_s`` while one of its calls waits for a delivery.
    """

    def __init__(self, control: ControlPlane, broadcaster: WeightBroadcaster,
                 overlap: bool = True, beat: Callable[[], object] | None = None,
                 beat_s: float = BEAT_S) -> None:
        self._control = control
        self.broadcaster = broadcaster
        self._overlap = overlap
        self._beat = beat
        self._beat_s = beat_s
        self._thread: threading.Thread | None = None
        self._metrics: dict[str, float] = {}
        self._error: BaseException | None = None

    def publish(self, state: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        """Start delivering ``version`` (``state`` must not change meanwhile); returns the
        metrics of the previous delivery (overlap) or of this one (no overlap), with
        ``timing/weight_wait``: how long this call waited for the previous one."""
        start = time.monotonic()
        previous = self.wait()
        waited = time.monotonic() - start
        self._start(state, version)
        if not self._overlap:
            return {**self.wait(), "timing/weight_wait": waited}
        return {**previous, "timing/weight_wait": waited}

    def wait(self) -> dict[str, float]:
        """Wait for the delivery in flight (if any), beating meanwhile; its metrics.
        Re-raises its failure."""
        if self._thread is not None:
            self._thread.join(self._beat_s)
            while self._thread.is_alive():
                self._beat_once()
                self._thread.join(self._beat_s)
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("weight delivery failed") from error
        metrics, self._metrics = self._metrics, {}
        return metrics

    def _beat_once(self) -> None:
        """A failed beat must not end the wait: the delivery thread still uses the client
        and the broadcaster, which the caller may close next."""
        if self._beat is None:
            return
        try:
            self._beat()
        except Exception as exc:  # noqa: BLE001 - logged; the next beat may get through
            logger.warning("heartbeat while waiting for the weight delivery failed: %r", exc)

    def deliver_now(self, state: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        """Deliver and publish ``version`` before returning (resume, late joiners)."""
        self.wait()
        self._start(state, version)
        return self.wait()

    def resync(self, state: Mapping[str, torch.Tensor], version: int) -> bool:
        """Re-send ``version`` if the engines changed since the last delivery (a late joiner
        would otherwise wait for weights while the learner waits for its data). The figures
        of the delivery it waited for stay for the next :meth:`publish` to return: this runs
        on every empty poll for data, and the step that had waited for data lost its
        ``weights/*`` and ``timing/weight_*`` record."""
        held = self.wait()
        try:
            if not self.broadcaster.needs_sync():
                return False
            logger.info("engines changed while waiting for data: re-sending version %d",
                        version)
            self._start(state, version, publish=False)
            self.wait()
            return True
        finally:
            self._metrics = held

    def _start(self, state: Mapping[str, torch.Tensor], version: int,
               publish: bool = True) -> None:
        self._thread = threading.Thread(target=self._deliver, args=(state, version, publish),
                                        name=f"weights-v{version}", daemon=True)
        self._thread.start()

    def _deliver(self, state: Mapping[str, torch.Tensor], version: int,
                 publish: bool = True) -> None:
        """The publisher thread: sync, then publish ``version`` (unless a re-send)."""
        try:
            metrics = self.broadcaster.sync(state, version)
            if publish:
                self._control.publish_version(version)
                self._metrics = {**metrics, "weights/version": float(version)}
        except BaseException as exc:  # noqa: BLE001 - re-raised by wait() on the caller's thread
            self._error = exc

    def close(self) -> None:
        """Finish the delivery in flight, then close the broadcaster (engines leave)."""
        try:
            self.wait()
        finally:
            self.broadcaster.close()
