"""Configuration: one pydantic model per component, composed into :class:`Config`."""

from asyncrl.config.load import ConfigError, load_config, parse_overrides
from asyncrl.config.schema import (
    BufferConfig,
    Config,
    EvalConfig,
    LauncherConfig,
    LearnerConfig,
    ModelConfig,
    RolloutConfig,
    RunConfig,
    TaskConfig,
    WeightsConfig,
)

__all__ = [
    "BufferConfig",
    "Config",
    "ConfigError",
    "EvalConfig",
    "LauncherConfig",
    "LearnerConfig",
    "ModelConfig",
    "RolloutConfig",
    "RunConfig",
    "TaskConfig",
    "WeightsConfig",
    "load_config",
    "parse_overrides",
]
