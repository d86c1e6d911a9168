"""Per-group Python cost of the broker's put_many + get_batch/ack path, no sockets.

A fake socket collects the replies, so this times the broker's own interpreter work: decode
the request, check 8 groups, accept them, serve and ack a batch of 8 (8 samples x 1k tokens).
The requests' four small frames are made in the loop; the groups' 8 ``zmq.Frame`` objects are
made once and sent again in every request (a received frame costs the broker nothing to make;
building one from ``bytes`` costs pyzmq's zero-copy bookkeeping, ~15 µs a group on the 2-core
VM, which is the producer's, not the broker's). ``BROKER_HOT_DISTINCT=N`` cycles through N
requests' worth of distinct group frames instead (N = 64: 54 MB, past any cache, as fresh
groups are). ``BROKER_HOT_GC=0`` disables the cyclic garbage collector, to see what it costs.

    .venv/bin/python bench/results/groupscan/broker_hot.py run|prof [CODE_ROOT]

``CODE_ROOT`` (default: this checkout) is put first on ``sys.path``, so a ``git archive`` copy
of another commit can be timed with the same script; ``prof`` adds a cProfile listing.
"""

import cProfile
import gc
import os
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, sys.argv[2] if len(sys.argv) > 2 else str(Path(__file__).resolve().parents[3]))

import numpy as np  # noqa: E402
import orjson  # noqa: E402
import zmq  # noqa: E402

from asyncrl.config.schema import BufferConfig  # noqa: E402
from asyncrl.wire import TrajectoryGroup, encode_group  # noqa: E402
from buffers.packing import pack_group  # noqa: E402
from buffers import zmq_broker  # noqa: E402
from buffers.zmq_broker import ZmqBroker  # noqa: E402

TOKENS, SAMPLES, GROUPS = 1024, 8, 8


class FakeSocket:
    def __init__(self) -> None:
        self.sent: list[list] = []

    def send_multipart(self, frames: list, copy: bool = True) -> None:
        self.sent.append(frames)


def packed_group() -> bytes:
    n = TOKENS * SAMPLES
    group = TrajectoryGroup(
        group_id="g", prompt_id="p", rewards=[1.0] * SAMPLES, finish_reasons=["stop"] * SAMPLES,
        lengths=[TOKENS] * SAMPLES, tokens=np.arange(n, dtype=np.int32),
        logprobs=np.zeros(n, np.float32), loss_mask=np.ones(n, np.uint8),
        versions=np.zeros(n, np.int32))
    return pack_group(encode_group(group))


def main() -> None:
    distinct = int(os.environ.get("BROKER_HOT_DISTINCT", "1"))
    frames = [zmq.Frame(packed_group()) for _ in range(distinct * GROUPS)]
    turn = 0
    if os.environ.get("BROKER_HOT_GC") == "0":
        gc.disable()
    broker = ZmqBroker(BufferConfig(max_groups=64, max_staleness=10**6), groups_per_step=8)
    socket = broker._socket = FakeSocket()
    if hasattr(zmq_broker, "send_frames"):  # the broker sends through buffers.zmq_frames
        zmq_broker.send_frames = lambda fake, reply: fake.send_multipart(reply)
    count = 0

    def request(command: str, args: dict, payload: tuple = ()) -> list:
        nonlocal count
        count += 1
        head = [zmq.Frame(f) for f in (b"client", str(count).encode(), command.encode(),
                                       orjson.dumps(args))]
        return head + list(payload)

    def cycle(receipts: list[str]) -> list[str]:
        broker._handle(request("acquire", {"producer": "p0", "want": GROUPS,
                                           "engine_version": 0}))
        nonlocal turn
        turn = (turn + 1) % distinct
        broker._handle(request("put_many", {"producer": "p0"},
                               frames[turn * GROUPS:(turn + 1) * GROUPS]))
        args = {"consumer": "c", "count": GROUPS, "learner_version": 0, "timeout_s": 1.0}
        if receipts:
            args["ack"] = receipts
        broker._handle(request("get_batch", args))
        body = orjson.loads(socket.sent[-1][3])
        socket.sent.clear()
        return body["receipts"]

    receipts: list[str] = []
    for _ in range(200):
        receipts = cycle(receipts)
    rounds = 3000
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(rounds):
        receipts = cycle(receipts)
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    per = 1e6 / (rounds * GROUPS)
    print(f"{wall * per:.1f} µs/group wall, {cpu * per:.1f} µs/group CPU")
    if sys.argv[1:2] == ["prof"]:
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(2000):
            receipts = cycle(receipts)
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
