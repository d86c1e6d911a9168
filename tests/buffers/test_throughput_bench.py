"""CI smoke test of bench/buffer_throughput.py (issue 3): the benchmark runs end to end, at
tiny scale, through both real backends and their raw transports, and prints every ratio.

The consumer keeps 3 batch requests in flight (``--take-depth``) and each producer 2
``put_many`` calls (``--put-depth``; Redis: one at a time for both).

Producers putting chunks of 8 groups into a buffer bounded at 6 is the case where a producer
that waited for a grant covering its whole chunk starved (0 groups/s; so did 4 producers of
32 against 64): each must put what it was granted, as a rollout worker does.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.buffers.conftest import RedisServer, child_env

ROOT = Path(__file__).resolve().parents[2]
ROWS = ("zmq-raw-packed", "zmq-raw-2hop", "zmq-put-many", "redis-raw", "redis-put-many")

pytestmark = pytest.mark.slow


def test_buffer_benchmark_reports_every_row(redis_server: RedisServer) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "buffer_throughput.py"), "--seconds", "0.3",
         "--repeats", "1", "--tokens", "64", "--samples", "2", "--producers", "4",
         "--max-groups", "6", "--batch", "2", "--take-depth", "3", "--put-depth", "2",
         "--redis-url", redis_server.url, "--only", *ROWS],
        env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {cells[3]: cells for line in proc.stdout.splitlines()
            if len(cells := [c.strip() for c in line.split("|")]) > 8 and cells[3] in ROWS}
    assert set(rows) == set(ROWS), proc.stdout
    for name, cells in rows.items():
        groups_per_s = float(cells[4].split()[0].replace(",", ""))
        assert groups_per_s > 0, (name, cells)
        assert len(cells[8].split(" / ")) == 3, cells  # the CPU of each role
    for name in ("zmq-put-many", "redis-put-many"):
        assert float(rows[name][6]) > 0, rows[name]  # vs raw
    assert float(rows["zmq-put-many"][7]) > 0  # vs 2-hop
