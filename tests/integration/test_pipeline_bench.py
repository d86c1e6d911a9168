"""CI smoke test of bench/pipeline.py (issue 8): the harness runs at tiny scale through the
real `asyncrl up` (simulated engines and trainer, real buffer, gate, loop and weight sync) and
reports every column for the synchronous baseline, an async run, and the same async run in
``pace`` mode (``--pace``), which drops no finished group."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import ROOT, role_env

pytestmark = pytest.mark.slow


def test_pipeline_harness_reports_every_column(tmp_path: Path) -> None:
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "pipeline.py"), "--tiny", "--ratios", "1",
         "--tails", "lognormal", "--staleness", "2", "--pace", "--out", str(out),
         "--timeout", "300"],
        env=role_env(), cwd=ROOT, capture_output=True, text=True, timeout=700)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    sys.path.insert(0, str(ROOT / "bench"))
    from pipeline import COLUMNS

    result = json.loads((out / "pipeline.json").read_text())
    rows = result["rows"]
    assert [r["mode"] for r in rows] == ["sync", "async s=2", "async s=2 pace"]
    for row in rows:
        assert set(COLUMNS) <= set(row), set(COLUMNS) - set(row)
        assert row["samples_per_s"] > 0 and row["tokens_per_s"] > 0
        assert 0 < row["pct_of_bound"] < 2 and 0 <= row["learner_idle"] <= 1
        assert 0 <= row["engine_idle"] <= 1 and row["drops"] >= 0
        assert row["harness_cores"] > 0 and 0 < row["machine_busy"] <= 1  # what the run cost
        assert row["load_1min"] >= 0
        assert len(row["staleness_hist"]) == (1 if row["mode"] == "sync" else 3)
    sync, fast, pace = rows
    assert pace["drops"] == 0  # pace waits for a group instead of dropping it
    assert sync["speedup"] == pytest.approx(1.0)
    assert sync["staleness_hist"][0] > 0  # synchronous: everything on-policy
    assert fast["bound_speedup"] > 1
    table = (out / "pipeline.md").read_text()
    assert "% of bound" in table and "async s=2 pace" in table and "run CPU (cores)" in table
    png = (out / "pipeline.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
