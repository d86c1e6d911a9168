"""CPU of the pieces of a producer's put, one group at a time, warm (``timeit``, process CPU):
encoding, packing, and a ``zmq.Frame`` of the packed group made by copying (libzmq's
``memcpy``) or zero-copy (pyzmq's bookkeeping; its garbage thread's work comes on top).
Run from the repository root: ``.venv/bin/python bench/results/producer-copy/pieces.py 1024``.
"""

from __future__ import annotations

import os
import sys
import time
import timeit

sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "bench")]
import zmq  # noqa: E402

import buffer_throughput as bt  # noqa: E402
from asyncrl.wire.group import encode_group_views  # noqa: E402
from buffers.malloc_tuning import keep_large_buffers  # noqa: E402
from buffers.packing import pack_group  # noqa: E402

N = 20000


def report(label: str, fn, number: int = N) -> None:
    best = min(timeit.repeat(fn, number=number, repeat=3, timer=time.process_time))
    print(f"{label}: {best / number * 1e6:.2f} us")


def main() -> None:
    keep_large_buffers()
    spec = bt.Spec(tokens=int(sys.argv[1]), samples=8, batch=8, max_groups=256, redis_url="")
    group = bt.make_group(spec, "g")
    report("encode_group_views", lambda: encode_group_views(group))
    views = encode_group_views(group)
    report("pack_group", lambda: pack_group(views))
    packed = pack_group(views)
    print(f"packed group: {len(packed)} bytes")
    report("zmq.Frame, copy=True", lambda: zmq.Frame(packed, copy=True))
    report("zmq.Frame, copy=False", lambda: zmq.Frame(packed, copy=False))


if __name__ == "__main__":
    main()
