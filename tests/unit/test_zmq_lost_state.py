"""A ZMQ broker restarted without its spill file takes the learner's progress over exactly.

The learner holds two batches from the old broker when it dies (the one it trains on and the
prefetched next one) and acks both to the new broker. Their receipts name the old epoch: the
new broker never served those groups. With the learner's own count in the ack it takes them
over, whether the ack or the next version reaches it first; the gate then admits exactly what
an uninterrupted broker would. (Before, the version alone seeded it, one or two steps short:
the quickstart with its broker SIGKILLed and no spill file dropped ~1,600 stale groups.)
Real brokers on their own threads, real sockets.
"""

from __future__ import annotations

import pytest

from asyncrl.config.schema import BufferConfig, ZmqBufferConfig
from buffers.protocol import Batch
from buffers.zmq_broker import start_broker_thread
from buffers.zmq_client import ZmqBufferClient
from tests.unit.test_zmq_buffer import make_group

pytestmark = pytest.mark.timeout(60)

GPS, STALENESS = 2, 1
CONFIG = BufferConfig(zmq=ZmqBufferConfig(port=0, spill_path=""), max_staleness=STALENESS)


def _held_at_version_3() -> tuple[Batch, Batch]:
    """A first broker: the learner reached version 3 and holds the batches of steps 4 and 5
    when the broker dies. Returns them (their receipts name this broker's epoch)."""
    address, stop = start_broker_thread(CONFIG, GPS)
    try:
        with ZmqBufferClient(address, timeout_s=5) as c:
            for version in range(5):
                assert c.acquire("w", GPS, version).granted == GPS
                for i in range(GPS):
                    assert c.put("w", make_group(f"v{version}-{i}", version=version)).accepted
                if version < 3:
                    c.ack("learner", c.get_batch("learner", GPS, version, timeout_s=5.0),
                          consumed=(version + 1) * GPS)
                    c.publish_version(version + 1)
            training = c.get_batch("learner", GPS, 3, timeout_s=5.0)
            prefetched = c.get_batch("learner", GPS, 3, timeout_s=5.0)
            assert c.status()["consumed"] == 3 * GPS
    finally:
        stop()
    return training, prefetched


def _assert_counts(c: ZmqBufferClient, version: int, consumed: int) -> None:
    status = c.status()
    assert (status["version"], status["accepted"], status["consumed"]) == \
        (version, consumed, consumed)
    # what an uninterrupted broker admits: (V + s + 1) × gps − accepted
    assert status["gate_allowance"] == (version + STALENESS + 1) * GPS - consumed


@pytest.mark.parametrize("ack_first", [True, False], ids=["ack-then-version",
                                                          "version-then-ack"])
def test_acks_of_the_old_epoch_carry_the_learners_progress_over(ack_first):
    training, prefetched = _held_at_version_3()
    address, stop = start_broker_thread(CONFIG, GPS)  # no spill: it knows nothing
    try:
        with ZmqBufferClient(address, timeout_s=5) as c:
            if ack_first:
                c.ack("learner", training, consumed=4 * GPS)
                c.publish_version(4)
            else:  # the version's weight sync finished before the step's ack went out
                c.publish_version(4)
                c.ack("learner", training, consumed=4 * GPS)
            _assert_counts(c, 4, 4 * GPS)
            # The prefetched batch trains next: its groups are counted when it is acked,
            # which the version seed alone never did (one step short for the whole run).
            c.ack("learner", prefetched, consumed=5 * GPS)
            c.ack("learner", prefetched, consumed=5 * GPS)  # a re-sent ack: idempotent
            c.publish_version(5)
            _assert_counts(c, 5, 5 * GPS)
            assert c.status()["acks_unknown"] == 3 * GPS  # not served here: only counted
            assert c.acquire("w", 100, 5).granted == (5 + STALENESS + 1) * GPS - 5 * GPS
    finally:
        stop()


def test_an_old_epoch_ack_without_a_count_changes_no_counter():
    """Clients that do not send their count (and ``get_batch(ack=...)``) keep the version
    seed: the receipts are only counted as unknown."""
    training, _ = _held_at_version_3()
    address, stop = start_broker_thread(CONFIG, GPS)
    try:
        with ZmqBufferClient(address, timeout_s=5) as c:
            c.ack("learner", training)
            status = c.status()
            assert (status["accepted"], status["consumed"], status["acks_unknown"]) == \
                (0, 0, GPS)
    finally:
        stop()


def test_own_epoch_acks_ignore_the_count():
    """A broker that lived through the run trusts its own counters: a count in an ack of its
    own receipts (a learner resumed from an older checkpoint, say) moves nothing."""
    address, stop = start_broker_thread(CONFIG, GPS)
    try:
        with ZmqBufferClient(address, timeout_s=5) as c:
            assert c.acquire("w", GPS, 0).granted == GPS
            for i in range(GPS):
                assert c.put("w", make_group(f"g{i}")).accepted
            c.ack("learner", c.get_batch("learner", GPS, 0, timeout_s=5.0), consumed=40)
            assert c.status()["consumed"] == GPS
    finally:
        stop()
