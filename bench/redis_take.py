"""What one Redis take costs with many groups queued.

The Redis take script chooses its groups among every queued one (oldest version first).
It first read the whole index for that, so its cost grew with what was queued; it now
merges the producers' heads from sorted sets (``buffers.redis_data_scripts.TAKE``), and
this shows whether its cost still grows. For each ``--queued`` size this fills a fresh
namespace with that many small groups (versions 0-6, five producers), then times
``get_batch(8)`` carrying the previous batch's ack, as a learner calls it: the round trip,
median of ``--takes``. With ``--slowlog`` it also reads Redis' own duration of each take script from
``SLOWLOG`` (this sets ``slowlog-log-slower-than 0`` on that server while it runs: use a
private one). The namespace is deleted afterwards.

    python bench/redis_take.py [--url redis://127.0.0.1:6379/0] [--queued 64 1024 4096]
                               [--takes 8] [--slowlog]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.config.schema import BufferConfig, RedisBufferConfig  # noqa: E402
from buffers import make_buffer_client  # noqa: E402
from tests.buffers import make_group  # noqa: E402

BATCH = 8


def measure(url: str, queued: int, takes: int, slowlog: bool) -> tuple[float, float | None]:
    """(median round trip of get_batch, median Redis-side duration of the take script) in ms."""
    namespace = f"bench-take-{uuid.uuid4().hex[:8]}"
    config = BufferConfig(type="redis", redis=RedisBufferConfig(url=url, namespace=namespace),
                          max_staleness=1000, max_groups=queued + BATCH * (takes + 1))
    client = make_buffer_client(config, run_id="bench", groups_per_step=10**6)
    raw = redis.Redis.from_url(url)
    try:
        groups = [make_group(f"g{i}", version=i % 7) for i in range(queued + BATCH * takes)]
        for i in range(0, len(groups), 64):
            client.put_many(f"w{i // 64 % 5}", groups[i:i + 64])
        previous = client.get_batch("learner", BATCH, 0, timeout_s=5.0)  # moves all queued
        if slowlog:
            raw.config_set("slowlog-log-slower-than", 0)
            raw.slowlog_reset()
        rounds = []
        for _ in range(takes):
            start = time.perf_counter()
            previous = client.get_batch("learner", BATCH, 0, timeout_s=5.0, ack=previous)
            rounds.append(time.perf_counter() - start)
        script_ms = None
        if slowlog:
            durations = [e["duration"] for e in raw.slowlog_get(10_000)
                         if bytes(e["command"]).lower().startswith(b"evalsha")
                         and len(bytes(e["command"]).split()) > 2 * BATCH]  # carries 8 acks
            raw.config_set("slowlog-log-slower-than", 10_000)
            script_ms = statistics.median(durations) / 1000 if durations else None
        return statistics.median(rounds) * 1000, script_ms
    finally:
        client.close()
        keys = list(raw.scan_iter(match=f"{namespace}*"))
        if keys:
            raw.delete(*keys)
        raw.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--queued", type=int, nargs="+", default=[64, 1024, 4096])
    parser.add_argument("--takes", type=int, default=8)
    parser.add_argument("--slowlog", action="store_true",
                        help="also read the take script's duration from SLOWLOG")
    args = parser.parse_args()
    print("| queued | get_batch(8) round trip, median ms | take script in Redis, median ms |")
    print("|---:|---:|---:|")
    for queued in args.queued:
        round_ms, script_ms = measure(args.url, queued, args.takes, args.slowlog)
        script = f"{script_ms:.2f}" if script_ms is not None else ""
        print(f"| {queued:,} | {round_ms:.2f} | {script} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
