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


def _steps(path: Path) -> list:
    return [r["step"] for r in read_jsonl(path)]


def test_a_torn_last_line_is_cut_before_the_next_record(tmp_path: Path) -> None:
    """A learner killed mid-write left half a line; appended to as it was, the first record
    of the resumed learner joined it and was lost too."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n{"step": 2}\n{"step": 3, "actor/lo')
    sinks = make_sinks(MonitorConfig(), tmp_path)
    sinks.write({"step": 3, "actor/loss": 0.5})
    sinks.close()
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}, {"step": 3, "actor/loss": 0.5}]


def test_a_learner_going_on_from_an_earlier_step_sets_the_later_records_aside(
        tmp_path: Path) -> None:
    """Records of steps 4..5 and a final eval, then a learner that goes on from version 3
    (its checkpoint, with a buffer that did not outlive the one before): they move aside,
    and the file keeps one record per step. Before, steps 4 and 5 had two records each."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"".join(b'{"step": %d}\n' % s for s in range(1, 6))
                     + b'{"step": "final"}\n')
    sinks = make_sinks(MonitorConfig(), tmp_path)
    sinks.started_from(3)
    for step in (4, 5):
        sinks.write({"step": step, "line": "new"})
    sinks.close()
    assert _steps(path) == [1, 2, 3, 4, 5]
    assert {r.get("line") for r in read_jsonl(path)[3:]} == {"new"}
    (aside,) = tmp_path.glob("metrics.superseded-*.jsonl")
    assert _steps(aside) == [4, 5, "final"]

    again = make_sinks(MonitorConfig(), tmp_path)
    again.started_from(5)  # nothing later: nothing moved
    again.close()
    assert _steps(path) == [1, 2, 3, 4, 5] and len(list(tmp_path.glob("*.superseded-*"))) == 1


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="needs the tensorboard package (extra `sinks`)")
def test_tensorboard_hides_the_steps_after_the_one_a_learner_goes_on_from(tmp_path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = MonitorConfig(sinks=["tensorboard"])
    first = make_sinks(config, tmp_path)
    for step in range(1, 6):
        first.write({"step": step, "critic/score/mean": 0.1})
    first.close()
    second = make_sinks(config, tmp_path)
    second.started_from(3)
    second.write({"step": 4, "critic/score/mean": 0.9})
    second.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, round(e.value, 3)) for e in events.Scalars("critic/score/mean")] == \
        [(1, 0.1), (2, 0.1), (3, 0.1), (4, 0.9)]
