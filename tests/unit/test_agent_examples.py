"""The README's agent examples run: user env, user reward and JSONL data by import path,
through the rollout worker's producer on a real engine, and `asyncrl eval` on a model dir."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from asyncrl.config import load_config  # noqa: E402
from asyncrl.models import EOS_ID, PAD_ID, load_causal_lm, prepare_model_dir  # noqa: E402
from asyncrl.tokens import ModelTokenizer  # noqa: E402
from rollouters.engines.torch_engine import TorchEngine  # noqa: E402
from rollouters.producers import EpisodeProducer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
torch.set_num_threads(1)


def _producer(name: str, tmp_path: Path) -> tuple[EpisodeProducer, Path]:
    cfg = load_config(ROOT / "examples" / "agent" / name, [f"run.output_dir={tmp_path}"])
    model_dir = prepare_model_dir(cfg.model, cfg.run_dir, cfg.run.seed)
    engine = TorchEngine(load_causal_lm(model_dir), eos_ids=(EOS_ID,), pad_id=PAD_ID, seed=0)
    return EpisodeProducer(cfg, engine, ModelTokenizer(model_dir), 0), cfg.run_dir


def test_single_turn_example_with_user_reward_and_jsonl(tmp_path: Path) -> None:
    producer, run_dir = _producer("single_turn.toml", tmp_path)
    try:
        groups = producer.produce(3)
        assert len(groups) == 3 and all(g.size == 8 for g in groups)
        assert all(0.0 <= r <= 1.0 for g in groups for r in g.rewards)
        assert {g.prompt_id for g in groups} <= {f"r{i}" for i in range(1, 9)}
        producer.handed_over()
        assert json.loads((run_dir / "data" / "worker-0.json").read_text()) == \
            {"epoch": 0, "position": 3}
        assert producer.metrics()["reward/ok"] == 24
    finally:
        producer.close()


def test_multi_turn_example_with_user_env(tmp_path: Path) -> None:
    producer, _ = _producer("multi_turn.toml", tmp_path)
    try:
        groups = producer.produce(2)
        assert len(groups) == 2 and all(g.size == 8 for g in groups)
        assert producer.metrics()["rollout/episodes"] == 16
    finally:
        producer.close()


def test_asyncrl_eval_on_a_model_directory(tmp_path: Path) -> None:
    config = ROOT / "examples" / "agent" / "single_turn.toml"
    cfg = load_config(config, [f"run.output_dir={tmp_path}"])
    model_dir = prepare_model_dir(cfg.model, cfg.run_dir, cfg.run.seed)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "asyncrl.cli", "eval", str(config), "--set",
                          f"run.output_dir={tmp_path}", "--checkpoint", str(model_dir)],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    metrics = json.loads(out.stdout)
    assert metrics["val/num_prompts/reverse3"] == 3
    assert 0.0 <= metrics["val/test_score/reverse3"] <= 1.0
    bad = subprocess.run([sys.executable, "-m", "asyncrl.cli", "eval", str(config),
                          "--checkpoint", str(tmp_path / "nothing")],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert bad.returncode != 0 and "neither an HF model directory" in bad.stderr
