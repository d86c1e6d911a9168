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


@pytest.mark.parametrize(("target", "finishes"), [(0.9, True), (0.8, True), (0.95, False),
                                                  (None, False)])
def test_a_resume_finishes_only_while_the_recorded_score_meets_the_target(target, finishes):
    """A checkpoint saved when the eval target was reached (a stop in that very step) resumes
    into the run's end, unless ``eval.stop_at_accuracy`` was raised past the recorded score,
    or unset, since: then it trains on. A checkpoint without the record trains on."""
    from learners.checkpoint import CheckpointMeta
    from learners.loop import _reached_before

    cfg = load_config(None, [f"eval.stop_at_accuracy={target}"] if target is not None else [])
    recorded = {"version": 7, "score": 0.9, "target": 0.9}
    meta = CheckpointMeta(7, 0.0, "", 1, counters={"eval_target": recorded})
    assert _reached_before(cfg, meta) == (recorded if finishes else None)
    assert _reached_before(cfg, CheckpointMeta(7, 0.0, "", 1)) is None
    assert _reached_before(cfg, None) is None


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the save before the group
def test_a_checkpoint_of_the_last_step_not_marked_finished_resumes_into_the_runs_end(tmp_path):
    """The learner died (or lost its buffer) after the checkpoint of its last step, before
    the run's end: `asyncrl up` resumes it (it used to archive it and start a new run), and the
    learner trains no step, exports, runs the final eval and marks the run done. Records of
    steps after the checkpoint's (the buffer did not outlive the learner) are set aside."""
    from asyncrl.launch import is_resuming
    from asyncrl.metrics import read_jsonl
    from asyncrl.models import prepare_model_dir
    from buffers.protocol import DONE, RUN_STATUS_KEY
    from buffers.zmq_client import ZmqBufferClient
    from learners import loop
    from learners.backends import make_trainer
    from learners.checkpoint import Checkpointer, read_meta, step_dirs

    cfg = load_config(None, ["rollout.engine=sim", "learner.backend=sim",
                             "weights.transport=sim", f"run.output_dir={tmp_path}",
                             "run.name=last", "learner.total_steps=3", "checkpoint.resume=true"])
    trainer = make_trainer(prepare_model_dir(cfg.model, cfg.run_dir, cfg.run.seed),
                           cfg.learner, "cpu", sim=cfg.sim, lora=cfg.model.lora)
    trainer.version = 3
    Checkpointer(cfg).save(trainer, loop._counters(cfg, 3, {}))   # as checkpoint.every_steps
    assert is_resuming(cfg)
    # The dead learner's records: the steps 4 and 5 of a line the buffer lost (this broker is
    # a fresh one, seeded with version 3), and a last line torn by its death.
    metrics = cfg.run_dir / "metrics.jsonl"
    metrics.write_bytes(b"".join(b'{"step": %d}\n' % s for s in range(1, 6)) + b'{"step": 6,')

    address, stop_broker = start_broker_thread(cfg.buffer, cfg.learner.groups_per_step,
                                               cfg.run.name)
    try:
        run_learner_rank(cfg, 0, 1, address, free_port())
        with ZmqBufferClient(address, timeout_s=10) as client:
            assert client.get_key(RUN_STATUS_KEY)[1] == {"status": DONE}
    finally:
        stop_broker()
    (version, path), = step_dirs(cfg.run_dir / "checkpoints")
    assert version == 3 and read_meta(path).counters["finished"] is True
    assert (cfg.run_dir / "final").is_dir() and (cfg.run_dir / "eval.json").exists()
    assert not is_resuming(cfg)
    assert [r["step"] for r in read_jsonl(metrics)] == [1, 2, 3, "final"]
    (aside,) = cfg.run_dir.glob("metrics.superseded-*.jsonl")
    assert [r["step"] for r in read_jsonl(aside)] == [4, 5]
