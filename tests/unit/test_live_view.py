"""The live dashboard on a real pseudo-terminal: log records written while it is shown land
above it and the log handler gets its stream back when it closes. And `asyncrl up`'s line
view, off a terminal: a line for each change in the rollout fleet."""

from __future__ import annotations

import io
import logging
import os
import re
import sys
import threading

from asyncrl.snapshot import History
from asyncrl.monitor import LiveView
from tests.unit.test_dashboard import snapshot


def test_log_records_go_above_the_live_dashboard() -> None:
    master, slave = os.openpty()
    terminal = os.fdopen(slave, "w")
    # A pty holds a few KiB: drain it while the dashboard draws, or its writes block.
    chunks: list[bytes] = []
    reader = threading.Thread(target=_drain, args=(master, chunks), daemon=True)
    reader.start()
    handler = logging.StreamHandler(sys.stderr)
    root = logging.getLogger()
    root.addHandler(handler)
    original = handler.stream
    try:
        status, _ = snapshot()
        view = LiveView(terminal, History())
        view.show(status)
        assert handler.stream is not original  # rerouted through rich while live
        logging.getLogger("asyncrl.test").warning("status: the buffer did not answer")
        view.show(status)
        view.close()
        assert handler.stream is original
        terminal.flush()
    finally:
        root.removeHandler(handler)
        terminal.close()  # the reader sees EOF (EIO) once the slave side is closed
        reader.join(timeout=10)
        os.close(master)
    raw = b"".join(chunks).decode(errors="replace")
    screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", raw)  # colours and cursor moves
    assert "status: the buffer did not answer" in screen
    assert screen.index("status: the buffer did not answer") < screen.rindex("learner v43")


def _drain(master: int, chunks: list[bytes]) -> None:
    while True:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:  # EIO: the slave side closed
            return
        if not chunk:
            return
        chunks.append(chunk)


def _status(version: int, **members: tuple[bool, dict]) -> dict:
    return {"version": version, "members": {
        "learner-0": {"role": "learner", "alive": True, "info": {}},
        **{name: {"role": "rollout", "alive": alive, "info": info, "last_seen_s_ago": 16.0}
           for name, (alive, info) in members.items()}}}


def test_up_prints_a_line_for_each_change_in_the_rollout_fleet() -> None:
    """A worker its role restarted is named on `asyncrl up`'s console (crash with its exit
    reason, then the new process joining), not only in logs/rollout.log."""
    from asyncrl.monitor import LineView

    out = io.StringIO()
    view = LineView(out)
    running = (True, {"state": "generating"})
    view.show(_status(1, **{"rollout-0-10": running, "rollout-1-11": running}))
    view.show(_status(2, **{"rollout-0-10": (True, {"state": "stopped",
                                                     "exit": "killed by SIGKILL"}),
                            "rollout-1-11": running}))
    view.show(_status(3, **{"rollout-0-10": (True, {"state": "stopped",
                                                     "exit": "killed by SIGKILL"}),
                            "rollout-0-12": running, "rollout-1-11": (False, {})}))
    view.show(_status(4, **{"rollout-0-12": (True, {"state": "stopped"}),
                            "rollout-1-11": running}))
    view.show(_status(5, **{"rollout-0-12": (True, {"state": "stopped"}),
                            "rollout-1-11": (True, {"state": "stopped", "shard": [1, 2],
                                                    "exit": "data exhausted"})}))
    events = [line for line in out.getvalue().splitlines() if line.startswith("fleet:")]
    assert events == [
        "fleet: rollout-0-10 joined", "fleet: rollout-1-11 joined",
        "fleet: rollout-0-10 killed by SIGKILL: its role restarts it (log: logs/rollout.log)",
        "fleet: rollout-0-12 joined",
        "fleet: rollout-1-11 silent for 16s: let go",
        "fleet: rollout-0-12 stopped",
        "fleet: rollout-1-11 is back",
        "fleet: rollout-1-11 stopped: its share of data.path ran out"]
    assert [line[:2] for line in out.getvalue().splitlines() if not line.startswith("fleet")
            ] == ["v1", "v2", "v3", "v4", "v5"]
    out = io.StringIO()
    LineView(out).show(_status(1, **{"rollout-0-10": (True, {"state": "stopped",
                                                             "exit": "exit status 1"})}))
    assert out.getvalue().startswith("fleet: rollout-0-10 exit status 1: its role restarts")


def test_up_names_an_engine_the_weight_sync_evicted_once() -> None:
    """A frozen engine stays alive to the buffer, so no fleet line tells of it: the learner's
    heartbeat does, and `asyncrl up`'s console prints it once."""
    from asyncrl.monitor import LineView

    out = io.StringIO()
    view = LineView(out)
    running = (True, {"state": "generating"})
    status = _status(7, **{"rollout-0-10": running, "rollout-1-11": running})
    view.show(status)
    why = "no heartbeat for 2.6 s during version 7 (frozen?)"
    status["members"]["learner-0"]["info"]["weights/evictions"] = {"rollout-1-11": why}
    view.show(status)
    view.show(status)
    assert [line for line in out.getvalue().splitlines() if line.startswith("weights:")] == [
        f"weights: evicted rollout-1-11: {why}"]
