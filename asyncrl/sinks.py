"""Where the learner's per-step metrics records go (``monitor.sinks``).

``jsonl`` (``<run dir>/metrics.jsonl``) is what ``asyncrl plot`` and resumed runs read;
``tensorboard`` and ``wandb`` are optional packages, imported only when listed, so a missing
one is a clear error naming ``monitor.sinks`` at start, never an ImportError mid-run.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from asyncrl.config.load import ConfigError
from asyncrl.config.schema import MonitorConfig
from asyncrl.metrics import MetricsWriter

logger = logging.getLogger(__name__)

# sink → (module whose presence it needs, pip package)
OPTIONAL = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}


class MetricSink(Protocol):
    def write(self, record: Mapping[str, Any]) -> None: ...

    def started_from(self, version: int) -> None:
        """The learner goes on from ``version``, before its first record: records of later
        steps that the sink holds (a crashed learner's, an earlier run's) are another line."""

    def close(self) -> None: ...


def check_sinks(cfg: MonitorConfig) -> None:
    """Fail before anything starts when a listed sink's package is missing."""
    for sink in cfg.sinks:
        if sink in OPTIONAL and importlib.util.find_spec(OPTIONAL[sink][0]) is None:
            raise ConfigError(_missing(sink))


def _missing(sink: str) -> str:
    module, package = OPTIONAL[sink]
    return (f"monitor.sinks lists {sink!r} but the {module!r} package is not installed: "
            f"`pip install {package}`, or remove {sink!r} from monitor.sinks")


def _import(sink: str, module: str) -> Any:
    """Import a sink's module; a package that is installed but fails to import (a missing
    dependency of its own) is reported as such, not as absent."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if importlib.util.find_spec(OPTIONAL[sink][0]) is None:
            raise ConfigError(_missing(sink)) from exc
        raise ConfigError(f"monitor.sinks lists {sink!r}: its package is installed but "
                          f"importing {module!r} failed: {exc}") from exc


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The record's numeric values (``step``, ``time_s`` and strings left out)."""
    return {k: float(v) for k, v in record.items()
            if k not in ("step", "time_s") and isinstance(v, (int, float))}


class TensorBoardSink:
    """Scalars to ``<run dir>/tensorboard`` with torch's SummaryWriter, at the learner step;
    the final evaluation record (``step = "final"``) lands at the last step."""

    def __init__(self, log_dir: Path) -> None:
        _import("tensorboard", "tensorboard")
        self._summary_writer = _import("tensorboard", "torch.utils.tensorboard").SummaryWriter
        self.log_dir = log_dir
        self.writer = self._summary_writer(log_dir=str(log_dir))
        self.step = 0

    def started_from(self, version: int) -> None:
        """TensorBoard's own way: events of steps after ``version`` are purged from view."""
        self.writer.close()
        self.writer = self._summary_writer(log_dir=str(self.log_dir), purge_step=version + 1)
        self.step = version

    def write(self, record: Mapping[str, Any]) -> None:
        if isinstance(record.get("step"), int):
            self.step = record["step"]
        for name, value in scalars(record).items():
            self.writer.add_scalar(name, value, self.step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """One wandb run per asyncrl run, named after it, with the resolved config attached."""

    def __init__(self, cfg: MonitorConfig, run_dir: Path, run_name: str,
                 config: Mapping[str, Any]) -> None:
        wandb = _import("wandb", "wandb")
        self.run = wandb.init(project=cfg.wandb_project, name=run_name, dir=str(run_dir),
                              mode=cfg.wandb_mode, config=dict(config))
        self.step = 0

    def write(self, record: Mapping[str, Any]) -> None:
        if isinstance(record.get("step"), int):
            self.step = record["step"]
        self.run.log(scalars(record), step=self.step)

    def started_from(self, version: int) -> None:
        """Nothing to do: every ``asyncrl`` start is a wandb run of its own."""

    def close(self) -> None:
        self.run.finish()


class Sinks:
    """Every configured sink; a record goes to each in turn."""

    def __init__(self, sinks: Sequence[MetricSink]) -> None:
        self.sinks = list(sinks)

    def write(self, record: Mapping[str, Any]) -> None:
        for sink in self.sinks:
            sink.write(record)

    def started_from(self, version: int) -> None:
        for sink in self.sinks:
            sink.started_from(version)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def make_sinks(cfg: MonitorConfig, run_dir: Path, run_name: str = "run",
               config: Mapping[str, Any] | None = None) -> Sinks:
    """The sinks ``monitor.sinks`` lists, in order."""
    check_sinks(cfg)
    made: list[MetricSink] = []
    for sink in cfg.sinks:
        if sink == "jsonl":
            made.append(MetricsWriter(run_dir / "metrics.jsonl"))
        elif sink == "tensorboard":
            made.append(TensorBoardSink(run_dir / "tensorboard"))
        else:
            made.append(WandbSink(cfg, run_dir, run_name, config or {}))
        logger.info("metrics sink: %s", sink)
    return Sinks(made)
