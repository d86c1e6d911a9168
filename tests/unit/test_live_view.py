"""The live dashboard on a real pseudo-terminal: log records written while it is shown land
above it and the log handler gets its stream back when it closes."""

from __future__ import annotations

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
