"""A role's stop on signals: the first SIGTERM stops gracefully, a second exits at once, and a
stop the code asked for itself does not count as a signal."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import os, signal, sys, time
from asyncrl.launch.signals import stop_on_signals
stop = stop_on_signals()
stop.set()                        # the code stops itself (a lost buffer)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.01)                  # the handler has run: still alive
print("alive after one SIGTERM", stop.is_set(), flush=True)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(30)
print("not reached", flush=True)
"""


def test_a_stop_set_by_the_code_does_not_make_the_first_signal_the_second():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).parents[2])
    assert done.stdout == "alive after one SIGTERM True\n", done.stderr
    assert done.returncode == 128 + 15, done.stderr   # the second one: at once
