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
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping

import torch

from buffers.protocol import ControlPlane
from learners.weights import WeightBroadcaster

logger = logging.getLogger(__name__)


class WeightPublisher:
    """Delivers each version to the engines, then publishes it; one delivery in flight.

    ``control`` is used only by this object (from its thread while a delivery runs); the
    caller closes it after :meth:`close`.
    """

    def __init__(self, control: ControlPlane, broadcaster: WeightBroadcaster,
                 overlap: bool = True) -> None:
        self._control = control
        self.broadcaster = broadcaster
        self._overlap = overlap
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
        if not self._overlap:
            self._deliver(state, version)
            return {**self.wait(), "timing/weight_wait": waited}
        self._thread = threading.Thread(target=self._deliver, args=(state, version),
                                        name=f"weights-v{version}", daemon=True)
        self._thread.start()
        return {**previous, "timing/weight_wait": waited}

    def wait(self) -> dict[str, float]:
        """Wait for the delivery in flight (if any); its metrics. Re-raises its failure."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("weight delivery failed") from error
        metrics, self._metrics = self._metrics, {}
        return metrics

    def deliver_now(self, state: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        """Deliver and publish ``version`` before returning (resume, late joiners)."""
        self.wait()
        self._deliver(state, version)
        return self.wait()

    def resync(self, state: Mapping[str, torch.Tensor], version: int) -> bool:
        """Re-send ``version`` if the engines changed since the last delivery (a late joiner
        would otherwise wait for weights while the learner waits for its data)."""
        self.wait()
        if not self.broadcaster.needs_sync():
            return False
        logger.info("engines changed while waiting for data: re-sending version %d", version)
        self.broadcaster.sync(state, version)
        return True

    def _deliver(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        try:
            metrics = self.broadcaster.sync(state, version)
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
