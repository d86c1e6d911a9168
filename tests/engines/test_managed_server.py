"""ManagedServer with real subprocesses: ``python -m http.server`` as the server (its
``/health`` is a file it serves), a process that exits at once, one that never listens, and one
that ignores SIGTERM. Each test stops only the process it started."""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollouters.engines.managed_server import ManagedServer, free_port

HOST = "127.0.0.1"
IGNORE_TERM = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); "


class StartError(RuntimeError):
    pass


class StartTimeout(StartError, TimeoutError):
    pass


@pytest.fixture
def started() -> Iterator[list[ManagedServer]]:
    """The servers a test started; any left running are stopped after it."""
    servers: list[ManagedServer] = []
    yield servers
    for server in servers:
        server.stop(timeout_s=1.0)


def _launch(started: list[ManagedServer], tmp_path: Path, code: str,
            stop_timeout_s: float = 10.0) -> ManagedServer:
    """``python -c code PORT`` serving ``tmp_path`` (where ``health`` is a JSON file)."""
    (tmp_path / "health").write_text("{}")
    port = free_port(HOST)
    server = ManagedServer("test server", [sys.executable, "-c", code, str(port)],
                           f"http://{HOST}:{port}", tmp_path / "logs" / "server.log",
                           cwd=tmp_path, stop_timeout_s=stop_timeout_s)
    started.append(server)
    return server


def _http_server(prefix: str = "") -> str:
    return (f"{prefix}import runpy, sys; sys.argv = ['http.server', '--bind', '{HOST}', "
            "sys.argv[1]]; runpy.run_module('http.server', run_name='__main__')")


def test_ready_once_health_answers_then_stop_is_idempotent(started, tmp_path: Path) -> None:
    server = _launch(started, tmp_path, _http_server())
    server.wait_ready(30.0, "test.start_timeout_s", StartError, StartTimeout)
    assert server.running
    server.stop()
    assert not server.running
    server.stop()  # already ended: nothing to do, no error
    assert not server.running


def test_exit_before_ready_fails_at_once_with_the_log_tail(started, tmp_path: Path) -> None:
    code = "import sys; print('boom: --bogus-flag unknown', file=sys.stderr); sys.exit(3)"
    server = _launch(started, tmp_path, code)
    with pytest.raises(StartError, match=r"exited with 3 before it was ready") as info:
        server.wait_ready(30.0, "test.start_timeout_s", StartError, StartTimeout)
    assert not isinstance(info.value, StartTimeout)
    assert "boom: --bogus-flag unknown" in str(info.value)
    assert str(server.log_path) in str(info.value)


def test_not_ready_in_time_names_the_key_and_stops_it(started, tmp_path: Path) -> None:
    """Alive but never listening (a server stuck loading): the timeout, not a hang."""
    server = _launch(started, tmp_path, "print('loading...', flush=True); "
                                        "import time; time.sleep(120)")
    with pytest.raises(StartTimeout, match=r"not ready within 1s \(test\.start_timeout_s\)"):
        server.wait_ready(1.0, "test.start_timeout_s", StartError, StartTimeout)
    assert not server.running
    assert "loading..." in server.log_tail()


def test_sigterm_ignored_escalates_to_sigkill(started, tmp_path: Path) -> None:
    server = _launch(started, tmp_path, _http_server(IGNORE_TERM), stop_timeout_s=0.5)
    server.wait_ready(30.0, "test.start_timeout_s")  # the handler is set before it listens
    server.stop()
    assert not server.running
    assert server.returncode == -signal.SIGKILL


def test_a_restart_reports_only_its_own_log_lines(started, tmp_path: Path) -> None:
    """The log is appended to across a worker's restarts; the error shows this run's lines."""
    first = _launch(started, tmp_path, "print('first run'); raise SystemExit(1)")
    with pytest.raises(StartError):
        first.wait_ready(30.0, "test.start_timeout_s", StartError, StartTimeout)
    second = _launch(started, tmp_path, "print('second run'); raise SystemExit(2)")
    with pytest.raises(StartError, match="second run") as info:
        second.wait_ready(30.0, "test.start_timeout_s", StartError, StartTimeout)
    assert "first run" not in str(info.value)
