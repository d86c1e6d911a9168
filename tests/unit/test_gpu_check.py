"""The prepared GPU check and the transport bench on a machine without CUDA: they refuse
cleanly (exit 2, saying why), and ``--dry-run`` checks that every piece imports and writes
the same JSON and Markdown table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")


def run(argv: list[str], out: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    env.pop("OUT", None)
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


@no_cuda
def test_the_gpu_check_refuses_without_cuda(tmp_path: Path) -> None:
    done = run(["bash", "bench/gpu_check.sh", "--out", str(tmp_path)])
    assert done.returncode == 2
    assert "no CUDA device here" in done.stderr and "--dry-run" in done.stderr
    assert not (tmp_path / "gpu_check.json").exists()


@no_cuda
def test_the_transport_bench_refuses_a_cuda_transport_without_cuda() -> None:
    done = run([sys.executable, "bench/weight_sync.py", "--transport", "nccl"])
    assert done.returncode == 2
    assert "--transport nccl needs CUDA, and this machine has none" in done.stderr


@pytest.mark.timeout(240)
def test_the_dry_run_checks_every_piece_and_writes_the_report(tmp_path: Path) -> None:
    done = run(["bash", "bench/gpu_check.sh", "--dry-run", "--out", str(tmp_path)])
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    status = {step["name"]: step["status"] for step in report["steps"]}
    assert report["dry_run"] is True
    assert status["pieces"] == "ok" and report["env"]["torch"] == torch.__version__
    assert "colocated_quickstart" in status
    table = (tmp_path / "gpu_check.md").read_text()
    assert table.startswith("# GPU check (dry run)") and "| pieces | ok |" in table
