"""The run's token and the member handshake (issue 37): with ``buffer.zmq.auth = "none"`` one
``shutdown`` from any local process stopped the broker, and garbage puts registered phantom
producers. Now the commands that change the run need the run's token, and only the handshake
(``hello``, a heartbeat) makes a member.
"""

from __future__ import annotations

import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path

import orjson
import pytest
import zmq as pyzmq

from asyncrl.config.load import to_toml
from asyncrl.config.schema import BufferConfig, Config, LearnerConfig, RunConfig, ZmqBufferConfig
from asyncrl.launch.run_dir import write_run_dir
from buffers import connect_buffer
from buffers.protocol import DONE, RUN_STATUS_KEY
from buffers.run_token import TOKEN_ENV, ensure_token, read_token, token_path
from buffers.zmq_client import ZmqBufferClient
from buffers.zmq_protocol import BrokerError
from tests.buffers import eventually, make_group
from tests.buffers.conftest import ROOT, child_env, free_port


def test_run_changing_commands_need_the_token_even_without_auth(zmq):
    """``shutdown``, the learner's version, a progress take-over and the run's status, sent
    without the token or with a wrong one: refused, counted, logged naming the command, and
    nothing changed. With the run's token the broker stops."""
    d = zmq.start(groups_per_step=2)
    assert d.config.zmq.auth == "none"
    anonymous = ZmqBufferClient(d.address, timeout_s=5)
    forger = ZmqBufferClient(d.address, timeout_s=5, token="0" * 32)
    try:
        for client, what in ((anonymous, "without the run token"),
                             (forger, "with a wrong run token")):
            with pytest.raises(BrokerError, match=f"'shutdown' {what} refused"):
                client.shutdown()
            with pytest.raises(BrokerError, match=f"'publish_version' {what}"):
                client.publish_version(7)
            with pytest.raises(BrokerError, match=f"'restore_progress' {what}"):
                client.restore_progress(7, 14)
            with pytest.raises(BrokerError, match=f"'set_key' {what}"):
                client.set_key(RUN_STATUS_KEY, {"status": DONE})
        assert anonymous.set_key("weights/announce", {"epoch": 0}) > 0  # not the run's
        status = anonymous.status()
        assert (status["version"], status["run_status"]) == (0, "running")
        assert status["bad_requests"] == {"token": 8}
        log = (d.server.directory / "broker.log").read_text()
        assert "'shutdown' without the run token refused" in log
        assert "'shutdown' with a wrong run token refused" in log
        owner = d.client()  # the run's token, as the roles `up` starts get it
        owner.publish_version(1)
        owner.shutdown()
        assert d.server.proc.wait(timeout=20) == 0
    finally:
        anonymous.close()
        forger.close()


def _raw_request(address: str, command: bytes, args: dict) -> tuple[bytes, dict]:
    context = pyzmq.Context()
    socket = context.socket(pyzmq.DEALER)
    socket.setsockopt(pyzmq.LINGER, 0)
    try:
        socket.connect(address)
        socket.send_multipart([b"1", command, orjson.dumps(args), b"garbage"])
        assert socket.poll(10_000), f"no reply to {command!r}"
        _, status, body, *_ = socket.recv_multipart()
        return status, orjson.loads(body)
    finally:
        socket.close()
        context.term()


def test_a_garbage_put_registers_no_member(zmq):
    """A put (or an acquire) from a name that never said hello is refused whole: no member,
    no group rejection counted, no slot; a producer through the handshake is served."""
    d = zmq.start(groups_per_step=2)
    for command in (b"put", b"put_many", b"acquire"):
        status, body = _raw_request(d.address, command, {"producer": "phantom", "want": 1,
                                                         "engine_version": 0})
        assert status == b"err" and body["reason"] == "unregistered", body
    c = d.client()
    status = c.status()
    assert status["members"] == {} and status["rejected"] == {}
    assert status["bad_requests"] == {"unregistered": 3}
    assert c.put("worker", make_group("g")).accepted  # hello, then the put
    assert list(c.status()["members"]) == ["worker"]


def test_the_token_file_is_private_and_one_per_run_dir(tmp_path, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert read_token(tmp_path) is None
    tokens: list[str] = []
    racers = [threading.Thread(target=lambda: tokens.append(ensure_token(tmp_path)))
              for _ in range(4)]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join()
    assert len(set(tokens)) == 1 and len(tokens[0]) == 32
    assert stat.S_IMODE(token_path(tmp_path).stat().st_mode) == 0o600
    assert read_token(tmp_path) == tokens[0]
    assert [p.name for p in tmp_path.iterdir()] == ["buffer.token"]  # no temporary left
    monkeypatch.setenv(TOKEN_ENV, "from-up")  # what `up` gives the roles it starts
    assert read_token(tmp_path) == ensure_token(tmp_path) == "from-up"


def test_up_writes_the_token_with_the_run_dir_and_keeps_it(tmp_path, monkeypatch):
    """`asyncrl up` (either launcher) writes it with the run directory; a role started by hand
    from the run directory reads it there; a new run of the name keeps it."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    cfg = Config(run=RunConfig(name="tok", output_dir=tmp_path))
    write_run_dir(cfg)
    token = read_token(cfg.run_dir)
    assert token and stat.S_IMODE(token_path(cfg.run_dir).stat().st_mode) == 0o600
    write_run_dir(cfg)
    assert read_token(cfg.run_dir) == token


def test_a_role_started_by_hand_reads_the_brokers_token(tmp_path: Path, monkeypatch):
    """`asyncrl buffer` started without `up` writes the token in its run directory, and a
    client opened as every role opens it (``connect_buffer``) carries it."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    cfg = Config(run=RunConfig(name="byhand", output_dir=tmp_path),
                 buffer=BufferConfig(zmq=ZmqBufferConfig(port=free_port(), spill_path="")),
                 learner=LearnerConfig(groups_per_step=2))
    (tmp_path / "c.toml").write_text(to_toml(cfg))
    env = {k: v for k, v in child_env().items() if k != TOKEN_ENV}
    broker = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "buffer",
                               str(tmp_path / "c.toml")], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        eventually(lambda: token_path(cfg.run_dir).exists(), 20, "the broker's token file")
        client = connect_buffer(cfg, f"tcp://127.0.0.1:{cfg.buffer.zmq.port}")
        try:
            client.publish_version(1)  # refused without the token
            assert client.status()["version"] == 1
        finally:
            client.close()
    finally:
        broker.send_signal(signal.SIGTERM)
        broker.wait(timeout=20)
