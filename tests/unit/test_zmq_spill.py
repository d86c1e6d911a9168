"""The ZMQ broker's spill file: a restart (clean or SIGKILL) loses nothing accepted and unacked."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from asyncrl.config.schema import BufferConfig, ZmqBufferConfig
from asyncrl.wire import encode_group
from buffers.run_token import TOKEN_ENV, read_token
from buffers.zmq_broker import start_broker_thread
from buffers.zmq_client import ZmqBufferClient
from buffers.zmq_protocol import pack_group
from buffers.zmq_replay import open_spill, snapshot_of
from buffers.zmq_spill import MAGIC, MAGIC_V1, SpillError, SpillLog, crc_of, open_locked, write_all
from buffers.zmq_state import BrokerState
from tests.unit.test_zmq_buffer import eventually, make_group

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


def _fill_and_half_consume(c: ZmqBufferClient) -> tuple[list[str], int]:
    """Put g0..g5; g0, g1 delivered and never acked; g2, g3 acked; set key ``rdzv``.
    Returns the unacked and the key's sequence number."""
    for i in range(6):
        assert c.put("w", make_group(f"g{i}")).accepted
    assert c.get_batch("dying", 2, 0, timeout_s=1.0) is not None  # never acked
    done = c.get_batch("learner", 2, 0, timeout_s=1.0)
    c.ack("learner", done)
    c.publish_version(1)
    return ["g0", "g1", "g4", "g5"], c.set_key("rdzv", {"epoch": 3})


def _assert_restored(c: ZmqBufferClient, unacked: list[str], key_seq: int) -> None:
    """The groups delivered to "dying" come back delivered (it may still be training on them),
    and are redelivered only when it has not acked them within ``reclaim_idle_s`` (1 s)."""
    status = c.status()
    assert (status["version"], status["accepted"], status["consumed"]) == (1, 6, 2)
    assert status["staleness_hist"] == {"0": 2} and status["depth"] == len(unacked)
    assert (status["queued"], status["pending"]) == (len(unacked) - 2, 2)
    assert c.get_key("rdzv") == (key_seq, {"epoch": 3})  # a waiter's newer_than stays valid
    queued = c.get_batch("learner", 2, 1, timeout_s=1.0)
    assert [g.group_id for g in queued.groups] == unacked[2:]
    reclaimed = c.get_batch("learner", 2, 1, timeout_s=10.0)
    assert [g.group_id for g in reclaimed.groups] == unacked[:2]  # each exactly once
    c.ack("learner", queued)
    c.ack("learner", reclaimed)
    assert c.get_batch("learner", 1, 1, timeout_s=0.0) is None
    assert c.status()["consumed"] == 2 + len(unacked)


def test_clean_restart_restores_unacked_groups_version_counters_and_keys(tmp_path):
    config = BufferConfig(zmq=ZmqBufferConfig(port=0, spill_path=str(tmp_path / "spill.log")),
                          max_staleness=1, reclaim_idle_s=1.0)
    address, stop = start_broker_thread(config, groups_per_step=8)
    with ZmqBufferClient(address, timeout_s=5) as c:
        unacked, key_seq = _fill_and_half_consume(c)
        keys_before = c.status()["keys"]
    stop()
    address, stop = start_broker_thread(config, groups_per_step=8)
    try:
        with ZmqBufferClient(address, timeout_s=5) as c:
            assert c.status()["keys"] == keys_before
            _assert_restored(c, unacked, key_seq)
    finally:
        stop()


def test_a_learner_that_outlives_the_broker_can_still_ack(tmp_path):
    config = BufferConfig(zmq=ZmqBufferConfig(port=0, spill_path=str(tmp_path / "spill.log")))
    address, stop = start_broker_thread(config, groups_per_step=8)
    with ZmqBufferClient(address, timeout_s=5) as c:
        for name in "abc":
            c.put("w", make_group(name))
        training = c.get_batch("learner", 2, 0, timeout_s=1.0)
    stop()
    address, stop = start_broker_thread(config, groups_per_step=8)
    try:
        with ZmqBufferClient(address, timeout_s=5) as c:
            c.ack("learner", training)  # receipts name the spill's epoch: still valid
            batch = c.get_batch("learner", 1, 0, timeout_s=1.0)
            assert [g.group_id for g in batch.groups] == ["c"]
            assert c.status()["consumed"] == 2
    finally:
        stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def broker_process(tmp_path, monkeypatch) -> Iterator:
    """``start()`` runs ``asyncrl buffer`` as a subprocess on one fixed port and spill file,
    with the run's token in its environment, as `asyncrl up` starts it (``read_token`` then
    gives the test's clients the same)."""
    monkeypatch.setenv(TOKEN_ENV, secrets.token_hex(16))
    port, procs = _free_port(), []
    config = tmp_path / "buffer.toml"
    config.write_text(f"[buffer]\nport = {port}\nmax_staleness = 1\nreclaim_idle_s = 1.0\n"
                      f"[learner]\ngroups_per_step = 8\n")
    spill = tmp_path / "spill.log"

    def start() -> tuple[str, subprocess.Popen]:
        address_file = tmp_path / f"addr-{len(procs)}"
        env = dict(os.environ, PYTHONPATH=str(ROOT), ASYNCRL_LOG_LEVEL="WARNING")
        log = (tmp_path / f"broker-{len(procs)}.log").open("wb")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "asyncrl.cli", "buffer", str(config),
             "--set", f"buffer.zmq.spill_path={spill}", "--address-file", str(address_file)],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
        eventually(address_file.exists, timeout_s=30)
        return address_file.read_text().strip(), procs[-1]

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def test_sigkilled_broker_process_loses_nothing_acknowledged(broker_process):
    address, first = broker_process()
    with ZmqBufferClient(address, timeout_s=5, token=read_token(Path())) as c:
        unacked, key_seq = _fill_and_half_consume(c)
        assert c.status()["depth"] == 4  # every request was answered: all is in the spill
    first.send_signal(signal.SIGKILL)
    assert first.wait(timeout=10) == -signal.SIGKILL
    assert broker_process()[0] == address  # same port: the clients just reconnect
    with ZmqBufferClient(address, timeout_s=10) as c:
        _assert_restored(c, unacked, key_seq)


def test_a_request_parked_in_a_sigkilled_broker_is_sent_again_at_once(broker_process):
    """A broker that dies takes the requests it parked with it; the client hears its
    connection drop and re-sends at once to the broker restarted at the same address, instead
    of after its whole timeout (30 s by default: a run stood still that long after every
    broker restart)."""
    address, first = broker_process()
    with ZmqBufferClient(address, timeout_s=30, reconnect_s=60) as waiter, \
            ZmqBufferClient(address, timeout_s=5) as watcher, ThreadPoolExecutor(1) as pool:
        parked = pool.submit(waiter.get_key, "weights/announce", 0, 60.0)
        eventually(lambda: watcher.status()["waiting"]["get_key"] == 1)  # in the first broker
        first.send_signal(signal.SIGKILL)
        assert first.wait(timeout=10) == -signal.SIGKILL
        assert broker_process()[0] == address
        with ZmqBufferClient(address, timeout_s=5) as setter:
            seq = setter.set_key("weights/announce", {"epoch": 1})
        assert parked.result(timeout=10) == (seq, {"epoch": 1})


def test_a_connection_dropped_while_idle_does_not_fail_the_next_put(broker_process):
    """Only a drop while a request waits loses its reply: a client idle while its broker was
    restarted puts into the new one (the DEALER reconnects by itself)."""
    address, first = broker_process()
    with ZmqBufferClient(address, timeout_s=10) as c:
        c.heartbeat("w", "rollout", {})
        first.send_signal(signal.SIGKILL)
        assert first.wait(timeout=10) == -signal.SIGKILL
        # idle while the broker is down, until the client's monitor has heard the drop (it
        # must be heard before the next request is sent: a drop heard while a request waits
        # loses that request's reply, which is another test's subject)
        eventually(lambda: c._link.monitor.poll(0))
        broker_process()
        assert c.put("w", make_group("after")).accepted
        assert c.put_many("w", [make_group("many")])[0].accepted


def _state(path: Path, holding: str = "", **kwargs) -> BrokerState:
    """A broker state journaling to ``path`` (replayed), then one group put per letter of
    ``holding``."""
    log, recovered = open_spill(path, **kwargs)
    state = BrokerState(BufferConfig(max_staleness=1), 4, journal=log, recovered=recovered)
    for name in holding:
        _put(state, name)
    return state


def _put(state: BrokerState, name: str, version: int = 0) -> None:
    group = state.check("w", [pack_group(encode_group(make_group(name, version)))])
    assert not isinstance(group, str) and state.accept("w", group) == ""


def test_torn_tail_is_ignored_and_truncated(tmp_path):
    path = tmp_path / "spill.log"
    state = _state(path, holding="abc")
    state.journal.close()
    with path.open("r+b") as f:  # a crash in the middle of writing c's record
        f.truncate(path.stat().st_size - 7)
    state = _state(path)
    assert [g.seq for g in state.queue] == [1, 2] and state.accepted == 2
    _put(state, "d")  # appends after the last good record, not after the garbage
    state.journal.close()
    state = _state(path)
    assert [g.seq for g in state.queue] == [1, 2, 3] and state.accepted == 3
    state.journal.close()


def test_corrupt_record_stops_replay_there(tmp_path):
    path = tmp_path / "spill.log"
    state = _state(path, holding="ab")
    state.journal.close()
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # flipped bits in b's record: its checksum no longer matches
    path.write_bytes(bytes(data))
    state = _state(path)
    assert [g.seq for g in state.queue] == [1]
    state.journal.close()


def test_compaction_rewrites_live_records_and_keeps_content(tmp_path):
    path = tmp_path / "spill.log"
    state = _state(path, compact_min_bytes=4096)
    key_seq = state.set_key("rdzv", {"n": 1})
    for version in (1, 2):  # one by one: version 2 alone, nothing consumed, means a lost state
        state.publish_version(version)
    for i in range(40):
        _put(state, f"g{i}", version=2)
    state.take("slow", 1, 2)  # delivered while compactions rewrite the file, never acked
    for _ in range(7):
        batch = state.take("l", 5, 2)
        state.ack("l", [state.receipt(g) for g in batch])
    assert state.journal.compactions >= 1
    assert state.journal.file_bytes < 2 * state.journal.live_bytes + 4096
    state.publish_version(3)
    state.take("l", 2, 3)  # delivered, unacked: still live
    state.journal.close()
    state = _state(path)
    assert [g.seq for g in state.queue] == [39, 40]
    assert {seq: (g.consumer, g.delivered_staleness) for seq, g in state.pending.items()} == {
        1: ("slow", 0), 37: ("l", 1), 38: ("l", 1)}  # awaiting acks, as before the restart
    assert (state.version, state.accepted, state.consumed) == (3, 40, 35)
    assert state.keys.get("rdzv") == (key_seq, {"n": 1}) and state.staleness_hist == {0: 35}
    state.ack("l", [f"{state.epoch}:37", f"{state.epoch}:38"])
    assert state.staleness_hist == {0: 35, 1: 2} and state.take("l", 2, 3) is not None
    state.journal.close()


def test_a_reclaimed_delivery_is_replayed_queued(tmp_path):
    path = tmp_path / "spill.log"
    state = _state(path, holding="ab")
    state.take("dead", 2, 0)
    state.config = BufferConfig(max_staleness=1, reclaim_idle_s=1e-9)
    assert state.reclaim() == 2
    state.journal.close()
    state = _state(path)
    assert ([g.seq for g in state.queue], list(state.pending)) == ([1, 2], [])
    state.journal.close()


def test_stale_drops_are_journaled_and_never_come_back(tmp_path):
    path = tmp_path / "spill.log"
    state = _state(path)
    _put(state, "old", version=0)
    _put(state, "new", version=5)
    state.publish_version(5)
    assert [g.seq for g in state.take("l", 1, 5)] == [2]
    state.journal.close()
    state = _state(path)
    assert (state.dropped_stale, list(state.queue), list(state.pending)) == (1, [], [2])
    state.journal.close()


def test_a_foreign_or_busy_file_is_refused(tmp_path):
    foreign = tmp_path / "notes.txt"
    foreign.write_text("precious")
    with pytest.raises(SpillError, match="not an asyncrl spill"):
        open_spill(foreign)
    path = tmp_path / "spill.log"
    log, _ = open_spill(path)
    with pytest.raises(SpillError, match="in use"):
        open_spill(path)
    log.close()
    assert path.read_bytes().startswith(MAGIC)


def test_a_v1_file_is_replayed_appended_as_v1_and_compacted_to_v2(tmp_path):
    """Files of the CRC-32 format still restore; appends keep the file's own checksum (a mixed
    file would stop replay at the first new record); compaction rewrites it as v2."""
    path = tmp_path / "spill.log"
    fd = open_locked(path, os.O_CREAT)  # written exactly as the v1 code wrote it
    write_all(fd, [MAGIC_V1])
    state = BrokerState(BufferConfig(max_staleness=1), 4,
                        journal=SpillLog(path, fd, checksum=crc_of))
    for name in "ab":
        _put(state, name)
    state.journal.close()
    state = _state(path)
    assert [g.seq for g in state.queue] == [1, 2] and state.journal.checksum is crc_of
    _put(state, "c")
    state.journal.close()
    assert path.read_bytes().startswith(MAGIC_V1)
    state = _state(path)
    assert [g.seq for g in state.queue] == [1, 2, 3]
    state.journal.compact(snapshot_of(state), [],
                          [(g.seq, g.min_version, g.frames) for g in state.queue])
    _put(state, "d")
    state.journal.close()
    assert path.read_bytes().startswith(MAGIC)
    state = _state(path)
    assert [g.seq for g in state.queue] == [1, 2, 3, 4] and state.accepted == 4
    state.journal.close()


def test_fsync_runs_on_its_own_thread_and_its_errors_reach_the_broker(tmp_path, monkeypatch):
    """The broker's thread only asks for the batched fsync; a failed one is raised on the
    broker's next call; close syncs on the caller's thread."""
    real_fsync, synced, fail = os.fsync, [], threading.Event()

    def fsync(fd: int) -> None:
        synced.append(threading.current_thread().name)
        if fail.is_set() and threading.current_thread().name == "spill-fsync":
            raise OSError(5, "Input/output error")
        real_fsync(fd)

    state = _state(tmp_path / "spill.log")
    monkeypatch.setattr(os, "fsync", fsync)
    log = state.journal
    _put(state, "a")
    log._synced_at -= 1.0  # due
    log.sync_if_due()
    eventually(lambda: synced == ["spill-fsync"])
    fail.set()
    _put(state, "b")
    log._synced_at -= 1.0
    log.sync_if_due()
    eventually(lambda: log._sync_error is not None)
    with pytest.raises(OSError, match="Input/output"):
        log.sync_if_due()
    log.sync_if_due()  # raised once, not forever
    log.close()
    assert synced[-1] == threading.current_thread().name
