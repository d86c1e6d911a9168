"""The ZMQ broker's spill file when the disk fails: compaction, full disks, I/O errors.

Failures are injected into the real file operations of :mod:`buffers.zmq_spill` (a wrapped
``write_all`` or ``_fsync_dir``, a lock held on a file), never into the sockets.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from asyncrl.config.schema import BufferConfig, ZmqBufferConfig
from asyncrl.wire import encode_group
from buffers import PutResult, zmq_spill
from buffers.zmq_broker import ZmqBroker
from buffers.zmq_client import ZmqBufferClient
from buffers.zmq_protocol import BrokerError, pack_group
from buffers.zmq_replay import open_spill
from buffers.zmq_spill import HEADER, PUT
from buffers.zmq_state import BrokerState
from tests.buffers import eventually, make_group

pytestmark = pytest.mark.timeout(60)


def _state(path: Path, **config) -> BrokerState:
    """A broker state journaling to ``path`` (replayed), compacting past 2 KiB."""
    log, recovered = open_spill(path, compact_min_bytes=2048)
    return BrokerState(BufferConfig(**{"max_staleness": 100, **config}), 2, journal=log,
                       recovered=recovered)


def _put(state: BrokerState, name: str) -> str:
    group = state.check("w", [pack_group(encode_group(make_group(name)))])
    assert not isinstance(group, str)
    return state.accept("w", group)


def _consume_until_compacted(state: BrokerState) -> None:
    for i in range(40):
        assert _put(state, f"c{i}") == ""
        batch = state.take("l", 1, 0)
        state.ack("l", [state.receipt(g) for g in batch])
        if state.journal.compactions:
            return
    raise AssertionError("never compacted")


def _open_fds_to(path: Path) -> list[str]:
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the listing's own fd, closed meanwhile
            pass
    return [link for link in links if link.startswith(str(path))]


def test_a_failed_directory_sync_after_the_rename_still_appends_to_the_new_file(
        tmp_path, monkeypatch):
    """The rename is done when the directory sync fails: the broker must go on appending to
    the renamed file, not to the old one it replaced (unlinked: lost at the next restart)."""
    path = tmp_path / "spill"
    state = _state(path)
    for i in range(5):
        assert _put(state, f"kept{i}") == ""

    def dir_sync_fails(directory: Path) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(zmq_spill, "_fsync_dir", dir_sync_fails)
    _consume_until_compacted(state)  # raises nothing out of the ack
    for i in range(3):
        assert _put(state, f"late{i}") == ""
    assert _open_fds_to(path) == [str(path)]  # neither the old file's fd nor a leaked one
    live = sorted(g.seq for g in state.queue)
    state.journal.close()
    state = _state(path)
    assert sorted(g.seq for g in state.queue) == live and len(live) == 8
    state.journal.close()


def test_a_compaction_that_cannot_open_its_file_keeps_the_old_one(tmp_path, caplog):
    """``<path>.compact`` locked by someone else: the compaction fails like a full disk
    (logged, the file kept, nothing raised), and a later one succeeds."""
    path = tmp_path / "spill"
    state = _state(path)
    blocker = os.open(tmp_path / "spill.compact", os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(blocker, fcntl.LOCK_EX)
    for i in range(30):
        assert _put(state, f"g{i}") == ""
        state.ack("l", [state.receipt(g) for g in state.take("l", 1, 0)])
    assert state.journal.compactions == 0 and "compaction failed" in caplog.text
    os.close(blocker)
    _consume_until_compacted(state)
    state.journal.close()
    assert _state(path).accepted == state.accepted


class Disk:
    """``zmq_spill.write_all`` failing with ENOSPC the records whose type ``refuse`` picks."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.refuse: Callable[[int], bool] = lambda kind: False
        self._write_all = zmq_spill.write_all
        monkeypatch.setattr(zmq_spill, "write_all", self.write_all)

    def write_all(self, fd: int, parts: list[Any]) -> int:
        head = memoryview(parts[0]).cast("B")  # a record's header ends with its type
        if head.nbytes >= HEADER.size and self.refuse(head[HEADER.size - 1]):
            raise OSError(errno.ENOSPC, "No space left on device")
        return self._write_all(fd, parts)


class Served:
    """A broker journaling to ``spill`` served on a thread; ``died``: what serve() raised."""

    def __init__(self, spill: Path, **config: Any) -> None:
        self.broker = ZmqBroker(BufferConfig(zmq=ZmqBufferConfig(port=0, spill_path=str(spill)),
                                             **config), 2)
        self.address = self.broker.bind()
        self.died: list[BaseException] = []
        self.clients: list[ZmqBufferClient] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            self.broker.serve(self.stop)
        except BaseException as exc:  # noqa: BLE001 - what the test asserts on
            self.died.append(exc)

    def client(self) -> ZmqBufferClient:
        """A client, closed with the broker: one left to the garbage collector hung a later
        test's thread in pyzmq (see ``buffers.zmq_client._Link``)."""
        self.clients.append(ZmqBufferClient(self.address, timeout_s=20.0))
        return self.clients[-1]

    def close(self) -> None:
        if self.stop.is_set():
            return
        for client in self.clients:
            client.close()
        self.stop.set()
        self.thread.join()
        self.broker.close()


@pytest.fixture
def serve(tmp_path) -> Iterator[Callable[..., Served]]:
    started: list[Served] = []

    def start(**config: Any) -> Served:
        started.append(Served(tmp_path / "spill", **config))
        return started[-1]

    yield start
    for served in started:
        served.close()


def test_a_put_the_disk_cannot_take_is_refused_alone_and_the_broker_goes_on(serve,
                                                                          monkeypatch):
    """A parked put admitted when an ack makes room, and one group of a put_many: each is
    refused ("spill", counted) on its own; the ack and the other groups are answered as they
    went, and the broker serves on."""
    disk, served = Disk(monkeypatch), serve(max_groups=2)
    c, producer = served.client(), served.client()
    for i in range(2):
        c.acquire("w", 1, 0)
        assert c.put("w", make_group(f"g{i}")).accepted
    batch = c.get_batch("l", 2, 0, timeout_s=5.0)
    producer.acquire("p", 1, 0)
    with ThreadPoolExecutor(1) as pool:
        parked = pool.submit(producer.put, "p", make_group("parked"))
        eventually(lambda: c.status()["waiting"]["put"] == 1)
        disk.refuse = lambda kind: kind == PUT
        c.ack("l", batch)  # room: the parked put is admitted from here, and refused
        assert parked.result(timeout=10) == PutResult(accepted=False, reason="spill")
    fails = iter([False, True, False])
    disk.refuse = lambda kind: kind == PUT and next(fails)
    producer.acquire("p", 3, 0)
    assert producer.put_many("p", [make_group(n) for n in "abc"]) == [
        PutResult(True), PutResult(False, "spill"), PutResult(True)]
    status = c.status()
    assert status["rejected"] == {"spill": 2} and status["accepted"] == 4
    assert (status["depth"], status["in_flight"], status["consumed"]) == (2, 0, 2)
    assert served.thread.is_alive() and not served.died


def test_records_other_than_puts_that_fail_are_counted_and_the_broker_goes_on(serve,
                                                                              monkeypatch):
    """Deliveries, acks, a reclaim and the stale drops it brings (in the broker's
    housekeeping), versions and keys, none journaled: each change is made in memory all the
    same and counted in ``write_errors``; a restart replays what was written (the puts)."""
    disk, served = Disk(monkeypatch), serve(max_groups=4, max_staleness=1, reclaim_idle_s=0.5)
    c, learner = served.client(), served.client()
    for i in range(3):
        assert c.put("w", make_group(f"g{i}")).accepted
    disk.refuse = lambda kind: kind != PUT
    c.ack("l", c.get_batch("l", 1, 0, timeout_s=5.0))
    assert c.get_batch("dead", 1, 0, timeout_s=5.0) is not None  # never acked: reclaimed
    c.publish_version(2)
    key_seq = c.set_key("k", {"n": 1})
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(learner.get_batch, "l", 1, 2, 10.0)  # drops g2 on arrival
        eventually(lambda: c.status()["redelivered"] == 1)  # g1 back, and dropped stale
        assert c.put("w", make_group("fresh", version=2)).accepted
        assert [g.group_id for g in waiting.result(timeout=10).groups] == ["fresh"]
    status = c.status()
    assert (status["consumed"], status["dropped_stale"], status["depth"]) == (1, 2, 1)
    assert status["spill"]["write_errors"] >= 7 and status["version"] == 2
    assert c.get_key("k") == (key_seq, {"n": 1})
    assert served.thread.is_alive() and not served.died
    served.close()
    disk.refuse = lambda kind: False
    status = serve().client().status()
    assert (status["accepted"], status["depth"]) == (4, 4)  # at least once: served again


def test_a_failed_fsync_answers_the_parked_requests_before_the_broker_stops(serve,
                                                                           monkeypatch):
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if threading.current_thread().name == "spill-fsync":
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    served = serve()
    c, learner = served.client(), served.client()
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(learner.get_batch, "l", 2, 0, 8.0)
        eventually(lambda: c.status()["waiting"]["get_batch"] == 1)
        c.put("w", make_group("a"))  # a record to sync: the sync fails, serve() raises
        with pytest.raises(BrokerError, match="Input/output"):
            waiting.result(timeout=10)
    eventually(lambda: bool(served.died))
    assert isinstance(served.died[0], OSError)
