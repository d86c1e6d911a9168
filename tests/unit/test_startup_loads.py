"""What a role reads once as it starts: the tokenizer, and its dataset's rows.

A rollout worker's engine and producer, and learner rank 0's batch feed and evaluator, each
loaded the model's tokenizer for itself (two loads per worker of a workflow run, three on rank
0), and a worker checked every row of ``data.path`` twice: as it read the file, then again as
it built its samples. The roles here are the real ones, against a real ZMQ broker; loads are
counted by :func:`asyncrl.models.load_tokenizer`'s log line, row checks by a counting wrapper
around :func:`rollouters.tasks.data.row_problem`.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest

import rollouters.tasks.data as data
from asyncrl.config import load_config
from asyncrl.net import free_port
from buffers.zmq_broker import start_broker_thread

ROOT = Path(__file__).resolve().parents[2]
SINGLE_TURN = ROOT / "examples" / "agent" / "single_turn.toml"
ROWS = sum(1 for line in (ROOT / "examples" / "agent" / "data.jsonl").open() if line.strip())


def _loads(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "asyncrl.models" and r.getMessage().startswith("tokenizer of")]


def _config(tmp_path: Path, *extra: str):
    data_path = json.dumps(str(ROOT / "examples" / "agent" / "data.jsonl"))
    eval_path = json.dumps(str(ROOT / "examples" / "agent" / "eval.jsonl"))
    return load_config(SINGLE_TURN, [f"run.output_dir={json.dumps(str(tmp_path))}",
                                     f"data.path={data_path}", f"data.eval_path={eval_path}",
                                     "buffer.zmq.port=0", *extra])


@pytest.mark.timeout(120)
def test_a_rollout_worker_loads_its_tokenizer_once_and_checks_each_row_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The single-turn example: a torch engine (stops at the model's EOS ids) and a workflow
    (encodes prompts) share one tokenizer; the rows are checked as the file is read only."""
    from rollouters.worker import run_rollout_worker

    checks = []
    real = data.row_problem
    monkeypatch.setattr(data, "row_problem",
                        lambda *args, **kwargs: checks.append(1) or real(*args, **kwargs))
    cfg = _config(tmp_path)
    address, stop_broker = start_broker_thread(cfg.buffer, cfg.learner.groups_per_step,
                                               cfg.run.name)
    stop = threading.Event()
    ready = threading.Event()

    class Ready(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "ready (model" in record.getMessage():
                ready.set()
                stop.set()  # started: nothing more to see

    handler = Ready()
    logging.getLogger("rollouters.worker").addHandler(handler)
    caplog.set_level(logging.INFO)
    try:
        run_rollout_worker(cfg, 0, address, stop)
    finally:
        logging.getLogger("rollouters.worker").removeHandler(handler)
        stop_broker()
    assert ready.is_set()
    assert len(_loads(caplog)) == 1, _loads(caplog)
    assert len(checks) == ROWS  # one check per row of the file (rollout.workers = 1)


@pytest.mark.timeout(120)
def test_learner_rank_zero_loads_its_tokenizer_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Rank 0's batch feed (the pad id) and its evaluator (a workflow's episodes, the eval
    engine's EOS ids) share one tokenizer; it used to be loaded three times."""
    from learners.loop import run_learner_rank
    from rollouters.eval import EngineEvaluator

    cfg = _config(tmp_path, "learner.backend=sim", "rollout.engine=sim",
                  "weights.transport=sim")
    address, stop_broker = start_broker_thread(cfg.buffer, cfg.learner.groups_per_step,
                                               cfg.run.name)
    stop = threading.Event()
    stop.set()  # stopped before its first step: it starts, then ends at once
    caplog.set_level(logging.INFO)
    try:
        run_learner_rank(cfg, 0, 1, address, free_port(), stop, evaluator=EngineEvaluator)
    finally:
        stop_broker()
    assert len(_loads(caplog)) == 1, _loads(caplog)


def test_checked_rows_become_the_same_samples_without_a_second_check(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's samples from rows checked as they were read are those the checking path
    builds; only the count of checks differs."""
    from rollouters.tasks.data import DatasetSource, load_rows

    cfg = _config(tmp_path)
    rows = load_rows(cfg.data.path, data=cfg.data)
    checks = []
    real = data.row_problem
    monkeypatch.setattr(data, "row_problem",
                        lambda *args, **kwargs: checks.append(1) or real(*args, **kwargs))
    for shard in (0, 1):
        once = DatasetSource(rows, cfg.data, shard, 2, checked=True).samples
        assert not checks
        again = DatasetSource(rows, cfg.data, shard, 2).samples
        assert once == again and len(checks) == len(again)
        checks.clear()
