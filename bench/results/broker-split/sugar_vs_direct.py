"""pyzmq's send_multipart / recv_multipart against buffers.zmq_frames, one process, inproc.

A DEALER sends a put_many-shaped message (request id, command, args, 8 frames of 106 kB) to a
ROUTER, which receives it and sends back a batch-reply-shaped one (12 frames). Prints µs of
CPU per message for the ROUTER's receive and send: pyzmq's layer ("sugar"), then
``buffers.zmq_frames`` ("direct": the Cython calls with plain ints).

    .venv/bin/python bench/results/broker-split/sugar_vs_direct.py
"""

import sys
import time
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from buffers.zmq_frames import recv_frames, send_frames  # noqa: E402

MESSAGES = 3000


def main() -> None:
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.bind("inproc://bench")
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"client")
    dealer.connect("inproc://bench")
    payload = [zmq.Frame(b"x" * 106_000) for _ in range(8)]
    head = [b"request-id", b"put_many", b'{"producer":"p0"}']
    ways = {"sugar": (lambda s: s.recv_multipart(copy=False),
                      lambda s, frames: s.send_multipart(frames, copy=False)),
            "direct": (recv_frames, send_frames)}
    for name, (receive, send) in ways.items():
        for _ in range(2):
            received = sent = 0.0
            for _ in range(MESSAGES):
                dealer.send_multipart(head + payload, copy=False)
                start = time.thread_time()
                frames = receive(router)
                received += time.thread_time() - start
                start = time.thread_time()
                send(router, [frames[0], frames[1], b"ok", b"{}", *frames[4:]])
                sent += time.thread_time() - start
                dealer.recv_multipart(copy=False)
            print(f"{name}: receive {received / MESSAGES * 1e6:.1f} µs a message "
                  f"({len(frames)} frames), send {sent / MESSAGES * 1e6:.1f} µs")
    for socket in (router, dealer):
        socket.close(linger=0)
    context.term()


if __name__ == "__main__":
    main()
