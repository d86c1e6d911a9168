"""A learner run's start and end, around the training steps: resume from a checkpoint (or
check the buffer is fresh), what the checkpoint records for a resume, and the run's end (the
last checkpoint and the export; rank 0 then evaluates and marks the run done). The save
before exit when the buffer is lost: :mod:`learners.lost`.

Every function here runs on every rank, at the same point: those marked COLLECTIVE meet the
other ranks in the process group.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from asyncrl.config import Config, ConfigError
from buffers.backends import buffer_backend
from learners.agreement import agree_max
from learners.lora import engine_state, sends_adapters

if TYPE_CHECKING:
    from learners.checkpoint import CheckpointMeta
    from learners.rank_role import RankContext, RankRole

logger = logging.getLogger(__name__)


def groups_consumed(cfg: Config, version: int) -> int:
    """Groups a learner at ``version`` has consumed: every step takes ``groups_per_step``
    (a step whose groups were all filtered still consumes them). What it tells a buffer
    that did not see those steps (a resume, an ack to a broker that lost its state)."""
    return version * cfg.learner.groups_per_step


def counters(cfg: Config, version: int, stats: dict,
             reached: dict[str, Any] | None = None) -> dict[str, Any]:
    """The data position and the buffer's gate counters at this step, for ``meta.json``: the
    buffer keeps the live ones; these say where a resumed run picks up. On rank 0 (which
    writes the meta), once the eval target was reached (``reached``), ``eval_target``: where
    and with which score (:func:`reached_before` reads it)."""
    return {"groups_consumed": groups_consumed(cfg, version),
            "buffer": {k: v for k, v in stats.items() if isinstance(v, (int, float, str))},
            **({"eval_target": reached} if reached else {})}


def resume(ctx: RankContext, checkpointer, trainer, role: RankRole) -> CheckpointMeta | None:
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
        check_fresh_buffer(ctx)
        return None
    consumed = int(meta.counters.get("groups_consumed", groups_consumed(ctx.cfg, meta.version)))
    # Every rank asks (it is idempotent); no one publishes now, so they get the same answer.
    buffer_version = agree_max(ctx.world, ctx.client.restore_progress(trainer.version, consumed),
                               "the buffer's version at resume")
    ctx.client.heartbeat(ctx.member, "learner", {"state": "resuming", "version": trainer.version})
    if buffer_version > trainer.version:
        why = ("--resume of an earlier checkpoint" if ctx.cfg.checkpoint.path else
               f"steps {trainer.version + 1}..{buffer_version} were lost with the learner")
        logger.warning("checkpoint version %d is behind the buffer's %d (%s): continuing as "
                       "version %d", trainer.version, buffer_version, why, buffer_version)
        trainer.version = buffer_version
    state = engine_state(trainer, ctx.cfg)  # collective
    role.resumed(state, trainer.version)
    return meta


def reached_before(cfg: Config, meta: CheckpointMeta | None) -> dict[str, Any] | None:
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


def check_fresh_buffer(ctx: RankContext) -> None:
    """A learner with no checkpoint starts at version 0. A buffer already past that holds
    an earlier run of this name (a spill file replayed, a Redis namespace kept by a hand-run
    broker): going on would publish versions the buffer has passed (refused at the first step)
    and train on that run's groups. Stop at once instead, saying what to do (the ranks agree
    on the answer, :func:`~learners.agreement.agree_max`, so they stop together)."""
    cfg = ctx.cfg
    version = agree_max(ctx.world, int(ctx.client.heartbeat(
        ctx.member, "learner", {"state": "starting", "version": 0})["version"]),
        "the buffer's version at a fresh start")
    if version == 0:
        return
    where = buffer_backend(cfg.buffer).earlier_run_hint(cfg.run_dir)
    raise ConfigError(
        f"run.name = {cfg.run.name!r}: the buffer holds this run at version {version}, and "
        f"this learner has no checkpoint in {cfg.run_dir / cfg.checkpoint.dir} to resume "
        f"from. Resume with the run's checkpoints (checkpoint.resume, --resume PATH), or "
        f"start a fresh run: a new run.name, or the buffer restarted without the old run "
        f"({where})")


def end_of_run(cfg: Config, trainer, checkpointer, role: RankRole, stopped: bool,
                 resumed_at: int) -> tuple[Any, bool] | None:
    """The run's end on every rank (COLLECTIVE): the last checkpoint, marked finished or not,
    and the export. Returns the engines' weights and whether the run is done, for rank 0's
    end (:meth:`RankRole.finish`), past the last collective; None when there is nothing to
    end: a stop before the first step (e.g. a rollout config error) leaves no checkpoint,
    export or final eval, which would look like the outcome of a run that never started.

    A stop (signal) leaves the run resumable; the end of training marks it finished, as does
    the eval target reached, signal or not (rank 0 writes the meta and decides). ``stopped``
    as every rank agreed, not the rank's own event: a signal to one node's ranks stops them
    all, and rank 0, not signalled itself, marked the unfinished run finished (done, its
    rollouts told to end, and never resumed)."""
    if stopped and trainer.version == resumed_at:
        logger.info("stopped before training a step: no checkpoint, export or final eval")
        return None
    done = not stopped or role.reached is not None
    checkpointer.save(trainer, {**counters(cfg, trainer.version, {}, role.reached),
                                "finished": done})
    state = engine_state(trainer, cfg, sent=False)  # collective; not sent: on rank 0 only
    # The engines' full weights are the export's: gathered once (not with adapters alone).
    trainer.save_pretrained(cfg.run_dir / "final", state=None if sends_adapters(cfg) else state)
    return state, done
