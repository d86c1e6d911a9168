"""The CLI surface that needs no running roles: config show, errors, the monitor view."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tomllib

import pytest

from asyncrl.cli import main
from asyncrl.monitor import progress_line

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs" / "quickstart.toml"


def test_config_show_prints_resolved_toml(capsys) -> None:
    assert main(["config", "show", str(QUICKSTART), "--set", "learner.lr=0.01"]) == 0
    shown = tomllib.loads(capsys.readouterr().out)
    assert shown["learner"]["lr"] == 0.01
    assert shown["rollout"]["workers"] == 2


def test_config_show_prints_legacy_keys_in_their_new_place(capsys) -> None:
    assert main(["config", "show", str(QUICKSTART), "--set", "buffer.port=6000",
                 "--set", "rollout.engine=sglang", "--set", 'rollout.sglang_args=["--x"]']) == 0
    shown = tomllib.loads(capsys.readouterr().out)
    assert shown["buffer"]["zmq"]["port"] == 6000 and "port" not in shown["buffer"]
    assert shown["rollout"]["sglang"]["args"] == ["--x"]
    assert "sglang_args" not in shown["rollout"]


def test_bad_config_exits_2_naming_the_key(capsys) -> None:
    assert main(["up", str(QUICKSTART), "--set", "rollout.workrs=3"]) == 2
    err = capsys.readouterr().err
    assert "rollout.workrs: unknown key" in err and "workers" in err


def test_console_script_help() -> None:
    out = subprocess.run([sys.executable, "-m", "asyncrl.cli", "--help"], check=True,
                         capture_output=True, text=True).stdout
    for command in ("up", "buffer", "learner", "rollout", "monitor", "status", "config"):
        assert command in out


def test_asyncrl_core_imports_no_torch() -> None:
    code = ("import sys, asyncrl.cli, asyncrl.config, asyncrl.wire, asyncrl.monitor, "
            "asyncrl.launch.local, asyncrl.launch.ray, asyncrl.launch.roles, asyncrl.models, "
            "buffers.zmq_broker; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


STATUS = {
    "version": 7, "run_status": "running", "run_id": "demo", "depth": 3, "max_groups": 64,
    "accepted": 40, "in_flight": 2, "consumed": 35, "dropped_stale": 1, "rejected": {"length": 2},
    "gate_open": True, "gate_allowance": 4, "gate_closed_s": 1.5, "max_staleness": 2,
    "groups_per_step": 4, "staleness_hist": {"1": 5, "0": 30}, "uptime_s": 12.0,
    "members": {
        "learner-0": {"role": "learner", "alive": True,
                      "info": {"step": 7, "critic/score/mean": 0.5, "staleness/max": 1,
                               "staleness/mean": 0.25, "perf/trained_tokens_per_s": 900.0,
                               "val/test_score/copy": 0.75, "timing/wait_data": 0.125}},
        "rollout-0-1": {"role": "rollout", "alive": True,
                        "info": {"engine_version": 6, "tokens_per_s": 1234.0, "groups": 20}},
        "rollout-1-2": {"role": "rollout", "alive": False, "info": {}},
    },
}


def test_progress_line_shows_what_users_watch() -> None:
    line = progress_line(STATUS)
    assert line.startswith("v7") and "score 0.500" in line and "gen 1,234 tok/s" in line
    assert "train 900 tok/s" in line and "val 0.750" in line and "stale mean 0.25 max 1" in line
    assert "mfu" not in line   # a learner on a CPU reports none


def test_progress_line_shows_the_learners_mfu_where_it_has_one() -> None:
    import copy

    status = copy.deepcopy(STATUS)
    status["members"]["learner-0"]["info"]["perf/mfu"] = 0.2488
    assert "train 900 tok/s mfu 24.9% |" in progress_line(status)


def test_a_role_on_a_cpu_build_of_torch_prints_no_deepspeed_accelerator_warning() -> None:
    """transformers imports accelerate, which imports DeepSpeed: its accelerator detection
    warned "Setting accelerator to CPU. If you have GPU ..." into every CPU run's output (the
    quickstart's first screen). A role's logging setup tells it the CPU build's accelerator;
    a value the user set is kept."""
    import importlib.metadata
    import os

    if not importlib.metadata.version("torch").endswith("+cpu"):
        import pytest

        pytest.skip("a CUDA build of torch: DeepSpeed's own detection applies")
    detect = ("from asyncrl.launch.roles import setup_logging; setup_logging('x'); import os; "
              "from deepspeed.accelerator import get_accelerator; "
              "print(os.environ['DS_ACCELERATOR'], get_accelerator().device_name())")
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-c", detect], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["cpu", "cpu"]
    assert "Setting accelerator to CPU" not in done.stderr, done.stderr
    env["DS_ACCELERATOR"] = "xpu"   # a user's own setting is kept as it is
    kept = subprocess.run([sys.executable, "-c", "from asyncrl.launch.roles import setup_logging; "
                           "setup_logging('x'); import os; print(os.environ['DS_ACCELERATOR'])"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert kept.stdout.strip() == "xpu", kept.stderr


@pytest.mark.parametrize("bad", ["127.0.0.1:5555", "tcp://127.0.0.1:abc", "tcp://127.0.0.1",
                                 "tcp://127.0.0.1:70000", ""])
def test_a_bad_buffer_address_is_a_config_error_naming_its_source(tmp_path, bad) -> None:
    """Was ``zmq.error.ZMQError: Invalid argument`` with a traceback (an empty
    ``buffer.addr``: a minute of waiting)."""
    from asyncrl.cli import buffer_address
    from asyncrl.config import ConfigError, load_config

    cfg = load_config(None, [f"run.output_dir={tmp_path}"])
    assert buffer_address(cfg, "tcp://[::1]:5555") == "tcp://[::1]:5555"
    assert buffer_address(cfg, "tcp://node-3.cluster:6000") == "tcp://node-3.cluster:6000"
    if bad:
        with pytest.raises(ConfigError, match=r"^--buffer: .* is not a broker address"):
            buffer_address(cfg, bad)
    cfg.run_dir.mkdir(parents=True)
    (cfg.run_dir / "buffer.addr").write_text(bad)
    with pytest.raises(ConfigError, match=r"buffer\.addr: .* is not a broker address"):
        buffer_address(cfg, None)
