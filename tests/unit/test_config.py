"""Config: TOML + --set overrides, and errors that name the key path and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from asyncrl.config import ConfigError, load_config, parse_overrides
from asyncrl.config.load import to_toml, validate_config

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
        load_config(None, ["buffer.prot=1"])
    assert "port" in str(info.value) and "max_staleness" in str(info.value)


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
