"""``learner.compile = true`` end to end: the quickstart with compiled decoder blocks and LM-head
kernels reaches its accuracy target through ``asyncrl up``, compiling in its first step only.

The backend is ``aot_eager``: dynamo's graphs and guards and AOTAutograd's forward and
backward graphs, which are what inductor receives, without inductor's code generation (on
the 2-core CI machine that alone takes about two minutes: ``bench/RESULTS.md``, "The
quickstart with ``learner.compile = true``", where inductor's run reached 1.000). That the
compiled steps equal the eager ones is ``tests/unit/test_compile.py``'s; inductor's own
kernels are ``tests/unit/test_fused_logprobs.py``'s and the GPU check's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.conftest import QUICKSTART, Processes, step_records

pytestmark = pytest.mark.slow


def test_compiled_quickstart_learns_compiling_only_in_step_one(tmp_path: Path,
                                                               processes: Processes) -> None:
    up = processes.start("up", "up", str(QUICKSTART), "--set", f"run.output_dir={tmp_path}",
                         "--set", "run.name=compiled", "--set", "learner.compile=true",
                         "--set", "learner.compile_backend=aot_eager")
    assert processes.wait(up, 420) == 0, processes.log("up")
    run_dir = tmp_path / "compiled"
    final = json.loads((run_dir / "eval.json").read_text())
    assert final["val/test_score/copy"] >= 0.9, final
    compiles = [r["perf/compiles"] for r in step_records(run_dir / "metrics.jsonl")]
    assert len(compiles) > 10 and compiles[0] > 0, compiles
    assert not any(compiles[1:]), compiles   # warm: no step compiles again
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    assert "compile aot_eager, log-prob chunks 1024" in learner_log, learner_log
