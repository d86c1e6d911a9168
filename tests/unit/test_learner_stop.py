"""A learner stopped before it trained a step leaves nothing that looks like a result."""

from __future__ import annotations

import threading

import pytest

from asyncrl.config import load_config
from buffers.zmq_broker import start_broker_thread
from learners.dist import free_port
from learners.loop import run_learner_rank


@pytest.mark.timeout(120)
def test_a_learner_stopped_before_its_first_step_exports_nothing(tmp_path):
    """What a rollout fleet's config error does to a run (``up`` stops the learner at once):
    before, the learner still wrote a checkpoint, ``final/`` and a final eval of the untrained
    model, which looked like the outcome of a run that never started."""
    cfg = load_config(None, ["rollout.engine=sim", "learner.backend=sim",
                             "weights.transport=sim", f"run.output_dir={tmp_path}",
                             "run.name=never"])
    address, stop_broker = start_broker_thread(cfg.buffer, cfg.learner.groups_per_step,
                                               cfg.run.name)
    stop = threading.Event()
    stop.set()
    try:
        run_learner_rank(cfg, 0, 1, address, free_port(), stop)
    finally:
        stop_broker()
    run_dir = cfg.run_dir
    assert not (run_dir / "final").exists() and not (run_dir / "eval.json").exists()
    assert not list(run_dir.glob("checkpoints/step_*"))
