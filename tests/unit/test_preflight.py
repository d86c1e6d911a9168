"""The checks `asyncrl up` (and `status`, `monitor`) run before starting or asking anything."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.launch.preflight import (NotRunning, check_broker, check_startup, model_path_error,
                                      path_errors, plugin_errors)
from buffers.redis_connect import check_redis

ROOT = Path(__file__).resolve().parents[2]
SINGLE_TURN = ROOT / "examples" / "agent" / "single_turn.toml"


def closed_port() -> int:
    """A local port nothing listens on (bound once, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("path", ["/nonexistent/model", "./nope", "../nope", "~/nope-model",
                                  "runs/x/final"])
def test_a_missing_local_model_path_is_named(path: str) -> None:
    cfg = load_config(None, [f"model.path={path!r}"])
    assert f"model.path: {path!r} does not exist" in model_path_error(cfg.model)


@pytest.mark.parametrize("path", ["", "Qwen/Qwen2.5-0.5B-Instruct", "gpt2"])
def test_hub_ids_and_the_tiny_model_are_left_to_the_roles(path: str) -> None:
    assert model_path_error(load_config(None, [f"model.path={path!r}"]).model) is None


def test_an_existing_local_model_dir_passes(tmp_path: Path) -> None:
    assert model_path_error(load_config(None, [f"model.path={str(tmp_path)!r}"]).model) is None


def test_missing_data_files_are_all_named() -> None:
    cfg = load_config(SINGLE_TURN, ["data.path='nope.jsonl'", "data.eval_path='nope2.jsonl'"])
    assert path_errors(cfg) == ["data.path: 'nope.jsonl' does not exist",
                                "data.eval_path: 'nope2.jsonl' does not exist"]
    with pytest.raises(ConfigError, match="data.path: .*\ndata.eval_path: "):
        check_startup(cfg)


def test_digit_tasks_read_no_data_files() -> None:
    assert path_errors(load_config(None, ["data.path='nope.jsonl'"])) == []


def test_a_bad_env_import_path_names_its_key() -> None:
    cfg = load_config(ROOT / "examples" / "agent" / "multi_turn.toml",
                      ["workflow.env='examples.agent.env:Env'"])
    (error,) = plugin_errors(cfg)
    assert error.startswith("workflow.env: module 'examples.agent.env' has no attribute 'Env'")


def test_plugins_import_from_the_working_directory_like_the_roles(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The `asyncrl` console script lacks the working directory on sys.path; the roles, run as
    `python -m asyncrl.cli` there, have it: the check must import what they will import."""
    (tmp_path / "preflight_reward_plugin.py").write_text("def score(r, s):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    before = list(sys.path)
    good = load_config(SINGLE_TURN, ["reward.path='preflight_reward_plugin:score'"])
    bad = load_config(SINGLE_TURN, ["reward.path='preflight_reward_plugin:nope'"])
    assert plugin_errors(good) == []
    assert plugin_errors(bad)[0].startswith("reward.path: module 'preflight_reward_plugin' has "
                                            "no attribute 'nope'")
    assert sys.path == before


def test_a_refused_redis_url_is_reported_fast() -> None:
    url = f"redis://127.0.0.1:{closed_port()}/0"
    cfg = load_config(None, ["buffer.type='redis'", f"buffer.redis.url={url!r}"])
    start = time.monotonic()
    with pytest.raises(ConfigError, match=f"^buffer.redis.url: '{url}': .*refused"):
        check_redis(cfg.buffer)
    assert time.monotonic() - start < 10  # not the clients' 30 s of retries


def test_a_broker_that_is_gone_is_not_waited_for() -> None:
    start = time.monotonic()
    with pytest.raises(NotRunning, match="run 'done' is not running: no buffer broker at tcp"):
        check_broker(f"tcp://127.0.0.1:{closed_port()}", "done")
    assert time.monotonic() - start < 5


def test_a_listening_broker_passes() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        check_broker(f"tcp://127.0.0.1:{server.getsockname()[1]}", "live")
