"""verl's data and reward function as they are, through `asyncrl up`: a Parquet file written
in verl's layout (chat-message prompts, reward_model.ground_truth, data_source, extra_info;
examples/verl/make_data.py writes it as verl's gsm8k.py does) and a verl-signature
compute_score returning a dict. No data setting beyond the paths. The tiny model goes from
chance (a mean score near 0.1, no exact copy) to the held-out target: a mean score of 0.9
(``eval.stop_at_accuracy``, on ``val/test_score``: the mean return), most copies exact."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from asyncrl.metrics import read_jsonl
from examples.verl.make_data import write
from tests.integration.conftest import ROOT, Processes

pytestmark = pytest.mark.slow


def test_the_tiny_model_learns_a_verl_parquet_task(tmp_path: Path, processes: Processes) -> None:
    data = write(tmp_path / "data")
    up = processes.start("up", "up", str(ROOT / "examples" / "verl" / "copy.toml"),
                         "--set", f"data.path={data / 'train.parquet'}",
                         "--set", f"data.eval_path={data / 'test.parquet'}",
                         "--set", f"run.output_dir={tmp_path}")
    assert processes.wait(up, 400) == 0, processes.log("up")
    log = processes.log("up")
    final = re.search(r"final held-out greedy eval val/test_score/test ([\d.]+), "
                      r"val/success/test ([\d.]+)", log)
    assert final and float(final.group(1)) >= 0.9 and float(final.group(2)) >= 0.5, log[-3000:]
    steps = [r for r in read_jsonl(tmp_path / "verl_copy" / "metrics.jsonl")
             if isinstance(r.get("step"), int)]
    assert steps[0]["critic/score/mean"] < 0.5 < steps[-1]["critic/score/mean"]
