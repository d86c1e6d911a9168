"""An outage of the buffer is a warning when it starts and one when it ends (issue 37): a Redis
restart paused training for seconds with nothing in any log.

Each test holds two clients of one buffer in this process, as a role does: the one that waits
through the outage reports it, the idle one, whose connection the restart broke too, adds
nothing (one pair of lines per outage, not per retry, not per client).
"""

from __future__ import annotations

import logging
import re
import signal
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from asyncrl.config.schema import BufferConfig, RedisBufferConfig
from buffers import BufferClient, make_buffer_client
from buffers.outage import redacted
from tests.buffers.conftest import RedisServer

LOST = re.compile(r"buffer: lost connection to (\S+) \(retrying\): ")
BACK = re.compile(r"buffer: reconnected to (\S+) after (\d+\.\d) s")


class Lines(logging.Handler):
    """The outage warnings, and an event set at the first "lost" one."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []
        self.lost = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if record.name == "buffers.outage":
            self.lines.append(message)
        if LOST.match(message):
            self.lost.set()


@pytest.fixture
def lines() -> Iterator[Lines]:
    handler = Lines()
    logger = logging.getLogger("buffers.outage")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def _outage(waiter: BufferClient, idle: BufferClient, kill: Callable[[], None],
            start: Callable[[], None], lines: Lines) -> None:
    """Both clients answered; the server killed; ``waiter`` asks (and retries) while it is
    down; the server started again once the outage was reported; then ``idle`` asks too."""
    waiter.heartbeat("waiter", "rollout", {})
    idle.heartbeat("idle", "rollout", {})
    kill()
    with ThreadPoolExecutor(1) as pool:
        asked = pool.submit(waiter.heartbeat, "waiter", "rollout", {})
        assert lines.lost.wait(30), "no warning while the buffer was down"
        start()
        assert asked.result(timeout=60)["run_status"] == "running"
    assert idle.heartbeat("idle", "rollout", {})["run_status"] == "running"


def _one_pair(lines: Lines, address: str) -> float:
    assert len(lines.lines) == 2, lines.lines
    lost, back = LOST.match(lines.lines[0]), BACK.match(lines.lines[1])
    assert lost and back, lines.lines
    assert lost.group(1) == back.group(1) == address
    return float(back.group(2))


def test_a_redis_outage_is_one_warning_and_its_end_another(tmp_path, lines):
    server = RedisServer(tmp_path / "redis")
    server.start()
    config = BufferConfig(type="redis", redis=RedisBufferConfig(url=server.url),
                          request_timeout_s=20.0)
    clients = [make_buffer_client(config, run_id="outage", groups_per_step=1) for _ in range(2)]
    try:
        _outage(*clients, lambda: server.stop(signal.SIGKILL), server.start, lines)
        assert _one_pair(lines, server.url) > 0
    finally:
        for client in clients:
            client.close()
        server.stop(signal.SIGKILL)


def test_a_zmq_broker_outage_is_one_warning_and_its_end_another(zmq, lines):
    d = zmq.start(groups_per_step=1, request_timeout_s=2.0)
    clients: list[Any] = [d.client(), d.client()]
    _outage(*clients, lambda: d.server.stop(signal.SIGKILL), d.server.start, lines)
    assert _one_pair(lines, d.address) > 0


def test_a_password_never_reaches_the_log():
    assert redacted("redis://user:s3cret@host:6379/0") == "redis://user@host:6379/0"
    assert redacted("rediss://:s3cret@host/1") == "rediss://host/1"
    assert redacted("tcp://127.0.0.1:5555") == "tcp://127.0.0.1:5555"
