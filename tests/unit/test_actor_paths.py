"""for_actors: the driver's relative paths made absolute for Ray actors, hub ids left alone."""

from __future__ import annotations

import os
from pathlib import Path

from asyncrl.launch.actor_paths import for_actors, python_path
from asyncrl.config import Config


def test_relative_local_paths_resolve_against_the_drivers_directory(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("{}\n")
    (tmp_path / "model").mkdir()
    (tmp_path / "keys").mkdir()
    cfg = Config.model_validate({
        "run": {"output_dir": "runs"},
        "model": {"path": "model"},
        "data": {"path": "data/train.jsonl", "eval_path": "data/missing.jsonl"},
        "buffer": {"zmq": {"curve_keys_dir": "keys", "spill_path": "spill/buffer.spill"}},
        "checkpoint": {"path": "ckpt/step_3"},  # missing: left for the preflight to report
    })
    out = for_actors(cfg, tmp_path)
    assert out.run.output_dir == tmp_path / "runs"  # written later: need not exist
    assert out.model.path == str(tmp_path / "model")
    assert out.data.path == str(tmp_path / "data" / "train.jsonl")
    assert out.data.eval_path == "data/missing.jsonl"
    assert out.buffer.zmq.curve_keys_dir == str(tmp_path / "keys")
    assert out.buffer.zmq.spill_path == str(tmp_path / "spill" / "buffer.spill")
    assert out.checkpoint.path == "ckpt/step_3"
    assert cfg.data.path == "data/train.jsonl"  # the driver's own config is not changed


def test_hub_ids_absolute_paths_and_defaults_are_left_alone(tmp_path: Path) -> None:
    cfg = Config.model_validate({
        "run": {"output_dir": str(tmp_path / "runs")},
        "model": {"path": "Qwen/Qwen2.5-0.5B"},
        "data": {"path": str(tmp_path / "train.jsonl")},
    })
    out = for_actors(cfg, tmp_path)
    assert out.run.output_dir == tmp_path / "runs"
    assert out.model.path == "Qwen/Qwen2.5-0.5B"
    assert out.data.path == str(tmp_path / "train.jsonl")
    assert out.buffer.zmq.spill_path == cfg.buffer.zmq.spill_path == "auto"
    assert out.buffer.redis.tls_ca_file == "" and out.data.eval_path == ""


def test_the_drivers_directory_goes_first_on_the_actors_python_path(tmp_path: Path) -> None:
    assert python_path(tmp_path, None) == str(tmp_path)
    assert python_path(tmp_path, "/opt/lib") == os.pathsep.join([str(tmp_path), "/opt/lib"])
