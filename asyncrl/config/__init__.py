"""Configuration: one pydantic model per component, composed into :class:`Config`."""

from asyncrl.config.load import ConfigError, load_config, parse_overrides
from asyncrl.config.schema import (
    BufferConfig,
    Config,
    EvalConfig,
    LauncherConfig,
    LearnerConfig,
    ModelConfig,
    MonitorConfig,
    ResourcesConfig,
    RolloutConfig,
    RunConfig,
    SimConfig,
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
    "MonitorConfig",
    "ResourcesConfig",
    "RolloutConfig",
    "RunConfig",
    "SimConfig",
    "TaskConfig",
    "WeightsConfig",
    "load_config",
    "parse_overrides",
]
