"""LoRA end to end: the quickstart, unchanged but for ``--set model.lora.rank=8`` and a LoRA
learning rate, learns to copy; only the adapters travel to the engines, which merge them. (That
at ``max_staleness = 0`` the engines' merged weights give the learner's LoRA logprobs is shown
by test_up's zero-staleness run, which uses LoRA.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.integration.conftest import QUICKSTART, Processes, step_records

pytestmark = pytest.mark.slow

# 5e-3: 12 runs of 12 reached 0.9 in 70-90 steps on the 2-core VM with a core kept busy; at
# 1e-2, 2 runs of 10 (one of them in CI) nearly learnt, then collapsed and failed at 300 steps.
LORA = ["--set", "model.lora.rank=8", "--set", "learner.lr=5e-3"]


def _up(processes: Processes, tmp_path: Path, name: str, *sets: str) -> Path:
    up = processes.start("up", "up", str(QUICKSTART), "--set", f"run.output_dir={tmp_path}",
                         "--set", f"run.name={name}", *LORA, *sets)
    assert processes.wait(up, 420) == 0, processes.log("up")
    return tmp_path / name


def _model_bytes(path: Path) -> int:
    from safetensors.torch import load_file

    return sum(t.numel() * t.element_size() for t in load_file(path / "model.safetensors").values())


def test_lora_quickstart_learns(tmp_path: Path, processes: Processes) -> None:
    from safetensors.torch import load_file

    run_dir = _up(processes, tmp_path, "lora")
    final = json.loads((run_dir / "eval.json").read_text())
    assert final["val/test_score/copy"] >= 0.9, final
    records = step_records(run_dir / "metrics.jsonl")
    # Only the adapters travel: far less than the model, in one small bucket.
    sent = {r["weights/bytes"] for r in records if "weights/bytes" in r}
    assert len(sent) == 1 and 0 < sent.pop() < _model_bytes(run_dir / "init_model") / 4
    # The HF export is the merged model: targets moved, the frozen embeddings did not.
    initial = load_file(run_dir / "init_model" / "model.safetensors")
    exported = load_file(run_dir / "final" / "model.safetensors")
    assert set(exported) == set(initial)
    assert torch.equal(exported["model.embed_tokens.weight"], initial["model.embed_tokens.weight"])
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(exported[name], initial[name])
