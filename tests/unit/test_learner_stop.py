"""A learner stopped before it trained a step leaves nothing that looks like a result."""

from __future__ import annotations

import threading

import pytest

from asyncrl.config import load_config
from asyncrl.net import ReservedPort, free_port
from buffers.zmq_broker import start_broker_thread
from learners.loop import run_learner_rank
from rollouters.eval import EngineEvaluator
from tests.ranks import run_ranks


@pytest.mark.timeout(120)
def test_a_learner_stopped_before_its_first_step_exports_nothing(tmp_path):
    """What a rollout fleet's config error does to a run (``up`` stops the learner at once):
    before, the learner still wrote a checkpoint, ``final/`` and a final eval of the untrained
    model, which looked like the outcome of a run that never started."""
    cfg = load_config(None, ["rollout.engine=sim", "learner.backend=sim",
                             "weights.transport=sim", f"run.output_dir={tmp_path}",
                             "run.name=never", "buffer.zmq.port=0"])
    address, stop_broker = start_broker_thread(cfg.buffer, cfg.learner.groups_per_step,
                                               cfg.run.name)
    stop = threading.Event()
    stop.set()
    try:
        run_learner_rank(cfg, 0, 1, address, free_port(), stop, evaluator=EngineEvaluator)
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
    from learners.lifecycle import reached_before

    cfg = load_config(None, [f"eval.stop_at_accuracy={target}"] if target is not None else [])
    recorded = {"version": 7, "score": 0.9, "target": 0.9}
    meta = CheckpointMeta(7, 0.0, "", 1, counters={"eval_target": recorded})
    assert reached_before(cfg, meta) == (recorded if finishes else None)
    assert reached_before(cfg, CheckpointMeta(7, 0.0, "", 1)) is None
    assert reached_before(cfg, None) is None


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the save before the group
def test_a_checkpoint_of_the_last_step_not_marked_finished_resumes_into_the_runs_end(tmp_path):
    """The learner died (or lost its buffer) after the checkpoint of its last step, before
    the run's end: `asyncrl up` resumes it (it used to archive it and start a new run), and the
    learner trains no step, exports, runs the final eval and marks the run done. Records of
    steps after the checkpoint's (the buffer did not outlive the learner) are set aside."""
    from asyncrl.launch.run_dir import is_resuming
    from asyncrl.metrics import read_jsonl
    from asyncrl.models import prepare_model_dir
    from buffers.protocol import DONE, RUN_STATUS_KEY
    from buffers.zmq_client import ZmqBufferClient
    from learners import lifecycle
    from learners.backends import make_trainer
    from learners.checkpoint import Checkpointer, read_meta, step_dirs

    cfg = load_config(None, ["rollout.engine=sim", "learner.backend=sim",
                             "weights.transport=sim", f"run.output_dir={tmp_path}",
                             "run.name=last", "learner.total_steps=3", "checkpoint.resume=true",
                             "buffer.zmq.port=0"])
    trainer = make_trainer(prepare_model_dir(cfg.model, cfg.run_dir, cfg.run.seed),
                           cfg.learner, "cpu", sim=cfg.sim, lora=cfg.model.lora)
    trainer.version = 3
    Checkpointer(cfg).save(trainer, lifecycle.counters(cfg, 3, {}))   # as checkpoint.every_steps
    assert is_resuming(cfg)
    # The dead learner's records: the steps 4 and 5 of a line the buffer lost (this broker is
    # a fresh one, seeded with version 3), and a last line torn by its death.
    metrics = cfg.run_dir / "metrics.jsonl"
    metrics.write_bytes(b"".join(b'{"step": %d}\n' % s for s in range(1, 6)) + b'{"step": 6,')

    address, stop_broker = start_broker_thread(cfg.buffer, cfg.learner.groups_per_step,
                                               cfg.run.name)
    try:
        run_learner_rank(cfg, 0, 1, address, free_port(), evaluator=EngineEvaluator)
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


def _group(i: int, run_id: str):
    from asyncrl.wire import TrajectoryGroup

    samples = [{"tokens": [5, 6, 7, 8], "logprobs": [0, 0, -1.0, -1.0],
                "loss_mask": [0, 0, 1, 1], "versions": [-1, -1, 0, 0], "reward": float(j),
                "finish_reason": "stop"} for j in range(2)]
    return TrajectoryGroup.from_samples(f"g{i}", f"p{i}", samples, run_id=run_id)


def _two_ranks(args: list[str], target, *extra, groups: int = 2) -> dict:
    """``target(rank, args, address, port, *extra, results)`` spawned on two ranks against a
    real broker holding ``groups`` groups; what each rank put in ``results``."""
    import torch.multiprocessing as mp

    from buffers.zmq_client import ZmqBufferClient

    cfg = load_config(None, args)
    address, stop_broker = start_broker_thread(cfg.buffer, cfg.learner.groups_per_step,
                                               cfg.run.name)
    try:
        with ZmqBufferClient(address, timeout_s=10) as client:
            assert all(client.put("w", _group(i, cfg.run.name)).accepted
                       for i in range(groups))
        results = mp.Manager().dict()
        with ReservedPort() as port:
            run_ranks(target, args=(args, address, port, *extra, results), nprocs=2)
        return dict(results)
    finally:
        stop_broker()


def _rank_told_alone(rank: int, args: list[str], address: str, port: int, after_step: bool,
                     results) -> None:
    """One learner rank; rank 1 alone is told to stop: at once, or once step 1 is recorded."""
    import time

    stop = threading.Event()
    cfg = load_config(None, args)
    if rank == 1 and not after_step:
        stop.set()
    elif rank == 1:
        def stop_after_step_1() -> None:
            metrics = cfg.run_dir / "metrics.jsonl"
            while not (metrics.exists() and b'"step":1' in metrics.read_bytes()):
                time.sleep(0.05)
            stop.set()
        threading.Thread(target=stop_after_step_1, daemon=True).start()
    try:
        run_learner_rank(cfg, rank, 2, address, port, stop, evaluator=EngineEvaluator)
        results[rank] = "returned"
    except Exception as exc:  # noqa: BLE001 (the test reads what each rank met)
        results[rank] = f"{type(exc).__name__}: {exc}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("after_step", [False, True])
def test_a_stop_told_to_one_rank_stops_the_run_resumably(tmp_path, after_step):
    """A signal reaching one node's learner ranks alone (rank 1 here) stops every rank, as
    agreed in the step's collectives, and the run stays resumable. Rank 0 used to decide on
    its own, unset, stop event: after a step it marked the checkpoint finished, set the run's
    status to done (its rollouts ended) and exported, so ``asyncrl up`` started a new run
    instead of resuming; before a step it went on to save while rank 1 had left, and failed
    with the process group."""
    import torch.multiprocessing as mp

    from asyncrl.launch.run_dir import is_resuming
    from buffers.protocol import RUN_STATUS_KEY, RUNNING
    from buffers.zmq_client import ZmqBufferClient
    from learners.checkpoint import read_meta, step_dirs

    args = ["rollout.engine=sim", "learner.backend=sim", "weights.transport=sim",
            f"run.output_dir={tmp_path}", "run.name=one-told", "learner.groups_per_step=2",
            "learner.total_steps=50", "eval.every_steps=0", "checkpoint.every_steps=0",
            "learner.collective_timeout_s=60", "buffer.zmq.port=0"]
    cfg = load_config(None, args)
    address, stop_broker = start_broker_thread(cfg.buffer, cfg.learner.groups_per_step,
                                               cfg.run.name)
    try:
        with ZmqBufferClient(address, timeout_s=10) as client:
            if after_step:  # one step's groups: rank 0 then waits for data until the stop
                assert all(client.put("w", _group(i, cfg.run.name)).accepted for i in (0, 1))
        results = mp.Manager().dict()
        with ReservedPort() as port:
            run_ranks(_rank_told_alone, args=(args, address, port, after_step, results),
                      nprocs=2)
        assert dict(results) == {0: "returned", 1: "returned"}
        with ZmqBufferClient(address, timeout_s=10) as client:
            status = client.get_key(RUN_STATUS_KEY)
            assert status is None or status[1]["status"] == RUNNING, status
    finally:
        stop_broker()
    # a stopped run exports what it trained and evaluates it (not before a step)
    assert (cfg.run_dir / "final").exists() == after_step
    assert (cfg.run_dir / "eval.json").exists() == after_step
    saved = step_dirs(cfg.run_dir / "checkpoints")
    if after_step:
        (version, path), = saved
        assert version == 1 and read_meta(path).counters["finished"] is False
        assert is_resuming(cfg)
    else:
        assert saved == [] and not list((cfg.run_dir / "checkpoints").glob("*.tmp"))


def _rank_zero_fails(rank: int, args: list[str], address: str, port: int, results) -> None:
    """One learner rank; rank 0's step report raises (as a failed weight delivery or eval
    would), on rank 0 alone."""
    import time

    from learners.rank_zero import RankZero

    if rank == 0:
        def fail(*_args, **_kwargs):
            raise RuntimeError("rank 0 alone failed")
        RankZero.publish = fail
    start = time.monotonic()
    try:
        run_learner_rank(load_config(None, args), rank, 2, address, port,
                         evaluator=EngineEvaluator)
        results[rank] = ("returned", time.monotonic() - start)
    except Exception as exc:  # noqa: BLE001 (the test reads what each rank met)
        results[rank] = (f"{type(exc).__name__}: {exc}", time.monotonic() - start)


@pytest.mark.timeout(240)
def test_an_error_on_one_rank_ends_every_rank_at_once(tmp_path):
    """Rank 0 fails alone after a step; rank 1 waits in the end-of-step agreement. Rank 0
    used to go into the shutdown barrier, another collective than rank 1's: the two either
    waited out ``learner.collective_timeout_s`` (seen with a plain gloo pair) or,
    as here, rank 0's own error was replaced by the barrier's "Connection closed by peer".
    Now rank 0 leaves with its own error and rank 1 follows at once with GroupLeft."""
    timeout_s = 90
    args = ["rollout.engine=sim", "learner.backend=sim", "weights.transport=sim",
            f"run.output_dir={tmp_path}", "run.name=alone", "learner.groups_per_step=2",
            "learner.total_steps=50", "eval.every_steps=0", "checkpoint.every_steps=0",
            f"learner.collective_timeout_s={timeout_s}", "buffer.zmq.port=0"]
    results = _two_ranks(args, _rank_zero_fails)
    (zero, zero_s), (one, one_s) = results[0], results[1]
    assert zero == "RuntimeError: rank 0 alone failed", zero
    assert one.startswith("GroupLeft: learner rank 1/2: another rank left"), one
    assert max(zero_s, one_s) < timeout_s / 2, (zero_s, one_s)


def _rank_zero_stopped_at_the_end(rank: int, args: list[str], address: str, port: int,
                                  results) -> None:
    """One learner rank; rank 0's end of run (after the last collective) meets a buffer that
    no longer answers a stopping role, as when the buffer hangs while the learner stops."""
    from buffers import BufferStopped
    from learners.rank_zero import RankZero

    if rank == 0:
        def finish(*_args, **_kwargs):
            raise BufferStopped("stopped waiting for the reply to 'get_keys': stopping")
        RankZero.finish = finish
    try:
        run_learner_rank(load_config(None, args), rank, 2, address, port,
                         evaluator=EngineEvaluator)
        results[rank] = "returned"
    except Exception as exc:  # noqa: BLE001 (the test reads what each rank met)
        results[rank] = f"{type(exc).__name__}: {exc}"


@pytest.mark.timeout(240)
def test_a_stop_in_rank_zeros_end_of_run_still_meets_the_others_at_the_barrier(tmp_path):
    """Rank 0 alone talks to the buffer after the last collective (final eval, run status,
    the weight delivery's close). A BufferStopped there (seen on a loaded CI machine: Ctrl-C
    to a two-rank learner whose buffer hung) made rank 0 skip the shutdown barrier that rank 1
    waited in: rank 1 failed with "Connection closed by peer" and the learner exited 1 on a
    stop. Now rank 0 meets rank 1 there and then raises its stop; rank 1 returns."""
    args = ["rollout.engine=sim", "learner.backend=sim", "weights.transport=sim",
            f"run.output_dir={tmp_path}", "run.name=end", "learner.groups_per_step=2",
            "learner.total_steps=1", "eval.every_steps=0", "checkpoint.every_steps=0",
            "learner.collective_timeout_s=60", "buffer.zmq.port=0"]
    assert _two_ranks(args, _rank_zero_stopped_at_the_end) == {
        0: "BufferStopped: stopped waiting for the reply to 'get_keys': stopping",
        1: "returned"}
