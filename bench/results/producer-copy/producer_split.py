"""Where a ZMQ ``put_many`` producer's CPU goes, per group and per thread.

A broker and a consumer (``bench/buffer_throughput.py``'s, the consumer with 4 batch requests
in flight) run in processes of their own; the producer runs in this one, with ``PutAhead``
keeping ``--put-depth`` calls of 8 groups in flight, as the benchmark's producers do. After a
2 s warm-up it counts ``--seconds`` of groups sent and each thread's CPU time
(``/proc/self/task/*/stat``): the main thread, libzmq's I/O thread, and pyzmq's garbage
thread (which frees zero-copy frames once libzmq has sent them). Run from the repository
root: ``.venv/bin/python bench/results/producer-copy/producer_split.py --tokens 1024``.
``--profile`` adds a cProfile of the main thread (CPU time, not wall).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time

sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "bench")]
import buffer_throughput as bt  # noqa: E402


def thread_cpu() -> dict[str, float]:
    """``name:tid`` -> CPU seconds of every thread of this process."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                raw = f.read()
        except OSError:
            continue
        name = raw[raw.index("(") + 1:raw.rindex(")")]
        fields = raw.rsplit(")", 1)[1].split()
        out[f"{name}:{tid}"] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def consumer(address: str, spec: bt.Spec, stop) -> None:
    from buffers.zmq_client import ZmqBufferClient

    client = ZmqBufferClient(address, timeout_s=30)
    take = bt._backend_take(client, spec)
    while not stop.is_set():
        take()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument("--put-depth", type=int, default=4)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    spec = bt.Spec(tokens=args.tokens, samples=8, batch=8, max_groups=256, redis_url="",
                   put_many=8, take_depth=4, put_depth=args.put_depth)
    from buffers.malloc_tuning import MMAP_THRESHOLD, TRIM_THRESHOLD, keep_large_buffers

    keep_large_buffers()  # as the benchmark and the roles do
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    os.environ["MALLOC_TRIM_THRESHOLD_"] = str(TRIM_THRESHOLD)
    ctx = mp.get_context("spawn")
    queue, stop = ctx.Queue(), ctx.Event()
    ctx.Process(target=bt._zmq_broker, args=(spec, queue, stop), daemon=True).start()
    address = queue.get(timeout=30)
    ctx.Process(target=consumer, args=(address, spec, stop), daemon=True).start()

    import cProfile
    import pstats

    from buffers.put_ahead import PutAhead
    from buffers.zmq_client import ZmqBufferClient

    client = ZmqBufferClient(address, timeout_s=2.0)
    puts = PutAhead(client, "p0", spec.put_depth)
    groups = [bt.make_group(spec, "g") for _ in range(8)]
    profile = cProfile.Profile(time.thread_time) if args.profile else None
    sent = granted = counted_from = 0
    base: dict[str, float] | None = None
    start = counting_since = time.monotonic()
    while True:
        now = time.monotonic()
        if base is None and now - start > 2:
            base, counted_from, counting_since = thread_cpu(), sent, now
            if profile is not None:
                profile.enable()
        if base is not None and now - counting_since > args.seconds:
            break
        if not granted:
            granted = client.acquire("p0", 256, 0).granted
            if not granted:
                time.sleep(0.001)
            continue
        batch = groups[:granted]
        for group in batch:
            group.group_id, sent = f"p0-{sent}", sent + 1
        puts.put_many(batch)
        granted -= len(batch)
    end, count = thread_cpu(), sent - counted_from
    assert base is not None
    if profile is not None:
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    print(f"tokens={args.tokens} depth={args.put_depth}: "
          f"{count / (time.monotonic() - counting_since):.0f} groups/s")
    for thread, used in end.items():
        if used - base.get(thread, 0) > 0:
            print(f"  {thread}: {(used - base.get(thread, 0)) / count * 1e6:.1f} us/group")
    print(f"  total: {sum(end[t] - base.get(t, 0) for t in end) / count * 1e6:.1f} us/group")
    stop.set()
    os._exit(0)  # the spawned helpers are daemons; no orderly teardown needed


if __name__ == "__main__":
    main()
