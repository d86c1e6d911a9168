"""A learner or rollout role pointed at an address where no broker listens says so at once and
every few seconds, stops within a second on SIGTERM, and goes on once a broker is there: real
`asyncrl learner|rollout|buffer` processes on a free port. Before, they waited out the first
request's 30 s timeout and its retries in silence, and a signal was seen only after them."""

from __future__ import annotations

import signal
import socket
import time

import pytest

from asyncrl.launch.roles import BROKER_WAIT_LOG_S
from tests.integration.conftest import QUICKSTART, Processes, wait_for

FIRST_LINE_S = 10.0  # interpreter start and config load included, on a busy 2-core machine
STOP_S = 3.0


def free_address() -> tuple[str, int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"tcp://127.0.0.1:{port}", port


def start_role(processes: Processes, role: str, address: str, tmp_path) -> float:
    """Start ``role`` against ``address``; returns when it started (monotonic)."""
    extra = ["--workers", "1"] if role == "rollout" else []
    start = time.monotonic()
    processes.start(role, role, str(QUICKSTART), "--buffer", address, *extra,
                    "--set", f"run.output_dir={tmp_path}", "--set", "run.name=nobroker")
    return start


def waiting_lines(processes: Processes, role: str, address: str) -> int:
    return processes.log(role).count(f"waiting for the buffer at {address} ")


@pytest.mark.parametrize("role", ["learner", "rollout"])
def test_a_role_without_a_broker_says_so_and_stops_on_sigterm(
        role: str, processes: Processes, tmp_path) -> None:
    address, _ = free_address()
    start = start_role(processes, role, address, tmp_path)
    wait_for(lambda: waiting_lines(processes, role, address) >= 1, FIRST_LINE_S,
             f"the {role}'s first waiting line")
    assert time.monotonic() - start < FIRST_LINE_S
    line = next(ln for ln in processes.log(role).splitlines() if "waiting for the buffer" in ln)
    assert "Is `asyncrl buffer` running there?" in line and "--buffer" in line, line
    assert "buffer.zmq.host / buffer.zmq.port" in line, line
    # progress: it keeps saying so while it waits
    wait_for(lambda: waiting_lines(processes, role, address) >= 2, BROKER_WAIT_LOG_S + 5,
             f"the {role}'s second waiting line")
    proc = processes.procs[-1]
    assert proc.poll() is None, processes.log(role)
    stopped = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert processes.wait(proc, 30) == 0, processes.log(role)
    assert time.monotonic() - stopped < STOP_S, processes.log(role)
    log = processes.log(role)
    assert f"stopped while waiting for the buffer at {address}" in log
    assert "Traceback" not in log and "no reply" not in log, log


def test_a_waiting_learner_goes_on_when_the_broker_starts(processes: Processes,
                                                          tmp_path) -> None:
    address, port = free_address()
    start_role(processes, "learner", address, tmp_path)
    wait_for(lambda: waiting_lines(processes, "learner", address) >= 1, FIRST_LINE_S,
             "the learner's waiting line")
    processes.start("buffer", "buffer", str(QUICKSTART), "--set", f"buffer.zmq.port={port}",
                    "--set", f"run.output_dir={tmp_path}", "--set", "run.name=nobroker")
    wait_for(lambda: f"buffer at {address} accepts connections" in processes.log("learner"),
             30, "the learner to find the broker")
