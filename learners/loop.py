"""The learner driver: consume a batch, step, broadcast weights, publish the version.

One step of :func:`_train` at version V, on every rank::

    fetch       _next_batch: rank 0 holds the batch of V (prefetched during the step before);
                the ranks agree it came, or to stop, or that the data ran out
    train       scatter_batch (balanced by tokens), trainer.train_step: V → V + 1; rank 0
                meanwhile renews the batch's lease and prefetches the next one
    ack         role.ack: rank 0 acks the batch, only now may the buffer forget its groups
    publish     engine_state (collective: full weights or adapters), role.publish: rank 0
                sends V + 1 to the engines and the buffer, writes the record, evaluates
    checkpoint  checkpointer.after_step: every checkpoint.every_steps (sharded DCP)
    agree       end_of_step: one collective: stop? buffer lost? the next batch's shares?

With ``launcher.colocate`` the learner shares its device with the engines: before train, the
engines sleep and its state comes back from host memory; after the gather it goes back and the
engines wake (:mod:`learners.colocate`). Otherwise those two calls do nothing.

Every rank runs the same step through one interface (:class:`~learners.rank_role.RankRole`):
rank 0's (:mod:`learners.rank_zero`) reads the buffer and owns the weights, metrics and eval;
the other ranks' does nothing there, so every rank meets the same collectives in the same
order (a rank in another collective deadlocks, or fails gloo). The agreements:
:mod:`learners.agreement`. Before the steps, resume from the latest checkpoint, after them
the run's end: :mod:`learners.lifecycle`. A buffer that stops answering while the learner
trains costs no training: every rank saves the steps it took, then the role exits
(:mod:`learners.lost`).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.config import Config
from asyncrl.evaluation import EvaluatorFactory
from asyncrl.metrics import Timers
from buffers import connect_buffer
from learners.agreement import agree_any, end_of_step
from learners.lifecycle import counters, end_of_run, reached_before, resume
from learners.lora import engine_state
from learners.lost import BufferLost, Lost, save_before_exit
from learners.rank_role import RankContext, RankRole, make_role

logger = logging.getLogger(__name__)

RAN_OUT = object()  # what _next_batch returns once every worker's share of data.path ran out


@dataclass
class _Leaving:
    """What this rank's way out of the process group depends on."""

    role: RankRole | None = None
    buffer_lost: bool = False  # the delivery in flight may fail for want of the buffer
    alone: bool = False   # past the last collective: the others are on their way to the barrier
    failed: bool = False  # failed on its own: the others are in another collective


def run_learner_rank(cfg: Config, rank: int, world: int, address: str | None, master_port: int,
                     stop: threading.Event | None = None, *,
                     evaluator: EvaluatorFactory) -> None:
    """One training rank; rank 0 also owns the weight broadcast, metrics and evaluation
    (``evaluator`` builds its :class:`~asyncrl.evaluation.Evaluator`)."""
    from asyncrl.exits import GroupLeft
    from learners.dist import peer_left

    stop = stop or threading.Event()
    ctx, model_dir, device = _join(cfg, rank, world, address, master_port, stop)
    leaving = _Leaving()
    try:
        _run(ctx, model_dir, device, stop, leaving, evaluator)
    except Exception as exc:
        # Rank 0's end of run (final eval, run status, weight delivery) is its alone: an error
        # there, or the stop of a buffer that no longer answers, still meets the others in the
        # barrier, which they reached; they exit as they should, and this rank with its error.
        leaving.failed = not leaving.alone
        left = peer_left(exc)
        if left is None:
            raise
        # Another rank's process is gone: the rank that left is the cause, and the supervisor
        # that ran it says why; this one only says that it followed.
        raise GroupLeft(f"learner rank {rank}/{world}: another rank left the process group "
                        f"({left})") from None
    except BaseException:
        leaving.failed = not leaving.alone
        raise
    finally:
        _leave(ctx, leaving)


def _join(cfg: Config, rank: int, world: int, address: str | None, master_port: int,
          stop: threading.Event) -> tuple[RankContext, Path, Any]:
    """The rank's model directory, its place in the process group and its buffer client."""
    import torch

    from asyncrl.models import prepare_model_dir
    from learners.dist import init_learner_group

    torch.set_num_threads(cfg.learner.threads)
    torch.manual_seed(cfg.run.seed + rank)
    # Before the process group: transformers' save_pretrained writes nothing on a process whose
    # torch.distributed rank is not 0, so a rank > 0 that built the initial model first would
    # publish a directory without weights.
    model_dir = prepare_model_dir(cfg.model, cfg.run_dir, cfg.run.seed)
    device = init_learner_group(rank, world, master_port=master_port,
                                master_addr=cfg.learner.master_addr, device=cfg.learner.device,
                                timeout_s=cfg.learner.collective_timeout_s)
    ctx = RankContext(cfg, rank, world, connect_buffer(cfg, address, stop), f"learner-{rank}",
                      address, stop)
    return ctx, model_dir, device


def _run(ctx: RankContext, model_dir: Path, device, stop: threading.Event,
         leaving: _Leaving, evaluator: EvaluatorFactory) -> None:
    """Resume, train, end the run: this rank's part of it, inside the process group."""
    from learners.backends import make_trainer
    from learners.checkpoint import Checkpointer

    cfg = ctx.cfg
    trainer = make_trainer(model_dir, cfg.learner, device, sim=cfg.sim, lora=cfg.model.lora,
                           attn_implementation=cfg.model.attn_implementation,
                           temperature=cfg.rollout.temperature,
                           freeze_vision=cfg.model.freeze_vision)
    checkpointer = Checkpointer(cfg)
    role = leaving.role = make_role(ctx, model_dir, evaluator)
    reached = reached_before(cfg, resume(ctx, checkpointer, trainer, role))
    resumed_at = trainer.version
    role.starting(resumed_at, reached)
    try:
        # as every rank agreed: a rank's own stop event may be its alone
        stopped = _train(ctx, trainer, role, stop, checkpointer) if reached is None else False
    except BufferLost as lost:
        leaving.buffer_lost = True
        stop.set()  # the role is stopping: its threads' buffer requests give up at once
        save_before_exit(cfg, trainer, checkpointer, resumed_at, lost.stopping, role.reached)
        if not lost.stopping:
            raise
        return  # a stop, as asked: no export or final eval (they need the buffer's run)
    ended = end_of_run(cfg, trainer, checkpointer, role, stopped, resumed_at)
    if ended is not None:
        state, done = ended
        leaving.alone = True   # past the last collective: rank 0 ends the run alone
        role.finish(state, trainer.version, done=done)


def _leave(ctx: RankContext, leaving: _Leaving) -> None:
    """Let go of the role, the buffer client and the process group, whatever raised."""
    from learners.dist import shutdown_learner_group

    try:
        if leaving.role is not None:
            leaving.role.close(leaving.buffer_lost)
    finally:  # every rank leaves the group, whatever rank 0's close raised
        ctx.client.close()
        try:
            # The barrier only on the way out of a run: a rank leaving on an error of its own
            # (a failed weight delivery, eval, ack...) met the others in another collective
            # and all waited out collective_timeout_s (300 s), the others then failing with a
            # gloo timeout instead of the real cause. Without it, its exit closes their
            # connections: they fail at once with GroupLeft, and its own error is the cause.
            shutdown_learner_group(barrier=not leaving.failed)
        finally:
            # Past the barrier rank 0 has closed: its last delivery, which the other ranks'
            # slice senders (weights.fanout) served, is over.
            if leaving.role is not None:
                leaving.role.left_group()


def _train(ctx: RankContext, trainer, role: RankRole, stop: threading.Event,
           checkpointer) -> bool:
    """Train until ``total_steps`` or the end of the data (False), or until the ranks agree
    to stop (True): a stop event set on any rank, or the eval target reached (rank 0)."""
    from learners.colocate import make_phases

    # launcher.colocate: the device is time-sliced with the engines (learners.colocate)
    phases = make_phases(ctx.cfg, trainer, ctx.client, ctx.rank, ctx.world,
                         lambda state: ctx.client.heartbeat(ctx.member, "learner", {
                             **role.last_record, "state": state, "version": trainer.version}))
    try:
        return _steps(ctx, trainer, role, stop, checkpointer, phases)
    finally:
        phases.end()   # the run's end (export, final checkpoint) gathers on the device


def _steps(ctx: RankContext, trainer, role: RankRole, stop: threading.Event, checkpointer,
           phases) -> bool:
    """:func:`_train`'s steps; ``phases``: :func:`learners.colocate.make_phases`."""
    from learners.balance import scatter_batch

    cfg, timers, lost = ctx.cfg, Timers(), Lost()
    header = None   # the next batch's shares, when agreed at the end of the step before
    while trainer.version < cfg.learner.total_steps:
        with timers("wait_data"):
            fetched = _next_batch(ctx, role, trainer.version, stop, lost, header is not None)
        if fetched is None:
            return True
        if fetched is RAN_OUT:   # the end of the data is the end of training
            return False
        phases.train_phase(trainer.version, lost)   # colocated: engines asleep, state back in
        with timers("compute"), role.leased() as batch:   # renewed while it trains
            with timers("scatter"):   # part of compute: the balanced split and its transfer
                share = scatter_batch(batch, ctx.rank, ctx.world, header)
            role.prefetch(trainer.version + 1)
            metrics = trainer.train_step(share)
        stats = role.ack(trainer.version, metrics, lost)
        with timers("gather"):
            state = engine_state(trainer, cfg)  # full weights, or LoRA adapters alone
        metrics.update(phases.rollout_phase(lost))  # colocated: the state out, engines wake
        reached = role.publish(trainer.version, state, metrics, stats, timers.pop(), lost)
        checkpointer.after_step(trainer, counters(cfg, trainer.version, stats, role.reached))
        stopping, header, gone = end_of_step(ctx.world, role, trainer.version,
                                             reached or stop.is_set(), lost)
        if gone:
            raise lost.error(stopping)
        if stopping:
            return True
    return False


def _next_batch(ctx: RankContext, role: RankRole, version: int, stop: threading.Event,
                lost: Lost, ready: bool = False):
    """Rank 0 waits for ``groups_per_step`` fresh groups, heartbeating and re-syncing late
    joiners; after every poll all ranks agree whether a batch came or a stop. Returns True
    once rank 0 holds the batch (fetched and collated ahead, during the previous step:
    :mod:`learners.batch_feed`), ``None`` on every rank to stop. The other ranks wait in
    that agreement rather than in the batch's scatter, so an empty buffer never runs into
    the process group's timeout; :data:`RAN_OUT` on every rank once the data ran out for
    good (rank 0 asks the buffer after each empty poll). ``ready``: every rank already
    agreed that rank 0 holds the batch (:func:`~learners.agreement.end_of_step`): it is
    handed over, no agreement. A rank whose buffer request got no answer says so in the
    agreement; then every rank raises :class:`~learners.lost.BufferLost`."""
    if ready:
        role.take_ready(version)
        return True
    while True:
        got, ran_out = role.poll(version, stop, lost)
        got, stopping, gone, ended = agree_any(ctx.world, [got, stop.is_set(),
                                                           lost.cause is not None, ran_out])
        if gone:
            raise lost.error(stopping)
        if got and not stopping:
            return True
        if ended and not stopping:
            role.say("ending the run at step %d of learner.total_steps = %d: the data ran "
                     "out", version, ctx.cfg.learner.total_steps)
            return RAN_OUT
        if not got:
            # Rank 0 keeps its last step's record in the heartbeat: a monitor of a learner
            # starved for data still shows that step (and that the learner is waiting).
            lost.call(ctx.client.heartbeat, ctx.member, "learner",
                      {**role.last_record, "state": "waiting for data", "version": version})
        if stopping:
            return None   # a batch fetched meanwhile stays unacked: the buffer redelivers it
        lost.call(role.resync_late_joiners, version)
