"""``rollout.engine = "sglang"`` end to end: ``asyncrl up`` with the real buffer, learner and
rollout worker, each worker launching its own server (managed mode) — here the SGLang protocol
fixture (``tests/engines/sglang_fixture.py``, see its docstring: SGLang does not install on
these CPU machines), started through ``rollout.sglang.module`` with the flags a real
``sglang.launch_server`` gets. The fixture validates every request against SGLang's documented
schemas, joins the learner's gloo group the way SGLang does, receives every broadcast, and
generates from a tiny torch model with the weights it received.

What shows that the weights really arrived: the run is on-policy (``max_staleness = 0``), so
every step trains on tokens the servers sampled with the learner's previous weights; the
learner recomputes their logprobs, and they match the servers' own within float tolerance at
every step while the policy moves (a server left on old weights is off by ~0.1 per token
after one step, measured while writing this test).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.metrics import read_jsonl
from tests.integration.conftest import QUICKSTART, Processes, processes  # noqa: F401

pytestmark = pytest.mark.slow

STEPS = 8
MAX_ABS_LOGP = 1e-4  # fp32 torch on both sides: only summation order differs


def test_run_with_sglang_engine(tmp_path: Path, processes: Processes) -> None:
    up = processes.start("up", "up", str(QUICKSTART), "--set", f"run.output_dir={tmp_path}",
                         "--set", "run.name=sg", "--set", "rollout.engine=sglang",
                         "--set", "rollout.sglang.module=tests.engines.sglang_fixture",
                         "--set", "rollout.workers=2", "--set", f"learner.total_steps={STEPS}",
                         "--set", "buffer.max_staleness=0", "--set", "eval.every_steps=0",
                         "--set", "weights.timeout_s=30")
    assert processes.wait(up, 400) == 0, processes.log("up")
    run_dir = tmp_path / "sg"
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if isinstance(r.get("step"), int)]
    assert len(records) == STEPS
    for record in records[1:]:  # a step's record carries the previous delivery's metrics
        assert record["weights/evicted"] == 0 and record["weights/bytes"] > 0, record
    # Both servers take part. One that got ready late (a loaded machine: the fixture starts in
    # seconds to tens of seconds) joins at the next update, gets the current weights before it
    # generates (the on-policy checks below), and none ever leaves.
    members = [record["weights/members"] for record in records[1:]]
    assert set(members) <= {1, 2} and members == sorted(members) and members[-1] == 2, members
    for record in records:
        assert record["mismatch/abs_logp"] < MAX_ABS_LOGP, record
        assert record["staleness/consumed_version_min"] == record["step"] - 1, record
    assert records[0]["actor/loss"] != records[-1]["actor/loss"]
    logs = [(run_dir / f"sglang-{i}.log").read_text() for i in range(2)]
    for log in logs:
        assert "SGLang protocol fixture serving" in log
