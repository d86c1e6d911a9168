"""Values the config used to accept and a run then failed on, far from the key (issue 37): each
is now refused by the loader, naming the full key, the value and the rule."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.config.limits import WEEK_S


def _error(*sets: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, list(sets))
    return str(info.value)


@pytest.mark.parametrize(("override", "expected"), [
    # a boolean is no count: `true` became 1 worker
    ("rollout.workers=true", "rollout.workers: Input should be a valid integer (got True)"),
    ("learner.lr=true", "learner.lr: Input should be a valid number (got True)"),
    ("learner.packing=1", "learner.packing: Input should be a valid boolean (got 1)"),
    ("rollout.group_size=2.0", "rollout.group_size: Input should be a valid integer (got 2.0)"),
    # an empty host bound every interface, or nothing
    ('buffer.host=""', "buffer.zmq.host: must be a host name or address"),
    ('buffer.zmq.host="tcp://h"', "buffer.zmq.host: must be a host name or address"),
    ('learner.master_addr=" "', "learner.master_addr: must be a host name or address"),
    # inf: an endless wait, or a traceback from threading's wait
    ("weights.timeout_s=inf", "weights.timeout_s: Input should be a finite number (got inf)"),
    ("launcher.refresh_s=inf", "launcher.refresh_s: Input should be a finite number (got inf)"),
    ("buffer.request_timeout_s=nan", "buffer.request_timeout_s: Input should be a finite number"),
    ("learner.grad_clip=-inf", "learner.grad_clip: Input should be a finite number"),
    ("launcher.refresh_s=1e300",
     f"launcher.refresh_s: Input should be less than or equal to {WEEK_S:g} (got 1e+300)"),
    # lr 1e308: NaN weights, then a bincount error in the engines
    ("learner.lr=1e308", "learner.lr: Input should be less than 1 (got 1e+308)"),
    ("learner.loss.critic_lr=2.0", "learner.loss.critic_lr: Input should be less than 1"),
    # sizes that exhaust the machine before anything names the key
    ("rollout.workers=1000000",
     "rollout.workers: Input should be less than or equal to 1024 (got 1000000)"),
    ("rollout.group_size=100000000",
     "rollout.group_size: Input should be less than or equal to 4096 (got 100000000)"),
    ("weights.bucket_mb=1e6", "weights.bucket_mb: Input should be less than or equal to 8192"),
    ("buffer.max_groups=10000000000", "buffer.max_groups: Input should be less than or equal"),
])
def test_a_bad_value_names_its_key_and_the_rule(override: str, expected: str) -> None:
    assert expected in _error(override)


def test_tiny_model_heads_must_divide_the_hidden_size() -> None:
    """Workers built such a model and crash-looped for minutes, naming no key."""
    assert "model.tiny.num_heads = 3 must divide model.tiny.hidden_size = 64" in \
        _error("model.tiny.num_heads=3")
    assert "model.tiny.num_kv_heads = 4 must divide model.tiny.num_heads = 2" in \
        _error("model.tiny.num_heads=2", "model.tiny.num_kv_heads=4")
    assert "model.tiny.num_kv_heads = 3 must divide model.tiny.num_heads = 4" in \
        _error("model.tiny.num_kv_heads=3")
    assert "model.tiny.hidden_size / model.tiny.num_heads = 9 must be even" in \
        _error("model.tiny.hidden_size=72", "model.tiny.num_heads=8", "model.tiny.num_kv_heads=8")


def test_the_buffer_must_hold_one_step() -> None:
    """The learner found out only deep in a traceback."""
    error = _error("buffer.max_groups=8", "learner.groups_per_step=32")
    assert "buffer.max_groups = 8 is below learner.groups_per_step = 32" in error
    assert load_config(None, ["buffer.max_groups=32", "learner.groups_per_step=32"])


def test_cross_section_problems_are_reported_together_one_line_each() -> None:
    error = _error("buffer.max_groups=8", "learner.node_rank=1",
                   "monitor.prometheus_port=9400", "learner.master_port=9402")
    lines = error.splitlines()[1:]
    assert [line.strip().split(" ")[0] for line in lines] == [
        "learner.node_rank", "buffer.max_groups", "learner.master_port"]


@pytest.mark.parametrize(("sets", "expected"), [
    (["monitor.prometheus_port=64511", "rollout.workers=1024"],
     "monitor.prometheus_port = 64511 with rollout.workers = 1024 needs ports up to 65536"),
    (["monitor.prometheus_port=9400", "buffer.zmq.port=9401"],
     "buffer.zmq.port = 9401 is also claimed by monitor.prometheus_port range"),
    (["launcher.max_restarts=40"], "launcher.restart_backoff_s = 1.0 doubled up to "
                                   "launcher.max_restarts = 40 times waits"),
    (["rollout.engine='vllm-server'", "rollout.url='http://a:1'"],
     "rollout.workers = 2 but rollout.url names 1 server(s)"),
    (["rollout.engine='vllm-server'", "rollout.url='a:1,b:1'", "rollout.workers=1"],
     "rollout.url = 'a:1,b:1': 'a:1' is not an http:// or https:// URL"),
    (["data.prompt_template='Q: {question'"], "data.prompt_template = 'Q: {question' is not a "
                                              "format string"),
    (["data.prompt_template='Q: {}'"], "data.prompt_template = 'Q: {}': {} is positional"),
    (["buffer.zmq.auth='curve'"], "buffer.zmq.auth = 'curve' needs buffer.zmq.curve_keys_dir"),
    (["buffer.redis.url='localhost:6379'"], "buffer.redis.url: String should match pattern"),
    (["run.name='..'"], "run.name = '..' would put the run directory outside run.output_dir"),
    (["model.tiny.extra_tokens=['a', 'a']"], "model.tiny.extra_tokens must be distinct"),
    (["learner.loss.drop_finish_reasons=['length', '']"],
     "learner.loss.drop_finish_reasons must be distinct, non-blank"),
    (["rollout.engine='vllm'", "rollout.vllm.mode='inprocess'", "weights.transport='ipc'",
      "learner.device='cuda'"], "weights.transport = 'ipc' with rollout.vllm.mode = "
                                "'inprocess': vLLM's worker would run in this process"),
    (["rollout.engine='vllm-server'", "rollout.vllm.data_parallel_size=2",
      "weights.transport='ipc'", "learner.device='cuda'"],
     "weights.transport = 'ipc' with rollout.engine = 'vllm-server' needs one vLLM worker"),
])
def test_keys_that_must_agree(sets: list[str], expected: str) -> None:
    assert expected in _error(*sets)


@pytest.mark.parametrize("engine", ["vllm", "vllm-server"])
def test_ipc_reaches_a_vllm_engine_of_its_own_process(engine: str) -> None:
    """``weights.transport = "ipc"`` with a vLLM engine core in a process of its own
    (AsyncLLM's, a server's) and one worker: accepted (rollouters.engines.vllm_ipc sends)."""
    cfg = load_config(None, [f"rollout.engine={engine}", "weights.transport=ipc",
                             "learner.device=cuda"])
    assert cfg.weights.transport == "ipc"


def test_a_rule_over_a_section_is_printed_once_without_a_section_prefix() -> None:
    """A section's own rule names its keys itself: no ``model.tiny: model.tiny.num_heads``."""
    error = _error("model.tiny.num_heads=3")
    assert error.splitlines()[1] == ("  model.tiny.num_heads = 3 must divide "
                                     "model.tiny.hidden_size = 64 (each head gets hidden_size "
                                     "/ num_heads dimensions)")


def test_the_defaults_and_every_shipped_config_still_load() -> None:
    root = Path(__file__).resolve().parents[2]
    load_config(None)
    for path in [*root.glob("configs/*.toml"), *root.glob("examples/**/*.toml")]:
        load_config(path)


@pytest.mark.parametrize("command", [
    ["up", "CONFIG"], ["up", "CONFIG", "--dry-run"], ["config", "show", "CONFIG"],
    ["buffer", "CONFIG"], ["learner", "CONFIG"], ["rollout", "CONFIG"], ["status", "CONFIG"],
    ["eval", "CONFIG", "--checkpoint", "/nonexistent"]])
def test_every_command_reports_a_bad_value_in_one_line(command: list[str]) -> None:
    """``launcher.refresh_s = inf`` reached `asyncrl up`'s user as a traceback."""
    root = Path(__file__).resolve().parents[2]
    quickstart = root / "configs" / "quickstart.toml"
    args = [str(quickstart) if arg == "CONFIG" else arg for arg in command]
    done = subprocess.run([sys.executable, "-m", "asyncrl.cli", *args,
                           "--set", "launcher.refresh_s=inf", "--set", "rollout.workers=true"],
                          cwd=root, text=True, capture_output=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr == (f"asyncrl: {quickstart}: invalid config\n"
                           "  rollout.workers: Input should be a valid integer (got True)\n"
                           "  launcher.refresh_s: Input should be a finite number (got inf)\n")
