"""Smoke test of bench/broker_take.py: the ZMQ broker's take timed at tiny scale, through the
script's command line, one row per queue size with a positive time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_broker_take_benchmark_prints_a_row_per_queue_size() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "broker_take.py"), "--queued", "8", "64",
         "--rounds", "20"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in proc.stdout.splitlines()
            if line.startswith("| ") and line[2].isdigit()]
    assert [r[0] for r in rows] == ["8", "64"], proc.stdout
    assert all(float(r[1]) > 0 for r in rows), rows
