"""Config: TOML + --set overrides, and errors that name the key path and what is allowed."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import tomllib

from asyncrl.config import ConfigError, load_config, parse_overrides
from asyncrl.config.load import to_toml, validate_config
from asyncrl.config.resolve import LEGACY_KEYS

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_and_overrides_typed() -> None:
    cfg = load_config(None, ["learner.lr=1e-4", "run.name=my-run", "buffer.max_staleness=0",
                             "learner.advantage_std_norm=false"])
    assert cfg.learner.lr == 1e-4
    assert cfg.run.name == "my-run"
    assert cfg.buffer.max_staleness == 0
    assert cfg.learner.advantage_std_norm is False


def test_quickstart_config_loads() -> None:
    cfg = load_config(ROOT / "configs" / "quickstart.toml")
    assert cfg.rollout.workers == 2 and cfg.buffer.max_staleness == 2


def test_override_wins_over_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[learner]\nlr = 0.5\n")
    assert load_config(path).learner.lr == 0.5
    assert load_config(path, ["learner.lr=0.25"]).learner.lr == 0.25


@pytest.mark.parametrize(("override", "expected"), [
    ("buffer.nope=1", "buffer.nope: unknown key (allowed in [buffer]:"),
    ("nosection.x=1", "nosection: unknown key (allowed in [root]:"),
    ("learner.lr=-1", "learner.lr: Input should be greater than 0 (got -1)"),
    ("buffer.type=kafka", "buffer.type: Input should be 'zmq' or 'redis' (got 'kafka')"),
    ("rollout.workers=many", "rollout.workers: Input should be a valid integer"),
    ("learner.node_rank=1", "learner.node_rank (1) must be below learner.nnodes (1)"),
    ("learner.nnodes=2", "learner.nnodes > 1 needs a fixed learner.master_port"),
    ("launcher.type=k8s", "launcher.type: Input should be 'local' or 'ray' (got 'k8s')"),
    ("launcher.max_restarts=-1", "launcher.max_restarts: Input should be greater than or equal"),
    ("resources.rollout.gpus=-1", "resources.rollout.gpus: Input should be greater than or equal"),
])
def test_errors_name_the_key(override: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert expected in str(info.value)


def test_deepspeed_takes_the_checkpoint_settings() -> None:
    """DeepSpeed writes training checkpoints too (``learners.checkpoint``, its own format)."""
    cfg = load_config(None, ["learner.backend=deepspeed", "checkpoint.every_steps=5",
                             "checkpoint.resume=true"])
    assert (cfg.learner.backend, cfg.checkpoint.every_steps, cfg.checkpoint.resume) == \
        ("deepspeed", 5, True)


def test_unknown_key_lists_allowed_keys() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["buffer.zmq.prot=1"])
    assert "allowed in [buffer.zmq]:" in str(info.value)
    assert "port" in str(info.value) and "spill_path" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(None, ["buffer.max_stalenes=1"])
    assert "max_staleness" in str(info.value) and "zmq" in str(info.value)


def test_all_errors_reported_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["learner.lr=0", "rollout.temperature=-1"])
    assert "learner.lr" in str(info.value) and "rollout.temperature" in str(info.value)


@pytest.mark.parametrize("bad", ["learner", "=3", "a..b=1"])
def test_malformed_set(bad: str) -> None:
    with pytest.raises(ConfigError, match="expected section.key=value"):
        parse_overrides([bad])


def test_missing_file_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "none.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[learner\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(bad)


def test_resolved_toml_round_trips() -> None:
    cfg = load_config(None, ["eval.stop_at_accuracy=0.9", "run.name=x"])
    again = validate_config(tomllib.loads(to_toml(cfg)))
    assert again == cfg


def test_free_form_env_args_round_trip_through_the_run_directorys_toml(tmp_path: Path
                                                                      ) -> None:
    """``workflow.env_args`` is the user's: an array of tables, keys that are not bare, text
    past U+FFFF or with DEL. The resolved config written to the run directory used to raise
    (TypeError on the array of tables) or come out as TOML that does not parse."""
    path = tmp_path / "env.toml"
    path.write_text('[workflow.env_args]\n"max turns" = 4\ngreeting = "hi \\U0001F600 \\u007f"\n'
                    'tools = [{name = "calc", "max calls" = 3}]\n'
                    '[workflow.env_args.nested]\n"a.b" = [1, 2.5e-06, true]\n',
                    encoding="utf-8")
    cfg = load_config(path)
    assert cfg.workflow.env_args["tools"] == [{"name": "calc", "max calls": 3}]
    again = validate_config(tomllib.loads(to_toml(cfg)))
    assert again == cfg and again.workflow.env_args["greeting"] == "hi \U0001F600 \x7f"


def test_a_config_file_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes('[run]\nname = "caf\u00e9"\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1.toml: not UTF-8 text, as TOML must be "
                                          r"\(byte 17: b'\\xe9'\)"):
        load_config(path)


def test_ray_launcher_and_resources_config() -> None:
    cfg = load_config(None, ["launcher.type=ray", "launcher.address=127.0.0.1:6379",
                             "resources.learner.gpus=1", "resources.rollout.cpus=2"])
    assert (cfg.launcher.type, cfg.launcher.address) == ("ray", "127.0.0.1:6379")
    assert (cfg.resources.learner.gpus, cfg.resources.learner.cpus) == (1.0, 1.0)
    assert cfg.resources.rollout.cpus == 2.0 and cfg.launcher.max_restarts == 3


# A value away from the default for every key that has a flat legacy name, by its new name.
MOVED = {
    "buffer.zmq.host": "0.0.0.0", "buffer.zmq.port": 6000, "buffer.zmq.auth": "curve",
    "buffer.zmq.curve_keys_dir": "keys", "buffer.zmq.spill_path": "spill.log",
    "buffer.zmq.io_threads": 3, "buffer.zmq.reconnect_s": 5.0,
    "buffer.redis.url": "rediss://r:6380/0", "buffer.redis.namespace": "team:x",
    "buffer.redis.cluster": "no", "buffer.redis.username": "u", "buffer.redis.password": "p",
    "buffer.redis.tls_ca_file": "ca.crt", "buffer.redis.tls_cert_file": "c.crt",
    "buffer.redis.tls_key_file": "c.key",
    "rollout.vllm.kv_cache_memory_mb": 128, "rollout.vllm.gpu_memory_utilization": 0.7,
    "rollout.vllm.enforce_eager": False, "rollout.sglang.module": "my.server",
    "rollout.sglang.args": ["--x", "1"], "rollout.sglang.server_start_timeout_s": 30.0,
}
RESOLVE_LOGGER = "asyncrl.config.resolve"


def _write_toml(path: Path, values: dict[str, Any]) -> Path:
    """``values`` as TOML dotted keys (JSON's scalars and arrays of strings are TOML's)."""
    path.write_text("".join(f"{key} = {json.dumps(value)}\n" for key, value in values.items()),
                    encoding="utf-8")
    return path


def _nested(values: dict[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for key, value in values.items():
        *parents, leaf = key.split(".")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == RESOLVE_LOGGER]


def test_flat_legacy_keys_and_per_backend_keys_resolve_to_the_same_config(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Every flat key of the earlier layout still works: mapped to its new place, each named
    once in a warning, the config equal to the one written in the new layout."""
    assert sorted(MOVED) == sorted(LEGACY_KEYS.values())  # every legacy key is covered
    legacy = {old: MOVED[new] for old, new in LEGACY_KEYS.items()}
    selected = {"buffer.type": "redis", "rollout.engine": "sglang"}
    with caplog.at_level(logging.WARNING, logger=RESOLVE_LOGGER):
        new_cfg = load_config(_write_toml(tmp_path / "new.toml", {**selected, **MOVED}))
        assert not [m for m in _messages(caplog) if "deprecated" in m]
        old_cfg = load_config(_write_toml(tmp_path / "old.toml", {**selected, **legacy}))
    assert old_cfg == new_cfg
    assert new_cfg.buffer.redis.url == "rediss://r:6380/0"
    assert new_cfg.rollout.sglang.args == ["--x", "1"]
    deprecated = [m for m in _messages(caplog) if "deprecated" in m]
    assert sorted(deprecated) == sorted(f"{old} is deprecated: now {new} (mapped)"
                                        for old, new in LEGACY_KEYS.items())
    # The same through --set, and through validate_config (a raw dict, as deploy tests use).
    sets = [f"{key}={json.dumps(value)}" for key, value in {**selected, **legacy}.items()]
    assert load_config(None, sets) == new_cfg
    assert validate_config(_nested({**selected, **legacy})) == new_cfg


@pytest.mark.parametrize("sets", [
    ["buffer.port=6000", "buffer.zmq.port=6001"],
    ["rollout.sglang_args=[\"--a\"]", "rollout.sglang.args=[\"--b\"]"],
])
def test_an_old_and_a_new_key_set_to_different_values_is_an_error_naming_both(
        tmp_path: Path, sets: list[str]) -> None:
    old, new = (item.partition("=")[0] for item in sets)
    with pytest.raises(ConfigError, match=rf"{old} = .* and {new} = .* are both set"):
        load_config(None, sets)
    path = _write_toml(tmp_path / "both.toml", {k: json.loads(v) for k, _, v in
                                                (item.partition("=") for item in sets)})
    with pytest.raises(ConfigError, match=rf"both.toml: {old} = .* and {new} = .*"):
        load_config(path)


def test_an_old_and_a_new_key_that_agree_or_come_from_file_and_override_are_no_conflict(
        tmp_path: Path) -> None:
    """The same value under both names is no conflict; and the file and the overrides are
    mapped apart, so ``--set buffer.zmq.port`` wins over a file's ``buffer.port`` as any
    override wins (what `asyncrl up` does for a restarted broker)."""
    assert load_config(None, ["buffer.port=6000", "buffer.zmq.port=6000"]).buffer.zmq.port == 6000
    path = _write_toml(tmp_path / "old.toml", {"buffer.port": 6000})
    assert load_config(path, ["buffer.zmq.port=7000"]).buffer.zmq.port == 7000
    path = _write_toml(tmp_path / "new.toml", {"buffer.zmq.port": 6000})
    assert load_config(path, ["buffer.port=7000"]).buffer.zmq.port == 7000


def test_keys_of_a_backend_not_selected_are_named_as_ignored(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=RESOLVE_LOGGER):
        load_config(None, ["buffer.redis.url=redis://elsewhere:6379/0",
                           "buffer.redis.namespace=team", "rollout.vllm.enforce_eager=false",
                           "buffer.zmq.port=6000"])
    assert _messages(caplog) == [
        "buffer.redis.url, buffer.redis.namespace ignored: buffer.type = 'zmq' does not read "
        "[buffer.redis]",
        "rollout.vllm.enforce_eager ignored: rollout.engine = 'torch' does not read "
        "[rollout.vllm]"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=RESOLVE_LOGGER):
        load_config(None, ["buffer.type=redis", "buffer.redis.url=redis://elsewhere:6379/0",
                           "rollout.engine=vllm", "rollout.vllm.enforce_eager=false",
                           "buffer.zmq.port=5555"])  # the default: changes nothing, not named
    assert _messages(caplog) == []


def test_the_resolved_config_round_trips_through_load_config_in_the_new_layout(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """What `asyncrl config show` prints and every run directory's config.toml holds: the new
    layout, which loads back to the same config with no warning."""
    legacy = {old: MOVED[new] for old, new in LEGACY_KEYS.items()
              if new.startswith(("buffer.redis.", "rollout.sglang."))}
    cfg = load_config(_write_toml(tmp_path / "old.toml",
                                  {"buffer.type": "redis", "rollout.engine": "sglang", **legacy}))
    text = to_toml(cfg)
    assert "[buffer.redis]" in text and "[rollout.sglang]" in text
    assert "\nurl = \"rediss://r:6380/0\"" in text and "sglang_args" not in text
    (tmp_path / "config.toml").write_text(text, encoding="utf-8")
    (tmp_path / "defaults.toml").write_text(to_toml(load_config(None)), encoding="utf-8")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=RESOLVE_LOGGER):
        again = load_config(tmp_path / "config.toml")
        assert load_config(tmp_path / "defaults.toml") == load_config(None)
    assert again == cfg
    assert _messages(caplog) == []  # every key written, none deprecated or ignored


def test_the_rendered_config_leaves_out_the_backends_not_selected(
        caplog: pytest.LogCaptureFixture) -> None:
    """Every role `asyncrl up` starts reads the run directory's config.toml: a sub-table of a
    backend not selected is left out of it, so the user hears of its keys once (from `up`),
    not again from every role."""
    with caplog.at_level(logging.WARNING, logger=RESOLVE_LOGGER):
        cfg = load_config(None, ["buffer.type=redis", "buffer.zmq.port=0",
                                 "rollout.engine=torch", "rollout.vllm.enforce_eager=false"])
    assert len(_messages(caplog)) == 2  # said once, here
    text = to_toml(cfg)
    assert "[buffer.redis]" in text
    assert "[buffer.zmq]" not in text and "[rollout.vllm]" not in text
    assert "[rollout.sglang]" not in text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=RESOLVE_LOGGER):
        again = validate_config(tomllib.loads(text))
    assert _messages(caplog) == []
    assert again.buffer.redis == cfg.buffer.redis and again.rollout.workers == cfg.rollout.workers
