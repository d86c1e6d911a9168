"""A ZMQ buffer client dropped without ``close()`` inside a reference cycle is collected
without hanging. Before, pyzmq's context finalizer could run before the sockets' and wait in
``term()`` for them for ever, in whichever thread the collection ran: a CI run lost a
learner's batch request that way (its thread hung in a logging call that happened to
collect). Real ZMQ sockets, in a child process so that a hang cannot take the test worker."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

DROP_IN_A_CYCLE = textwrap.dedent("""
    import gc, threading
    from buffers.zmq_client import ZmqBufferClient
    gc.disable()   # the collection below is the only one
    client = ZmqBufferClient("tcp://127.0.0.1:9", timeout_s=1.0)   # nothing listens there
    client.cycle = client
    del client
    collector = threading.Thread(target=gc.collect, daemon=True)
    collector.start()
    collector.join(20)
    print("hung" if collector.is_alive() else "collected", flush=True)
""")


def test_a_client_dropped_unclosed_in_a_reference_cycle_is_collected_without_hanging():
    done = subprocess.run([sys.executable, "-c", DROP_IN_A_CYCLE], capture_output=True,
                          text=True, timeout=50, cwd=Path(__file__).parents[2])
    assert done.stdout.strip() == "collected", done.stdout + done.stderr
