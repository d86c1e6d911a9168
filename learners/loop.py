"""The learner driver: consume a batch, step, broadcast weights, publish the version.

One step reads like the algorithm::

    rank 0: groups = buffer.get_batch(groups_per_step, V)    # waits only if the buffer is empty
    share   = scatter_batch(collate(groups))                 # balanced by tokens across ranks
    metrics = trainer.train_step(share)                      # micro-batched; V → V + 1
    weights = trainer.full_state_dict()                       # collective across ranks
    rank 0: publisher.publish(weights, V + 1)   # on its own thread: sync to the engines,
                                                # then buffer.publish_version(V + 1)
    every checkpoint.every_steps: checkpoint.save(...)           # sharded DCP + meta.json

A restarted learner first resumes from its latest checkpoint (``learners.checkpoint``). A
buffer that stops answering while the learner trains (:class:`BufferLost`) costs no training:
every rank saves the steps it took, then the role exits.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.config import Config, ConfigError
from asyncrl.evaluation import EvaluatorFactory
from asyncrl.metrics import Timers, val_score
from asyncrl.prometheus import start_endpoint
from asyncrl.sinks import make_sinks
from buffers import BufferClient, connect_buffer, stopped_by, unanswered
from buffers.lease import keep_leased
from buffers.protocol import DATA_EXHAUSTED, DONE, RUN_STATUS_KEY
from learners.checkpoint import CheckpointMeta
from learners.lora import engine_state, sends_adapters

logger = logging.getLogger(__name__)

BATCH_POLL_S = 2.0  # get_batch long-poll; between polls rank 0 re-syncs engines that joined late
RAN_OUT = object()  # what _next_batch returns once every worker's share of data.path ran out


class BufferLost(TimeoutError):
    """The buffer stopped answering while the learner trained (a ZMQ broker or Redis gone
    for good, past ``buffer.request_timeout_s`` and the client's re-sends).

    Raised on every rank at the same point, after an agreement, so that all of them save the
    steps taken since the last checkpoint (a collective) before the role exits. Without it, a
    broker lost for good cost up to ``checkpoint.every_steps`` steps of training. On the rank
    whose request failed it is raised from that failure. A :class:`TimeoutError`, as the
    failure itself was: a one-rank learner still exits with status 3 (the buffer could not
    be reached; the supervisor of several ranks exits 1).

    ``stopping``: some rank was stopping when they agreed (a signal, or the eval target
    reached). Then the lost buffer only cut short a stop that was asked for: every rank saves
    its steps and ends as a stop does, quietly and with status 0, whichever rank's request
    failed: the agreement, not each rank's own failure, says so, or a rank that only heard of
    the loss from another would exit as if the buffer had been lost mid-run."""

    def __init__(self, message: str, stopping: bool = False) -> None:
        super().__init__(message)
        self.stopping = stopping


class _Lost:
    """This rank's first buffer request that got no answer. Once there is one, the rank's
    later requests are skipped: each would wait out the whole request timeout again."""

    def __init__(self) -> None:
        self.cause: BaseException | None = None

    def call(self, request: Callable[..., Any], *args: Any, default: Any = None,
             **kwargs: Any) -> Any:
        """``request(*args, **kwargs)``, or ``default`` when the buffer is lost (already, or
        now: a failure that is not a lost buffer is raised as it is)."""
        if self.cause is not None:
            return default
        try:
            return request(*args, **kwargs)
        except Exception as exc:
            if unanswered(exc) is None:
                raise
            # a stop on a signal that gave up on a silent buffer is not an error
            (logger.info if stopped_by(exc) else logger.error)(
                "the buffer did not answer: %s", exc)
            self.cause = exc
            return default

    def error(self, stopping: bool) -> BufferLost:
        """What every rank raises once they agreed that one of them lost the buffer;
        ``stopping``: whether they also agreed to stop."""
        error = BufferLost(f"the buffer stopped answering: {self.cause}" if self.cause else
                           "another learner rank lost the buffer", stopping)
        error.__cause__ = self.cause
        return error


@dataclass
class RankContext:
    cfg: Config
    rank: int
    world: int
    client: BufferClient
    member: str
    address: str | None = None
    stop: threading.Event | None = None  # the role's: the rank's buffer clients are given it


def run_learner_rank(cfg: Config, rank: int, world: int, address: str | None, master_port: int,
                     stop: threading.Event | None = None, *,
                     evaluator: EvaluatorFactory) -> None:
    """One training rank; rank 0 also owns the weight broadcast, metrics and evaluation
    (``evaluator`` builds its :class:`~asyncrl.evaluation.Evaluator`)."""
    import torch

    from asyncrl.models import prepare_model_dir
    from asyncrl.exits import GroupLeft
    from learners.backends import make_trainer
    from learners.checkpoint import Checkpointer
    from learners.dist import init_learner_group, peer_left, shutdown_learner_group

    stop = stop or threading.Event()
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
    driver, buffer_lost, failed = None, False, False
    alone = False  # past the last collective: the other ranks are on their way to the barrier
    try:
        trainer = make_trainer(model_dir, cfg.learner, device, sim=cfg.sim, lora=cfg.model.lora)
        checkpointer = Checkpointer(cfg)
        driver = _RankZero(ctx, model_dir, evaluator) if rank == 0 else None
        reached = _reached_before(cfg, _resume(ctx, checkpointer, trainer, driver))
        resumed_at = trainer.version
        if driver is not None:
            driver.reached = reached
            driver.writer.started_from(resumed_at)  # later steps' records: another line
        stopped = False  # as every rank agreed: a rank's own stop event may be its alone
        try:
            if reached is None:
                stopped = _train(ctx, trainer, driver, stop, checkpointer)
        except BufferLost as lost:
            buffer_lost = True
            stop.set()  # the role is stopping: its threads' buffer requests give up at once
            _save_before_exit(cfg, trainer, checkpointer, resumed_at, lost.stopping, driver)
            if not lost.stopping:
                raise
            return  # a stop, as asked: no export or final eval (they need the buffer's run)
        if stopped and trainer.version == resumed_at:  # e.g. a rollout config error
            logger.info("stopped before training a step: no checkpoint, export or final eval")
            return
        # A stop (signal) leaves the run resumable; the end of training marks it finished, as
        # does the eval target reached, signal or not (rank 0 writes the meta and decides).
        # ``stopped``, not the rank's own event: a signal to one node's ranks stops them all,
        # and rank 0, not signalled itself, marked the unfinished run finished (done, its
        # rollouts told to end, and never resumed).
        done = not stopped or (driver is not None and driver.reached is not None)
        checkpointer.save(trainer, {**_counters(cfg, trainer.version, {}, driver),
                                    "finished": done})
        state = engine_state(trainer, cfg)  # collective
        # The engines' full weights are the export's: gathered once (not with adapters alone).
        trainer.save_pretrained(cfg.run_dir / "final",
                                state=None if sends_adapters(cfg) else state)
        alone = True
        if driver is not None:
            driver.finish(state, trainer.version, done=done)
    except Exception as exc:
        # Rank 0's end of run (final eval, run status, weight delivery) is its alone: an error
        # there, or the stop of a buffer that no longer answers, still meets the others in the
        # barrier, which they reached; they exit as they should, and this rank with its error.
        failed = not alone
        left = peer_left(exc)
        if left is None:
            raise
        # Another rank's process is gone: the rank that left is the cause, and the supervisor
        # that ran it says why; this one only says that it followed.
        raise GroupLeft(f"learner rank {rank}/{world}: another rank left the process group "
                        f"({left})") from None
    except BaseException:
        failed = not alone
        raise
    finally:
        try:
            if driver is not None:
                driver.close(buffer_lost)
        finally:  # every rank leaves the group, whatever rank 0's close raised
            ctx.client.close()
            # The barrier only on the way out of a run: a rank leaving on an error of its own
            # (a failed weight delivery, eval, ack...) met the others in another collective
            # and all waited out collective_timeout_s (300 s), the others then failing with a
            # gloo timeout instead of the real cause. Without it, its exit closes their
            # connections: they fail at once with GroupLeft, and its own error is the cause.
            shutdown_learner_group(barrier=not failed)


def _save_before_exit(cfg: Config, trainer, checkpointer, resumed_at: int,
                      stopping: bool, driver: _RankZero | None) -> None:
    """Every rank, the buffer lost: checkpoint the steps taken (COLLECTIVE), so that a learner
    restarted once the buffer is back resumes from the last one, not from the last periodic
    checkpoint. A step whose ack the buffer never got keeps its groups pending there: they
    are delivered and trained again (at-least-once), as after a learner crash. ``stopping``:
    the ranks were stopping anyway (:class:`BufferLost`), which is no error. When the stop
    was the eval target reached, the checkpoint says so (:func:`_counters`): the learner
    started again only finishes the run, as it would have without the loss."""
    log, lost = ((logger.info, "stopped while the buffer did not answer") if stopping
                 else (logger.error, "the buffer was lost"))
    if trainer.version == resumed_at:
        log("%s before a step was trained: nothing to save", lost)
        return
    checkpointer.save(trainer, {**_counters(cfg, trainer.version, {}, driver),
                                "finished": False})
    log("%s: saved a checkpoint at version %d in %s; start the learner again once the buffer "
        "answers and it resumes there", lost, trainer.version, cfg.run_dir / cfg.checkpoint.dir)


def _resume(ctx: RankContext, checkpointer, trainer,
            driver: _RankZero | None) -> CheckpointMeta | None:
    """Load the checkpoint to resume from, if any (COLLECTIVE); rank 0 then re-syncs engines.
    Returns its meta, None on a fresh start.

    A buffer that outlived the learner may hold a later version B than the checkpoint's V: the
    steps V+1..B were lost with the learner, but versions were published and the buffer's gate
    let groups in for them. Going on from V would reuse version numbers for other weights and,
    since the buffer refuses going backwards, keep the gate closed while V+1..B are redone
    (a deadlock once B − V > max_staleness). So the restored weights continue as version B.

    A buffer that did NOT outlive the learner (a broker restarted without spill, a reset Redis
    namespace) knows nothing of the V steps: it is seeded from the checkpoint
    (``restore_progress``), or its gate would let ``V × groups_per_step`` extra groups in."""
    meta = checkpointer.resume(trainer)
    if meta is None:
        _check_fresh_buffer(ctx)
        return None
    consumed = int(meta.counters.get("groups_consumed", groups_consumed(ctx.cfg, meta.version)))
    # Every rank asks (it is idempotent); no one publishes now, so they get the same answer.
    buffer_version = _agree_max(ctx, ctx.client.restore_progress(trainer.version, consumed),
                                "the buffer's version at resume")
    ctx.client.heartbeat(ctx.member, "learner", {"state": "resuming", "version": trainer.version})
    if buffer_version > trainer.version:
        why = ("--resume of an earlier checkpoint" if ctx.cfg.checkpoint.path else
               f"steps {trainer.version + 1}..{buffer_version} were lost with the learner")
        logger.warning("checkpoint version %d is behind the buffer's %d (%s): continuing as "
                       "version %d", trainer.version, buffer_version, why, buffer_version)
        trainer.version = buffer_version
    state = engine_state(trainer, ctx.cfg)  # collective
    if driver is not None:
        driver.resumed(state, trainer.version)
    return meta


def _reached_before(cfg: Config, meta: CheckpointMeta | None) -> dict[str, Any] | None:
    """The eval target reached before the checkpoint was saved (its ``eval_target``), when it
    still meets ``eval.stop_at_accuracy``; else None. Such a checkpoint is unfinished only
    because the run was stopped (a signal, the buffer lost) in the step that reached the
    target: resumed, the learner finishes the run (export, final eval, the run marked done)
    without training on. Every rank reads the same meta and so decides the same. A target
    raised since, or taken out, trains on."""
    recorded = meta.counters.get("eval_target") if meta is not None else None
    target = cfg.eval.stop_at_accuracy
    if not recorded:
        return None
    if target is None or recorded["score"] < target:
        logger.info("the eval target was reached at version %d (val score %.3f), but "
                    "eval.stop_at_accuracy is now %s: training on", recorded["version"],
                    recorded["score"], "unset" if target is None else target)
        return None
    logger.info("the eval target was reached at version %d (val score %.3f >= "
                "eval.stop_at_accuracy %.3f) before the run stopped: finishing it without "
                "training on", recorded["version"], recorded["score"], target)
    return recorded


def _check_fresh_buffer(ctx: RankContext) -> None:
    """A learner with no checkpoint starts at version 0. A buffer already past that holds
    an earlier run of this name (a spill file replayed, a Redis namespace kept by a hand-run
    broker): going on would publish versions the buffer has passed (refused at the first step)
    and train on that run's groups. Stop at once instead, saying what to do (the ranks agree
    on the answer, :func:`_agree_max`, so they stop together)."""
    cfg = ctx.cfg
    version = _agree_max(ctx, int(ctx.client.heartbeat(
        ctx.member, "learner", {"state": "starting", "version": 0})["version"]),
        "the buffer's version at a fresh start")
    if version == 0:
        return
    if cfg.buffer.type == "redis":
        where = "clear the run's Redis keys, as a fresh `asyncrl up` does"
    else:
        from buffers.zmq_replay import spill_file

        spill = spill_file(cfg.buffer.zmq.spill_path, cfg.run_dir)
        where = f"move its spill file {spill} aside" if spill else "restart the broker"
    raise ConfigError(
        f"run.name = {cfg.run.name!r}: the buffer holds this run at version {version}, and "
        f"this learner has no checkpoint in {cfg.run_dir / cfg.checkpoint.dir} to resume "
        f"from. Resume with the run's checkpoints (checkpoint.resume, --resume PATH), or "
        f"start a fresh run: a new run.name, or the buffer restarted without the old run "
        f"({where})")


def _train(ctx: RankContext, trainer, driver: _RankZero | None, stop: threading.Event,
           checkpointer) -> bool:
    """Train until ``total_steps`` or the end of the data (False), or until the ranks agree
    to stop (True): a stop event set on any rank, or the eval target reached (rank 0)."""
    from learners.balance import scatter_batch

    cfg, timers, lost = ctx.cfg, Timers(), _Lost()
    header = None   # the next batch's shares, when agreed at the end of the step before
    while trainer.version < cfg.learner.total_steps:
        with timers("wait_data"):
            fetched = _next_batch(ctx, trainer, driver, stop, lost, ready=header is not None)
        if fetched is None:
            return True
        if fetched is RAN_OUT:   # the end of the data is the end of training
            if driver is not None:
                logger.info("ending the run at step %d of learner.total_steps = %d: the data "
                            "ran out", trainer.version, cfg.learner.total_steps)
            return False
        # rank 0's batch, collated and packed for the scatter on the prefetch thread
        batch, (outgoing, filter_counts) = (fetched if driver is not None
                                            else (None, (None, {})))
        # The step may outlast buffer.reclaim_idle_s: rank 0 renews the batch's lease
        # meanwhile, so it is not redelivered to another learner and trained twice.
        lease = (keep_leased(ctx.client, ctx.member, batch, cfg.buffer.reclaim_idle_s)
                 if driver is not None else contextlib.nullcontext())
        with timers("compute"), lease:
            with timers("scatter"):   # part of compute: the balanced split and its transfer
                share = scatter_batch(outgoing, ctx.rank, ctx.world, header)
            if driver is not None and trainer.version + 1 < cfg.learner.total_steps:
                # the next batch, while this one trains (after the scatter: not competing
                # with it for rank 0's interpreter)
                driver.prefetcher.start(trainer.version + 1)
            metrics = trainer.train_step(share)
        stats: dict = {}
        if driver is not None:   # rank 0 read the batch: it acks it and reports on it
            # only now may the buffer forget these groups; the count lets a broker that
            # lost its state take over the steps it did not see (BufferClient.ack)
            lost.call(ctx.client.ack, ctx.member, batch,
                      consumed=groups_consumed(cfg, trainer.version))
            metrics.update({f"filter/{k}": float(v) for k, v in filter_counts.items()})
            metrics.update(_consumed_versions(batch.groups, trainer.version - 1,
                                              cfg.buffer.max_staleness))
            stats = batch.stats
        with timers("gather"):
            state = engine_state(trainer, cfg)  # full weights, or LoRA adapters alone
        should_stop = False
        if driver is not None:
            should_stop = driver.after_step(trainer.version, state, metrics, stats,
                                            timers.pop(), lost)
        checkpointer.after_step(trainer, _counters(cfg, trainer.version, stats, driver))
        stopping, header, gone = _end_of_step(ctx, driver, trainer.version,
                                              should_stop or stop.is_set(), lost)
        if gone:
            raise lost.error(stopping)
        if stopping:
            return True
    return False


def _prepare(cfg: Config, world: int, batch):
    """Rank 0, on the prefetch thread: the step's batch collated (:func:`_collate`) and, with
    several ranks, already split and packed for the scatter (none of it is collective)."""
    from learners.balance import pack_shares

    whole, filter_counts = _collate(cfg, batch)
    return (pack_shares(whole, world) if world > 1 else whole), filter_counts


def _collate(cfg: Config, batch):
    """Rank 0: the step's groups, filtered (DAPO), as ONE batch with advantages per group."""
    from asyncrl.models import PAD_ID
    from learners.batching import collate
    from learners.losses.filters import filter_groups, zero_loss_mask

    groups, filter_counts = filter_groups(batch.groups, cfg.learner.loss)
    # train_step is collective: a step whose groups were all filtered still runs, with a group
    # that trains no token.
    groups = groups or [zero_loss_mask(batch.groups[0])]
    loss = cfg.learner.loss
    return collate(groups, cfg.learner.advantage_std_norm, PAD_ID, advantage=loss.advantage,
                   step_advantage=loss.step_advantage,
                   step_gamma=loss.step_gamma), filter_counts


def _next_batch(ctx: RankContext, trainer, driver: _RankZero | None, stop: threading.Event,
                lost: _Lost, ready: bool = False):
    """Rank 0 waits for ``groups_per_step`` fresh groups, heartbeating and re-syncing late
    joiners; after every poll all ranks agree whether a batch came or a stop. Returns
    ``(batch, collated)`` on rank 0 (fetched and collated ahead, during the previous step:
    :mod:`learners.prefetch`), ``True`` on the others, ``None`` on every rank to stop. The
    other ranks wait in that agreement rather than in the batch's scatter, so an empty buffer
    never runs into the process group's timeout; :data:`RAN_OUT` on every rank once the data
    ran out for good (rank 0 asks the buffer after each empty poll). ``ready``: every rank
    already agreed that rank 0 holds the batch (:func:`_end_of_step`): it is handed over, no
    agreement. A rank whose buffer request got no answer says so in the agreement; then every
    rank raises :class:`BufferLost`."""
    if ready:
        if driver is None:
            return True
        batch = driver.prefetcher.take(trainer.version, 0.0)
        if batch is None:
            raise RuntimeError(f"the batch of version {trainer.version} was agreed ready "
                               f"and is not")
        return batch
    while True:
        batch = None
        if driver is not None and not stop.is_set():
            batch = lost.call(driver.prefetcher.take, trainer.version, BATCH_POLL_S)
        ran_out = (driver is not None and batch is None and not stop.is_set()
                   and lost.call(driver.data_ran_out, default=False))
        got, stopping, gone, ended = _agree_any([batch is not None, stop.is_set(),
                                                 lost.cause is not None, ran_out], ctx.world)
        if gone:
            raise lost.error(stopping)
        if got and not stopping:
            return batch if driver is not None else True
        if ended and not stopping:
            return RAN_OUT
        if not got:
            # Rank 0 keeps its last step's record in the heartbeat: a monitor of a learner
            # starved for data still shows that step (and that the learner is waiting).
            last = driver.last_record if driver is not None else {}
            lost.call(ctx.client.heartbeat, ctx.member, "learner",
                      {**last, "state": "waiting for data", "version": trainer.version})
        if stopping:
            return None   # a batch fetched meanwhile stays unacked: the buffer redelivers it
        if driver is not None:
            lost.call(driver.resync_late_joiners, trainer.version)


def data_ran_out(status: dict[str, Any], groups_per_step: int) -> str | None:
    """Why no batch can come any more, from a buffer's ``status()``, or None while one may.

    A rollout worker whose share of data.path ran out (``data.epochs`` passes) exits, its
    last heartbeat saying so with its share (:data:`~buffers.protocol.DATA_EXHAUSTED`).
    Once every share of the fleet's split ran out and the buffer holds less than a step,
    nothing will fill the next batch: the learner used to wait for it for ever, and ``asyncrl
    up`` with it, saying nothing. Shares are counted, not workers: a restarted worker reads
    its share on from where it stopped, and runs out with it."""
    shares: set[int] = set()
    fleets: set[int] = set()
    for member in status.get("members", {}).values():
        info = member.get("info") or {}
        if member.get("role") == "rollout" and info.get("exit") == DATA_EXHAUSTED:
            index, workers = info["shard"]
            shares.add(index)
            fleets.add(workers)
    if len(fleets) != 1:   # no share ran out yet, or fleets that split the data differently
        return None
    workers, = fleets
    depth, in_flight = status.get("depth", 0), status.get("in_flight", 0)
    if shares != set(range(workers)) or depth >= groups_per_step or in_flight:
        return None
    return (f"the {workers} rollout workers' shares of data.path all ran out, and the buffer "
            f"holds {depth} group(s), fewer than learner.groups_per_step = {groups_per_step}")


def groups_consumed(cfg: Config, version: int) -> int:
    """Groups a learner at ``version`` has consumed: every step takes ``groups_per_step``
    (a step whose groups were all filtered still consumes them). What it tells a buffer
    that did not see those steps (a resume, an ack to a broker that lost its state)."""
    return version * cfg.learner.groups_per_step


def _counters(cfg: Config, version: int, stats: dict,
              driver: _RankZero | None = None) -> dict[str, Any]:
    """The data position and the buffer's gate counters at this step, for ``meta.json``: the
    buffer keeps the live ones; these say where a resumed run picks up. On rank 0 (which
    writes the meta), once the eval target was reached, ``eval_target``: where and with
    which score (:func:`_reached_before` reads it)."""
    reached = driver.reached if driver is not None else None
    return {"groups_consumed": groups_consumed(cfg, version),
            "buffer": {k: v for k, v in stats.items() if isinstance(v, (int, float, str))},
            **({"eval_target": reached} if reached else {})}


def _consumed_versions(groups, version: int, max_staleness: int) -> dict[str, Any]:
    """Staleness of what this step trained on: the whole batch, on rank 0 (the s = 0 test
    reads it), with ``staleness/hist``: groups consumed at staleness 0..s (the gate admits no
    more; anything older was dropped by the buffer)."""
    versions = [v for g in groups if (v := g.versions[g.loss_mask.astype(bool)]).size]
    # A group that generated no trained token is as fresh as can be (the buffer's rule):
    # counted as -1's staleness it read as version + 1 steps stale.
    stale = [g.staleness(version) for g in groups]
    hist = [0] * (max_staleness + 1)
    for value in stale:
        hist[min(max(value, 0), max_staleness)] += 1
    span = ({"staleness/consumed_version_min": float(min(int(v.min()) for v in versions)),
             "staleness/consumed_version_max": float(max(int(v.max()) for v in versions))}
            if versions else {})  # none when no group of the batch has a trained token
    return {**span, "staleness/max": float(max(stale)),
            "staleness/mean": sum(stale) / len(stale), "staleness/hist": hist}


def _end_of_step(ctx: RankContext, driver: _RankZero | None, version: int, stopping: bool,
                 lost: _Lost) -> tuple[bool, Any, bool]:
    """ONE all-reduce at the end of a step: whether to stop (rank 0 decides on an eval
    target, any rank may be told to stop), and whether rank 0 already holds the batch of
    ``version`` (prefetched during the step) together with its shares' sizes. When it does,
    the next step starts with no agreement of its own and its scatter with no broadcast:
    two collectives fewer per step, each costing the slowest rank's scheduling delay
    (5-20 ms for 8 ranks on 2 busy cores in bench/pipeline.py). Returns ``(stop,
    header, gone)``; ``header`` is None when the batch is not there yet (``_next_batch``
    waits); ``gone``: a rank lost the buffer (:class:`BufferLost`), and then ``stop`` says
    whether any rank was stopping as well (``BufferLost.stopping``)."""
    import torch

    from learners.dist import gather_rows

    gone = lost.cause is not None
    if ctx.world == 1:
        return stopping, None, gone
    shares = torch.zeros(ctx.world, 2, dtype=torch.float64)
    ready = False
    if driver is not None and not (stopping or gone):
        prepared = driver.prefetcher.prepared(version)
        if prepared is not None:
            ready, shares = True, prepared[0].header.to(torch.float64)
    flags = torch.cat([torch.tensor([float(stopping), float(ready), float(gone)],
                                    dtype=torch.float64), shares.reshape(-1)])
    flags = gather_rows(flags).max(0).values   # the others' zeros leave rank 0's values
    if flags[2]:
        return bool(flags[0]), None, True
    if flags[0]:
        return True, None, False
    return False, (flags[3:].reshape(ctx.world, 2).to(torch.int64) if flags[1] else None), False


def _every_rank(values: list[int], world: int) -> list[list[int]]:
    """Every rank's ``values``, one row per rank, on every rank (one all-gather). COLLECTIVE."""
    import torch

    from learners.dist import gather_rows

    if world == 1:
        return [values]
    return gather_rows(torch.tensor(values, dtype=torch.int64)).tolist()


def _agree_max(ctx: RankContext, value: int, what: str) -> int:
    """The largest of the ranks' ``value``, on every rank (one all-gather). COLLECTIVE.

    Why: where each rank asks the buffer for itself (the version at resume, at a fresh
    start), the ranks should get the same answer, and what they do next depends on it: the
    version they train on, or whether they stop. A buffer restarted between two ranks'
    requests could answer them differently; ranks that went on with different versions
    would publish under numbers that do not match their weights, and a rank that stopped
    alone would leave the others waiting in their next collective for ever. Differing
    answers are logged."""
    values = [row[0] for row in _every_rank([value], ctx.world)]
    if len(set(values)) > 1:
        logger.warning("%s differed between the learner's ranks (%s): going on with the "
                       "largest, %d", what, values, max(values))
    return max(values)


def _agree_any(flags: list[bool], world: int) -> list[bool]:
    """Each flag OR-ed over the ranks (one all-gather). COLLECTIVE."""
    return [any(column) for column in zip(*_every_rank([int(f) for f in flags], world))]


class _RankZero:
    """What only rank 0 does: broadcast weights, publish versions, write metrics, evaluate."""

    def __init__(self, ctx: RankContext, model_dir: Path, evaluator: EvaluatorFactory) -> None:
        from asyncrl.net import broadcast_host
        from asyncrl.weights.broadcaster import WeightBroadcaster, broadcast_align, engine_weights
        from asyncrl.weights.publisher import WeightPublisher
        from learners.prefetch import BatchPrefetcher

        self.ctx, self.cfg = ctx, ctx.cfg
        # The next batch is fetched and collated on a thread of its own, with its own client.
        self.prefetcher = BatchPrefetcher(
            connect_buffer(self.cfg, ctx.address, ctx.stop), ctx.member,
            self.cfg.learner.groups_per_step,
            lambda batch: _prepare(self.cfg, ctx.world, batch), BATCH_POLL_S,
            self.cfg.buffer.reclaim_idle_s)
        # The publisher delivers weights on a thread of its own: it gets a client of its own.
        # Waiting for a delivery (slow engines: up to weights.timeout_s), this thread beats.
        self.weights_client = connect_buffer(self.cfg, ctx.address, ctx.stop)
        self.publisher = WeightPublisher(
            self.weights_client,
            WeightBroadcaster(self.weights_client,
                              engine_weights(self.cfg.weights, self.cfg.rollout.engine),
                              sim_sync_s=self.cfg.sim.sync_s,
                              align=broadcast_align(self.cfg.rollout.engine),
                              host=broadcast_host(self.cfg, ctx.address)),
            overlap=self.cfg.weights.overlap,
            beat=lambda: ctx.client.heartbeat(ctx.member, "learner", {
                **self.last_record, "state": "waiting for engines", "version": self.version}))
        self.writer = make_sinks(self.cfg.monitor, self.cfg.run_dir, self.cfg.run.name,
                                 self.cfg.model_dump(mode="json"))
        self.endpoint = start_endpoint(self.cfg.monitor, "learner", ctx.member)
        self.evaluator = evaluator(self.cfg, model_dir)
        self.start = self.last_step_end = time.monotonic()
        self.last_state: dict[str, Any] | None = None
        self.last_eval: dict[str, float] = {}
        self.last_record: dict[str, Any] = {}
        self.version = 0  # the latest version handed to the publisher
        # the eval that reached eval.stop_at_accuracy: {"version", "score", "target"}
        self.reached: dict[str, Any] | None = None

    def resumed(self, state, version: int) -> None:
        """After a restart from a checkpoint, engines that outlived the learner hold weights it
        lost: send them the restored ones right away, and again to any that join later."""
        self.last_state, self.version = state, version
        # a fresh buffer learns V; a surviving one has it
        self.publisher.deliver_now(state, version)

    def after_step(self, version: int, state, metrics: dict, stats: dict,
                   phase_times: dict, lost: _Lost) -> bool:
        """Publish the step's weights and write its record; the record is written even when
        the buffer is lost (``lost``: its requests are skipped), so that every trained step,
        saved by :func:`_save_before_exit`, has one."""
        self.version = version
        # overlap: the previous version's metrics
        sync = lost.call(self.publisher.publish, state, version, default={})
        self.last_state = state
        now = time.monotonic()
        step_s = now - self.last_step_end
        metrics["perf/trained_tokens_per_s"] = metrics["perf/trained_tokens"] / step_s
        self.last_step_end = now
        record = {"step": version, "training/global_step": version,
                  "time_s": round(now - self.start, 3), "timing/step": step_s, **metrics,
                  **phase_times, **sync,
                  **{f"buffer/{k}": v for k, v in stats.items()},
                  **lost.call(self._rollout_totals, default={})}
        if self.cfg.eval.every_steps and version % self.cfg.eval.every_steps == 0:
            record.update(self.evaluate(state, version))
        self.writer.write(record)
        if self.endpoint is not None:
            self.endpoint.publish(record)
        lost.call(self.ctx.client.heartbeat, self.ctx.member, "learner", record)
        self.last_record = record
        _log_step(record)
        target = self.cfg.eval.stop_at_accuracy
        score = val_score(record)
        if target is not None and score is not None and score >= target:
            self.reached = {"version": version, "score": float(score), "target": target}
        return self.reached is not None

    def evaluate(self, state, version: int) -> dict[str, float]:
        self.last_eval = self.evaluator.evaluate(state, version)
        return self.last_eval

    def data_ran_out(self) -> bool:
        """Whether the data ran out for good (:func:`data_ran_out`); said once, when it did.
        Without ``data.epochs`` over a ``data.path`` it never does: no status request."""
        if not (self.cfg.data.path and self.cfg.data.epochs):
            return False
        why = data_ran_out(self.ctx.client.status(), self.cfg.learner.groups_per_step)
        if why is not None:
            logger.info("the data ran out: %s", why)
        return why is not None

    def resync_late_joiners(self, version: int) -> None:
        """An engine that joined after the last step would wait for weights forever while
        the learner waits for data (with small s): give it the current version now."""
        if self.last_state is not None:
            self.publisher.resync(self.last_state, version)

    def _rollout_totals(self) -> dict[str, float]:
        members = self.ctx.client.status().get("members", {})
        infos = [m.get("info", {}) for m in members.values()
                 if m.get("role") == "rollout" and m.get("alive")]
        return {"rollout/workers": len(infos),
                "rollout/tokens_per_s": sum(i.get("tokens_per_s", 0.0) for i in infos),
                "rollout/gate_wait_s": sum(i.get("gate_wait_s", 0.0) for i in infos),
                "rollout/generate_s": sum(i.get("generate_s", 0.0) for i in infos)}

    def finish(self, state, version: int, done: bool) -> None:
        """The final eval, and, when training finished (``done``), the run marked done: its
        workers exit and the buffer discards what was never consumed. A stopped run is left
        running for its resume: its broker replays the status from the spill file (Redis
        keeps it), and a resumed run marked done would find its workers gone."""
        self.publisher.wait()  # the last version is published before the run is marked done
        final = self.evaluate(state, version)
        record = {"step": "final", "time_s": round(time.monotonic() - self.start, 3), **final}
        self.writer.write(record)
        (self.cfg.run_dir / "eval.json").write_text(json.dumps(final, indent=2))
        if done:
            self.ctx.client.set_key(RUN_STATUS_KEY, {"status": DONE})
        self.close()
        logger.info("final held-out greedy eval: %s", final)


    def close(self, buffer_lost: bool = False) -> None:
        """Finish the weight delivery in flight (engines leave), flush the metric sinks and stop
        serving /metrics (idempotent). ``buffer_lost``: the delivery in flight failing for want
        of the buffer is expected, logged, not raised (the role exits on :class:`BufferLost`)."""
        self.prefetcher.close()
        if self.weights_client is not None:
            try:
                self.publisher.close()
            except Exception as exc:
                if not (buffer_lost and unanswered(exc)):
                    raise
                logger.warning("the weight delivery in flight ended with the buffer: %s",
                               unanswered(exc))
            finally:
                self.weights_client.close()
                self.weights_client = None
        self.writer.close()
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None


def _log_step(record: dict) -> None:
    score = val_score(record)
    logger.info("step %s  score %.3f  loss %+.4f  staleness max %d  %s",
                record["step"], record.get("critic/score/mean", float("nan")),
                record.get("actor/loss", float("nan")),
                record.get("staleness/max", 0),
                f"val score {score:.3f}" if score is not None else "")
