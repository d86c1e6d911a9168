"""The prepared GPU check and the transport bench on a machine without CUDA: they refuse
cleanly (exit 2, saying why), ``--dry-run`` checks that every piece imports and writes the
same three files, and the report renders the figures a GPU run leaves.

A lent GPU comes with minutes of device time, once in a while: a script that breaks there
loses them. The report is the Python inside the script, run here on the JSON a GPU run
writes (the rows of bench/learner_throughput.py and bench/weight_sync.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
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
    done = run(["bash", "bench/gpu_check.sh", "--bogus"])
    assert done.returncode == 2 and "unknown argument --bogus" in done.stderr, done.stderr


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
    assert "gpu_check: pieces ok" in done.stdout   # each step's progress line, as it goes
    with tarfile.open(tmp_path / "gpu_check_logs.tar.gz") as tar:
        assert "./logs/pieces.log" in tar.getnames()


def _report_py() -> str:
    """The report's Python, as the script holds it (between its REPORT markers)."""
    text = (ROOT / "bench" / "gpu_check.sh").read_text()
    start = text.index("REPORT_PY=$(cat <<'REPORT'\n") + len("REPORT_PY=$(cat <<'REPORT'\n")
    return text[start:text.index("\nREPORT\n)", start)]


def test_the_report_renders_what_a_gpu_run_leaves(tmp_path: Path) -> None:
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    out.mkdir()
    (work / "steps.tsv").write_text(
        "env\tok\t7\t\nipc_transfer\tok\t77\t\nlearner_1p5b\tok\t74\t\n"
        "gpu_tests\ttimeout\t150\tover 150 s; see logs/gpu_tests.log\n"
        "logprob_head\tok\t60\t\ncolocated_quickstart\tok\t40\t\n")
    (work / "env.json").write_text(json.dumps({"gpu": "NVIDIA H200", "torch": "2.11.0",
                                               "cuda": "13.0", "matmul_tflops": 805.2}))
    (work / "ipc_transfer.json").write_text(json.dumps([{
        "engines": 1, "mb": 1260.3, "sync_s": 0.098, "sync_gbs": 12.9, "raw_s": 0.0014,
        "raw_gbs": 871.0, "ratio": 0.0148}]))
    profile = {"wall_s": 2.5, "busy_s": 2.1, "by": "self_device_time_total",
               "top": [{"op": "aten::mm", "calls": 900, "s": 1.2}]}
    (work / "learner_1p5b.json").write_text(json.dumps([{
        "layout": "padded", "attn": "varlen_sdpa", "tokens_per_s": 26561.7, "step_s": 2.403,
        "warmup_s": [3.05], "mfu": 0.2488, "peak_tflops": 989.0, "peak_gib": 87.8,
        "profile": profile}]))
    run = work / "runs" / "quickstart"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(
        json.dumps({"step": 119, "timing/train_step": 0.2, "perf/mfu": 0.0123,
                    "colocate/learner_gib_peak": 3.5}) + "\n"
        + json.dumps({"step": 120, "val/test_score/copy": 0.984}) + "\n")
    head = {"step_s": 0.412, "no_grad_s": 0.101, "activations_mib": 1536.4}
    (work / "logprob_head.json").write_text(json.dumps({"full": head, "compiled": head}))
    argv = [sys.executable, "-c", _report_py(), str(work), str(out), "0", "495"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    table = (out / "gpu_check.md").read_text()
    assert "bf16 matmul 805.2 TFLOP/s" in table.splitlines()[0]
    assert "sync 0.098 s 12.9 GB/s vs memcpy 0.001 s 871.0 GB/s (1%)" in table
    assert "MFU 24.9 % (30.6 % of matmul)" in table   # against 989, and the measured 805
    assert "profiled 2.50 s, kernels 2.10 s, top: aten::mm 1.20 s" in table
    assert "| gpu_tests | timeout | 150 | over 150 s; see logs/gpu_tests.log |" in table
    assert "compiled: 0.412 s/step, no-grad 0.101 s, activations 1,536 MiB" in table
    # the colocated run: its last training step's figures and the final eval's score
    assert ("| colocated_quickstart | ok | 40 | step 119, perf/mfu 0.0123, "
            "colocate/learner_gib_peak 3.5, val/test_score/copy 0.984 |") in table
    assert json.loads((out / "gpu_check.json").read_text())["learner_1p5b"][0]["mfu"] == 0.2488
    quiet = subprocess.run([*argv, "quiet"], capture_output=True, text=True, timeout=60)
    assert quiet.returncode == 0 and quiet.stdout == ""   # after each step: files, no table
