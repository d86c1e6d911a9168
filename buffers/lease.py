"""Lease renewal: a learner holding a batch through a long step keeps it from being reclaimed.

A batch stays pending until :meth:`~buffers.protocol.Buffer.ack`; one idle for
``buffer.reclaim_idle_s`` is presumed to belong to a dead learner and is redelivered. A live
learner whose optimizer step outlasts that would see its batch trained twice, so while it
computes, :func:`keep_leased` renews the lease from a background thread every
``reclaim_idle_s / 3``. A dead learner renews nothing and still loses its batch.

Clients are not thread-safe: the caller must not use ``client`` inside the ``with`` block
(the learner only computes there). The renewal thread and the caller never use the socket
at the same time, and thread start and join order their uses.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from buffers.protocol import Batch, Buffer

logger = logging.getLogger(__name__)

RENEWALS_PER_LEASE = 3  # renew this many times per reclaim_idle_s: two may be late


@contextmanager
def keep_leased(client: Buffer, consumer: str, batch: Batch, reclaim_idle_s: float
                ) -> Iterator[None]:
    """Renew ``batch``'s lease every ``reclaim_idle_s / 3`` until the block exits."""
    stop = threading.Event()
    thread = threading.Thread(target=_renew_until, name="buffer-lease", daemon=True,
                              args=(client, consumer, batch, reclaim_idle_s / RENEWALS_PER_LEASE,
                                    stop))
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _renew_until(client: Buffer, consumer: str, batch: Batch, interval_s: float,
                 stop: threading.Event) -> None:
    expected = len(batch.receipts)
    while not stop.wait(interval_s):
        try:
            held = client.renew(consumer, batch)
        except Exception as exc:  # noqa: BLE001 - logged; the next renewal may succeed
            logger.warning("%s: lease renewal failed: %r", consumer, exc)
            continue
        if held < expected:
            logger.warning("%s: %d of %d groups of the batch in training were reclaimed "
                           "before renewal (they may be trained twice: at-least-once)",
                           consumer, expected - held, expected)
            expected = held
