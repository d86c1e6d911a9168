"""monitor.sinks: jsonl always works; tensorboard and wandb are optional packages whose absence
is a clear error naming the key, before any role starts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from asyncrl.cli import main
from asyncrl.config import ConfigError
from asyncrl.config.schema import MonitorConfig
from asyncrl.metrics import read_jsonl
from asyncrl.sinks import make_sinks

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.toml"
HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
HAS_WANDB = importlib.util.find_spec("wandb") is not None
RECORDS = [{"step": 1, "time_s": 0.5, "critic/score/mean": 0.1, "note": "x"},
           {"step": 2, "time_s": 1.0, "critic/score/mean": 0.3},
           {"step": "final", "time_s": 1.2, "val/test_score/copy": 0.9}]


def test_jsonl_sink_writes_every_record(tmp_path: Path) -> None:
    sinks = make_sinks(MonitorConfig(), tmp_path)
    for record in RECORDS:
        sinks.write(record)
    sinks.close()
    assert read_jsonl(tmp_path / "metrics.jsonl") == RECORDS


def test_a_sink_listed_twice_is_rejected() -> None:
    with pytest.raises(ValueError, match="twice"):
        MonitorConfig(sinks=["jsonl", "jsonl"])


def _hide(monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    """Make ``package`` look uninstalled to the sinks' check (``make`` installs both, so the
    real sinks are tested too)."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == package else find_spec(name, *a))


def test_missing_tensorboard_names_the_key(tmp_path: Path, monkeypatch) -> None:
    _hide(monkeypatch, "tensorboard")
    with pytest.raises(ConfigError, match=r"monitor.sinks lists 'tensorboard'.*pip install "
                                          r"tensorboard"):
        make_sinks(MonitorConfig(sinks=["jsonl", "tensorboard"]), tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists()  # checked before any sink is opened


def test_missing_wandb_stops_up_before_anything_starts(tmp_path: Path, capsys,
                                                       monkeypatch) -> None:
    _hide(monkeypatch, "wandb")
    code = main(["up", str(QUICKSTART), "--set", f"run.output_dir={tmp_path}",
                 "--set", 'monitor.sinks=["jsonl", "wandb"]'])
    assert code == 2
    err = capsys.readouterr().err
    assert "monitor.sinks lists 'wandb'" in err and "pip install wandb" in err
    assert not any(tmp_path.iterdir())  # no run directory, no role started


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="needs the tensorboard package (extra `sinks`)")
def test_tensorboard_sink_writes_scalars(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sinks = make_sinks(MonitorConfig(sinks=["tensorboard"]), tmp_path)
    for record in RECORDS:
        sinks.write(record)
    sinks.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("critic/score/mean")] == \
        [(1, pytest.approx(0.1)), (2, pytest.approx(0.3))]
    assert [e.step for e in events.Scalars("val/test_score/copy")] == [2]  # final: last step


@pytest.mark.skipif(not HAS_WANDB, reason="needs the wandb package (extra `sinks`)")
def test_wandb_sink_offline(tmp_path: Path) -> None:
    sinks = make_sinks(MonitorConfig(sinks=["wandb"], wandb_mode="offline"), tmp_path, "t")
    for record in RECORDS:
        sinks.write(record)
    sinks.close()
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
