"""Client CPU and wall time per small request (``release``) to a ZMQ broker in another process.

    .venv/bin/python bench/results/client-poller/round_trip.py [CODE_ROOT]

``CODE_ROOT`` (default: this checkout) goes first on ``sys.path``, so a ``git archive`` copy of
another commit can be timed with the same script. Prints three rounds of 10,000 requests.
"""

import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).resolve().parents[3]))


def broker(addresses, done):
    from asyncrl.config.schema import BufferConfig
    from buffers.zmq_broker import start_broker_thread

    address, stop = start_broker_thread(BufferConfig(type="zmq", port=0), 1)
    addresses.put(address)
    done.wait()
    stop()


if __name__ == "__main__":
    from buffers.zmq_client import ZmqBufferClient

    ctx = mp.get_context("spawn")
    addresses, done = ctx.Queue(), ctx.Event()
    process = ctx.Process(target=broker, args=(addresses, done))
    process.start()
    client = ZmqBufferClient(addresses.get(), timeout_s=5)
    for _ in range(2000):  # warm up
        client.release("p", 0)
    for _ in range(3):
        n = 10_000
        wall, cpu = time.perf_counter(), time.thread_time()
        for _ in range(n):
            client.release("p", 0)
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        print(f"{wall / n * 1e6:.1f} us wall, {cpu / n * 1e6:.1f} us client CPU per release")
    client.close()
    done.set()
    process.join()
